"""Gradients made in the step: PyTorch's default ``zero_grad(set_to_none=True)`` against ``.grad`` kept (CPU, one run).

With ``zero_grad(set_to_none=True)`` (PyTorch's default, what Hugging Face's Trainer calls) every ``.grad`` is
None when a step starts, so the step allocates each parameter's gradient in its backward and keeps it. hierremat
counts those bytes in the budget (ChainCosts.step_grad_bytes) and, at each call, runs the plan made for what the
step will allocate. Before, it planned as if ``.grad`` were kept allocated: the issue's GPT-2 below measured
105.9 MiB at a 63.6 MiB budget (1.67x), the example's tiny model 24.85 MB at 23.41 MB (1.06x).

Models (random weights, fp32, train mode, nothing downloaded), called the Hugging Face way
(``model(ids, labels=ids, use_cache=False)``, the step backpropagates ``.loss``):
  gpt2-4x256-32k   GPT-2, 4 layers, 256 wide, vocabulary 32000, batch 1, seq 64 (the issue's);
  example-tiny     examples/gpt2/finetune.py's default model (--size tiny), batch 4, seq 128.
Methods, side by side on the same weights and batch, each under both ``zero_grad`` settings:
  plain       eager autograd: every time ratio is to it under the same setting;
  hierremat   ``hierremat.remat`` at the issue's budget, or at the smallest feasible budget where the
              issue's is smaller (the error's ``min_budget_bytes``, stated).
Peak: the CPU allocator meter (torch.profiler's memory events) and the live-tensor tracker, over one step
after a warm-up step (each step starts with ``zero_grad(set_to_none=...)``). Time: median over ``--rounds``
rounds, methods interleaved in a seeded shuffled order. Beside it, the plan's predicted peak and step time
(deterministic). Grad diff: max |grad - plain's| after one step from the same weights.

    python benchmarks/bench_step_grads.py [--rounds 7]

Writes benchmarks/results/bench_step_grads.md.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import time
from dataclasses import dataclass, field

import torch

import common as C
import hierremat as hr
from hierremat.device import LiveTensorTracker

RESULTS = C.RESULTS_DIR / "bench_step_grads.md"
SEED = 1234
MB = 10**6


def _gpt2(n_layer: int, n_embd: int, n_head: int, vocab: int, positions: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab, n_positions=positions,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).train()


def _example_tiny():
    spec = importlib.util.spec_from_file_location("finetune", C.REPO_ROOT / "examples" / "gpt2" / "finetune.py")
    finetune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(finetune)
    model, _ = finetune.load_model_and_tokenizer(finetune.parse_args([]))
    return model.train()


#: name -> (model builder, batch, seq, the issue's budget in bytes)
WORKLOADS = {
    "gpt2-4x256-32k": (lambda: _gpt2(4, 256, 4, 32000, 128), 1, 64, int(63.6 * C.MIB)),
    "example-tiny": (_example_tiny, 4, 128, int(23.41 * MB)),
}


@dataclass
class Row:
    workload: str
    set_to_none: bool
    method: str
    module: torch.nn.Module
    params: list
    budget: int | None = None
    note: str = ""
    alloc_peak: int = 0
    tracker_peak: int = 0
    times: list[float] = field(default_factory=list)
    grads: list | None = None
    grad_diff: float | None = None

    def step(self, ids: torch.Tensor) -> None:
        for p in self.params:
            if self.set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
            else:
                p.grad = torch.zeros_like(p)
        self.module(ids, labels=ids, use_cache=False).loss.backward()


def _plan_budget(model, ids, budget: int) -> tuple[int, str]:
    """The issue's budget where it plans, else the smallest feasible one (with a note)."""
    try:
        hr.plan(model, (ids,), {"labels": ids, "use_cache": False}, budget=budget)
        return budget, ""
    except hr.InfeasibleBudgetError as err:
        return err.min_budget_bytes, f"issue's {budget / C.MIB:.2f} MiB infeasible: {err}"


def run(names: list[str], rounds: int) -> str:
    tables = []
    for name in names:
        build, batch, seq, issue_budget = WORKLOADS[name]
        torch.manual_seed(SEED)
        base = build()
        ids = torch.randint(0, base.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(SEED))
        rows = []
        for set_to_none in (True, False):
            plain = copy.deepcopy(base)
            rows.append(Row(name, set_to_none, "plain", plain, [p for p in plain.parameters() if p.requires_grad]))
            model = copy.deepcopy(base)
            if not set_to_none:
                for p in model.parameters():
                    p.grad = torch.zeros_like(p)
            budget, note = _plan_budget(model, ids, issue_budget)
            module = hr.remat(model, (ids,), {"labels": ids, "use_cache": False}, budget=budget,
                              settings=hr.Settings(defer_block_options=False))  # (the plan with its block options)
            rows.append(Row(name, set_to_none, "hierremat", module, [p for p in model.parameters() if p.requires_grad],
                            budget, note))
        for row in rows:  # gradients after one step from the same weights (the first step plans)
            torch.manual_seed(SEED)
            row.step(ids)
            row.grads = C.grads_of(row.params)
        for row in rows:
            row.step(ids)  # warm-up: a re-plan for a new .grad state happens here
            row.alloc_peak = C.allocator_peak_bytes(lambda: row.step(ids))
            with LiveTensorTracker() as tracker:
                row.step(ids)
            row.tracker_peak = tracker.peak_bytes

        def timed(row: Row, _round: int) -> None:
            started = time.perf_counter()
            row.step(ids)
            row.times.append(time.perf_counter() - started)

        C.interleave(rows, rounds, SEED, timed)
        table = []
        for row in rows:
            plain = next(r for r in rows if r.method == "plain" and r.set_to_none == row.set_to_none)
            row.grad_diff = C.max_abs_diff(row.grads, plain.grads)
            plan = row.module.plans[-1] if row.method == "hierremat" else None
            table.append([
                name, f"set_to_none={row.set_to_none}", row.method,
                C.fmt(row.budget / C.MIB if row.budget else None), C.fmt(row.alloc_peak / C.MIB),
                C.fmt(row.tracker_peak / C.MIB), C.fmt(row.alloc_peak / row.budget if row.budget else None, ".3f"),
                C.fmt(plan.predicted_peak_bytes / C.MIB if plan else None),
                C.fmt(sum(plan.chain.costs.step_grad_bytes) / C.MIB if plan else None),
                C.fmt(C.median(row.times) * 1e3, ".1f"), C.fmt(C.median(row.times) / C.median(plain.times), ".2f"),
                C.fmt(plan.predicted_step_time * 1e3 if plan else None, ".1f"), f"{row.grad_diff:.1e}",
            ])
            if row.note:
                table.append(["", "", f"note: {row.note}"] + [""] * 10)
        tables.append(C.markdown_table(
            ["workload", "zero_grad", "method", "budget MiB", "alloc peak MiB", "tracker MiB", "peak/budget",
             "predicted MiB", "step grads MiB", "median ms", "x plain", "predicted ms", "grad diff"], table,
        ))
    return "\n\n".join(tables)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--models", default=",".join(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    started = time.perf_counter()
    text = run(args.models.split(","), args.rounds)
    info = ", ".join(f"{k} {v}" for k, v in C.device_info(torch.device("cpu"), torch.get_num_threads()).items())
    header = (f"# bench_step_grads\n\n{info}\n\n"
              f"`python benchmarks/bench_step_grads.py --rounds {args.rounds}` ({time.perf_counter() - started:.0f} s)\n\n")
    C.write_results(RESULTS, header + text + "\n")


if __name__ == "__main__":
    main()
