"""ReLU's backward from a 1-bit mask (hierremat.blocks.variants.relu_masks): what the block ILP's choice buys.

Models (random weights, fp32, train mode, CPU), planned with ``hierremat.plan_sequential``:
  relu-mlp  nn.Sequential: 6 x (LayerNorm | Linear 256->1024, ReLU, Dropout 0.1, Linear 1024->256) + in/out
            Linear; input (512, 64): run_all's MLP with ReLU instead of GELU;
  resnet    run_all's ResNet-style nn.Sequential (stem + 6 BasicBlocks, widths 32/64/128); input (8, 3, 64, 64).
Methods, side by side: hierremat with every operator variant ("with masks"), and the same with the ReLU rewrite
switched off ("without": every other variant still on), on the same model and input.

Deterministic figures only (no wall time): the smallest feasible budget (``InfeasibleBudgetError.min_budget_bytes``
after asking for 1 KiB), and at the larger of the two floors and at 1.5x and 2x it, the plan's predicted step as
overhead over keeping everything (both from the same profile, so the ratio is stable across runs). One real step
at each floor checks the live-tensor peak against the budget and the gradients against plain autograd's.

    python benchmarks/bench_relu_masks.py

Writes benchmarks/results/bench_relu_masks.md.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import torch
from torch import nn

import common as C
import hierremat as hr
from hierremat.planning import menus
from hierremat.device import LiveTensorTracker
from run_all import resnet_seq

MIB = 2**20


def relu_mlp():
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, 256)]
    for _ in range(6):
        layers += [nn.LayerNorm(256), nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Dropout(0.1), nn.Linear(1024, 256))]
    layers.append(nn.Linear(256, 16))
    return nn.Sequential(*layers), torch.randn(512, 64)


def resnet():
    torch.manual_seed(0)
    model, x, _ = resnet_seq(32, 2, 8, 64)
    return model, x


@contextlib.contextmanager
def rewrite_switched(name: str, on: bool):
    """Planning with or without the rewrite ``hierremat.planning.menus.<name>`` (the other
    variants stay on)."""
    real = getattr(menus, name)
    if not on:
        setattr(menus, name, lambda joint: joint)
    try:
        yield
    finally:
        setattr(menus, name, real)
        hr.plan_cache.clear()  # plans are keyed by model, input and budget: not by this switch


relu_masks = functools.partial(rewrite_switched, "pack_relu_masks")


def step(model, x, budget=None):
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    torch.manual_seed(1)
    with LiveTensorTracker() as tracker:
        y = model(x) if budget is None else hr.checkpoint_sequential(model, budget, x)
        y.float().pow(2).mean().backward()
    return tracker.peak_bytes, [p.grad.clone() for p in model.parameters()]


def compare(models, switch, labels: tuple[str, str], column: str, title: str, results_name: str) -> None:
    """For each (name, make) of ``models``: floors, a real step at each floor and predicted
    overheads with one rewrite off and on (``switch(on)``, a context manager); the table goes to
    benchmarks/results/``results_name`` under ``title``, rows labelled ``labels`` (off, on)."""
    rows = []
    for name, make in models:
        model, x = make()
        _, plain_grads = step(copy.deepcopy(model), x)
        floors = {}
        for on in (False, True):
            with switch(on):
                floors[on] = C.smallest_feasible_budget(lambda b: hr.plan_sequential(model, b, x))
        top = max(floors.values())
        for on in (False, True):
            with switch(on):
                hr.checkpoint_sequential(model, floors[on], x)  # plan outside the measured step
                peak, grads = step(model, x, floors[on])
                overheads = []
                for factor in (1.0, 1.5, 2.0):
                    plan = hr.plan_sequential(model, int(top * factor), x)
                    overheads.append(plan.predicted_step_time / plan.no_remat_step_time - 1)
            rows.append([
                name, labels[on], f"{floors[on] / MIB:.2f}",
                f"{floors[on] / floors[False]:.3f}", f"{peak / MIB:.2f}", "yes" if peak <= floors[on] else "NO",
                f"{C.max_abs_diff(grads, plain_grads):.1e}", *(f"{o:+.1%}" for o in overheads),
            ])
    header = ["model", column, "floor MiB", "floor / without", "peak at floor MiB", "peak <= floor",
              "grad diff", "overhead at 1x", "at 1.5x", "at 2x"]
    info = C.device_info(torch.device("cpu"), torch.get_num_threads())
    text = (
        f"# {title}\n\n"
        f"Machine: {info['device_name']} ({info['cpu_count']} CPUs, {info['torch_threads']} torch threads); "
        f"torch {info['torch']}, hierremat {info['hierremat']} ({info['revision']}); {info['date']}.\n\n"
        "Floor: smallest feasible budget. Overheads: predicted step over keeping everything (profiled op costs), "
        "at the larger floor of the model's two rows times 1, 1.5 and 2. Grad diff: max |grad - plain autograd's| "
        "after one step at the floor.\n\n"
        + C.markdown_table(header, rows) + "\n"
    )
    C.write_results(C.RESULTS_DIR / results_name, text)


def main() -> None:
    compare((("relu-mlp", relu_mlp), ("resnet", resnet)), relu_masks, ("without", "with masks"), "ReLU masks",
            "ReLU backward from packed masks: floors and predicted overheads", "bench_relu_masks.md")


if __name__ == "__main__":
    main()
