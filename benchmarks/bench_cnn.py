"""MONeT's CNNs as torchvision ships them: budgets from 0.67 to 0.33 of plain's peak and the floor (CPU).

Models (torchvision, ``weights=None``, train mode, fp32, 224 x 224 inputs, nothing downloaded), each at its batch:
  resnet50      batch 4
  googlenet     batch 4 (``aux_logits=False``: the step trains the main head)
  mobilenet_v2  batch 4 (its in-place ReLU6 at block boundaries as shipped)
  vgg16         batch 1 (its in-place ReLUs, and the 392 MiB weight of its first fully connected layer)
The loss is cross-entropy outside the model; every ``.grad`` is allocated before the step (zeroed), as after a
first step with ``zero_grad(set_to_none=False)``.

Per model: plain autograd's peak by both CPU meters (the live-tensor tracker and the allocator meter, torch.profiler's
memory events); hierremat's smallest feasible budget; then ``hierremat.remat`` at
0.67, 0.5 and 0.33 of plain's allocator peak (a fraction below the floor is run at the floor, marked) and at the
floor. Each row: the budget, both meters' peaks over one step after three warm-up steps as ratios to the budget,
whether the gradients and BatchNorm buffers equal plain's bitwise, and the step time as a ratio to plain's (medians
over ``--rounds`` rounds, every method once a round in a seeded shuffled order). Cold plan: ``hierremat.plan`` at
0.33 of plain's peak with an empty block-option cache.

    python benchmarks/bench_cnn.py [--models resnet50,googlenet,mobilenet_v2,vgg16] [--rounds 5]

Needs torchvision (a benchmark dependency only). Writes benchmarks/results/bench_cnn.md.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

import common as C
import hierremat as hr

sys.path.insert(0, str(C.REPO_ROOT / "tests"))
from harness import Step, train_step, with_grads  # noqa: E402

RESULTS = C.RESULTS_DIR / "bench_cnn.md"
BATCHES = {"resnet50": 4, "googlenet": 4, "mobilenet_v2": 4, "vgg16": 1}
FRACTIONS = (0.67, 0.5, 0.33)
WARMUP = 3


def build(name: str) -> torch.nn.Module:
    import torchvision

    torch.manual_seed(0)
    extra = {"aux_logits": False, "init_weights": True} if name == "googlenet" else {}
    return getattr(torchvision.models, name)(weights=None, **extra).train()


def cross_entropy(out: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out, torch.arange(out.shape[0]) % out.shape[1])


@dataclass(frozen=True)
class Row:
    label: str
    budget: int
    step: Step
    bitwise: bool


def bitwise(step: Step, plain: Step) -> bool:
    pairs = list(zip(step.grads, plain.grads)) + list(zip(step.buffers, plain.buffers))
    return all(torch.equal(a, b) for a, b in pairs)


def floor_of(model, x) -> int:
    try:
        hr.plan(model, (x,), budget="1KiB")
    except hr.InfeasibleBudgetError as err:
        return err.min_budget_bytes
    raise AssertionError("1 KiB fits")


def cold_plan_seconds(model, x, budget: int) -> float:
    with tempfile.TemporaryDirectory(prefix="bench-cnn-cache-") as cache:
        started = time.perf_counter()
        hr.plan(model, (x,), budget=f"{budget}B", settings=hr.Settings(cache=cache))
        return time.perf_counter() - started


def run_model(name: str, rounds: int) -> tuple[list[str], float, dict]:
    model, batch = build(name), BATCHES[name]
    x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    plain_model = copy.deepcopy(model)
    plain = train_step(plain_model, (x,), cross_entropy, warmup=WARMUP)
    floor = floor_of(with_grads(model), x)
    rows, modules = [], {"plain": plain_model}
    for fraction in (*FRACTIONS, None):
        wanted = floor if fraction is None else int(fraction * plain.allocator_peak)
        budget = max(floor, wanted)
        label = "floor" if fraction is None else f"{fraction:.2f}" + (" (floor)" if wanted < floor else "")
        module = hr.remat(with_grads(copy.deepcopy(model)), (x,), budget=f"{budget}B")
        step = train_step(module, (x,), cross_entropy, warmup=WARMUP)
        rows.append(Row(label, budget, step, bitwise(step, plain)))
        modules[label] = module
    times = {label: [] for label in modules}

    def run(label, _round):
        m = modules[label]
        times[label].append(C.timed_step(lambda: cross_entropy(m(x)).backward(), list(m.parameters()), x.device))

    C.interleave(list(modules), rounds, seed=0, run=run)
    plain_time = C.median(times["plain"])
    cold = cold_plan_seconds(model, x, max(floor, int(0.33 * plain.allocator_peak)))
    table = [[name, "plain", f"{plain.allocator_peak / C.MIB:.1f}", f"{plain.tracker_peak / plain.allocator_peak:.4f}",
              "1.0000", "", f"{plain_time:.3f} s"]]
    for row in rows:
        table.append([name, row.label, f"{row.budget / C.MIB:.1f}", f"{row.step.tracker_peak / row.budget:.4f}",
                      f"{row.step.allocator_peak / row.budget:.4f}", "yes" if row.bitwise else "NO",
                      f"{C.median(times[row.label]) / plain_time:.2f}x"])
    summary = {"batch": batch, "floor": floor / plain.allocator_peak, "cold_plan_s": cold}
    return table, cold, summary


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(BATCHES))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    header = ["model", "budget (of plain's peak)", "budget MiB", "tracker / budget", "allocator / budget",
              "bitwise", "step (to plain)"]
    rows, notes = [], []
    for name in args.models.split(","):
        table, cold, summary = run_model(name, args.rounds)
        rows += table
        notes.append(f"- {name}: batch {summary['batch']}, floor {summary['floor']:.3f} of plain's allocator peak, "
                     f"cold plan {cold:.1f} s")
    info = C.device_info(torch.device("cpu"), torch.get_num_threads())
    text = "\n".join([
        "# MONeT's CNNs (torchvision) under budgets", "",
        f"{info['device_name']}, {info['torch_threads']} threads, torch {info['torch']}, hierremat {info['revision']}, "
        f"{info['date']}. Plain's row: its allocator peak in MiB, its tracker peak as a ratio to that.", "",
        C.markdown_table(header, rows), "", *notes, "",
    ])
    C.write_results(RESULTS, text)


if __name__ == "__main__":
    main()
