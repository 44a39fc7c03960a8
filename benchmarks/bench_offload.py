"""Offloading checkpoints to a second tier: the plan with ``offload=True`` against the plan without,
at budgets from the smallest feasible one to keeping everything, and plain autograd, side by side in one run.

Model: 12-layer GPT-2 (768 wide, vocabulary 50257, random weights, dropout 0.1, fp32, train mode, nothing
downloaded), batch 2 x seq 512 by default, called the Hugging Face way (``model(ids, labels=ids,
use_cache=False)``), planned with ``outputs="loss"`` (the fused LM head: the issue's 77 MiB floor).
One capture and one profile (``hierremat.explore(..., offload=True)``): every plan, with the second tier
and without it (``plan(budget, offload=False)``), is solved from the same measured costs, so their predicted
times compare exactly; each is then run with ``hierremat.remat(model, ..., plan=plan)``.
On CPU the second tier is a disk tier in the system's temporary directory (bandwidths measured durable); on
CUDA (``--device cuda``) it is pinned host memory. ``--bf16``: every step under bf16 autocast.

Budgets: the smallest feasible one without offloading (the issue's floor), then ``--points`` budgets spaced
geometrically up to plain's predicted peak (keeping everything). Where both plans are the same schedule the
step is measured once (it is the same computation). Time: median wall seconds of a step over ``--rounds``
rounds, methods interleaved in a seeded shuffled order, ``.grad`` kept allocated; beside it the plan's
predicted step (deterministic, from the one profile). Peak: the live-tensor tracker and the CPU allocator meter
over one step (on CUDA: ``torch.cuda.max_memory_allocated`` above what was allocated before the step). Grad
diff: max |grad - plain's| after one step from the same weights and seed, and the offloading plan's against
the plan without at the same budget (bitwise where they run the same stage options). Tier peak: the most bytes
the second tier held at once during a step (the disk tier's files).

    python benchmarks/bench_offload.py [--rounds 3] [--points 5] [--layers 12 --batch 2 --seq 512] [--stem NAME]
                                       [--device cuda] [--bf16]

Writes benchmarks/results/bench_offload.md (or NAME.md).
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from dataclasses import dataclass, field

import torch

import common as C
import hierremat as hr
from hierremat.device import LiveTensorTracker

SEED = 1234


def _gpt2(n_layer: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(SEED)
    config = GPT2Config(n_layer=n_layer, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).train()


@dataclass
class Row:
    budget: int | None
    offload: bool | None  # None: plain autograd
    module: torch.nn.Module
    plan: object = None
    same_as: "Row | None" = None  # the row whose schedule this one runs (measured there)
    times: list[float] = field(default_factory=list)
    tracker_peak: int | None = 0  # None: not measured (CUDA)
    alloc_peak: int = 0
    tier_peak: int = 0
    grads: list | None = None

    @property
    def name(self) -> str:
        if self.offload is None:
            return "plain autograd"
        return "hierremat, offload=True" if self.offload else "hierremat"


class _TierWatch:
    """The most bytes the disk tier's files held at once, read at every fetch."""

    def __init__(self):
        self.peak = 0

    def __call__(self, tier) -> None:
        self.peak = max(self.peak, getattr(tier, "file_bytes", tier.held_bytes))


def _watch_tier(module, watch: _TierWatch, watched_tiers: set) -> None:
    """Read the tier's file sizes just before each fetch (when it holds the most); once per tier."""
    runner = next(c for c in module._planned.values()).chain_module.planned.runner
    tier = runner.tier
    if tier is None or id(tier) in watched_tiers:
        return
    watched_tiers.add(id(tier))
    fetch = tier.fetch

    def watched(key):
        watch(tier)
        return fetch(key)

    tier.fetch = watched


def run(layers: int, batch: int, seq: int, points: int, rounds: int, device: torch.device,
        bf16: bool) -> tuple[str, list[str]]:
    model = _gpt2(layers).to(device)
    params = C.params_of(model)
    ids = torch.randint(0, 50257, (batch, seq), generator=torch.Generator().manual_seed(SEED)).to(device)
    kwargs = {"labels": ids, "use_cache": False}
    notes = []
    C.zero_grads(params)  # (.grad kept allocated through the run: the budget does not count it)
    started = time.perf_counter()
    with C.step_autocast(device, bf16):  # (the explorer and every plan under the autocast the steps run with)
        # (the steps' backward runs after the autocast context closed: planned for that recipe)
        explorer = hr.explore(model, (ids,), kwargs, outputs="loss",
                              settings=hr.Settings(offload=True, backward_autocast=False))
        notes.append(f"one capture and profile, menus and the tier's bandwidths: {time.perf_counter() - started:.1f} s")
        floor_without = explorer.smallest_feasible(offload=False)
        floor_with = explorer.smallest_feasible(offload=True)
    top = max(explorer.keep_all_bytes, floor_without + 1)
    budgets = sorted({floor_without} | {int(floor_without * (top / floor_without) ** (k / points))
                                         for k in range(1, points + 1)})
    rows = [Row(None, None, model)]
    for budget in budgets:
        with C.step_autocast(device, bf16):
            without = explorer.plan(budget, offload=False)
            with_tier = explorer.plan(budget, offload=True)
            base = Row(budget, False, hr.remat(model, (ids,), kwargs, plan=without), without)
            off = Row(budget, True, hr.remat(model, (ids,), kwargs, plan=with_tier), with_tier)
        if with_tier.chain.schedule == without.chain.schedule:
            off.same_as = base
        rows += [base, off]
    measured = [r for r in rows if r.same_as is None]
    watch, watched_tiers = _TierWatch(), set()

    def step(row: Row):
        def go():
            with C.step_autocast(device, bf16):
                loss = row.module(ids, **kwargs).loss
            loss.backward()
        return go

    for row in measured:  # gradients after one step from the same weights (and dropout seed)
        C.zero_grads(params)
        torch.manual_seed(SEED)
        step(row)()
        row.grads = C.grads_of(params)
        if row.offload:
            _watch_tier(row.module, watch, watched_tiers)

    for row in measured:
        C.zero_grads(params)
        watch.peak = 0
        if device.type == "cpu":
            row.alloc_peak = C.allocator_peak_bytes(step(row))
            C.zero_grads(params)
            with LiveTensorTracker() as tracker:
                step(row)()
            row.tracker_peak = tracker.peak_bytes
        else:
            row.alloc_peak, row.tracker_peak = C.peak_bytes(step(row), device), None
        row.tier_peak = watch.peak

    C.interleave(measured, rounds, SEED, lambda row, _r: row.times.append(C.timed_step(step(row), params, device)))
    plain = rows[0]
    plain_time = C.median(plain.times)
    def mib(nbytes: int | None) -> str:
        return C.fmt(nbytes / C.MIB if nbytes is not None else None)

    table = [["plain autograd", "", "", "1.00", "", C.fmt(plain_time, ".3f"), mib(plain.tracker_peak),
              C.fmt(plain.alloc_peak / C.MIB), "", "", "", "0", ""]]
    for row in rows[1:]:
        source = row.same_as or row
        without = next(r for r in rows if r.budget == row.budget and r.offload is False)
        chain = row.plan.chain
        moved = chain.offload_line().split(";")[1].split(",")[0].strip() if row.offload and chain.offloads else ""
        diff_plain = C.max_abs_diff(source.grads, plain.grads)
        diff_without = C.max_abs_diff(source.grads, (without.same_as or without).grads) if row.offload else math.nan
        table.append([
            row.name + (" (same schedule)" if row.same_as is not None else ""),
            C.fmt(row.budget / C.MIB), C.fmt(row.plan.predicted_peak_bytes / C.MIB),
            C.fmt(C.median(source.times) / plain_time, ".2f"),
            C.fmt(row.plan.predicted_step_time / without.plan.predicted_step_time, ".3f") if row.offload else "1.000",
            C.fmt(C.median(source.times), ".3f"), mib(source.tracker_peak), mib(source.alloc_peak),
            C.fmt(source.alloc_peak / row.budget, ".3f"), C.fmt(row.plan.predicted_step_time, ".3f"),
            moved, f"{diff_plain:.1e}", "" if math.isnan(diff_without) else f"{diff_without:.1e}",
        ])
        if row.offload and row.same_as is None:
            table[-1][10] += f"; tier peak {source.tier_peak / C.MIB:.2f} MiB"
    notes.append(f"smallest feasible budget: {floor_without / C.MIB:.2f} MiB without offloading, "
                 f"{floor_with / C.MIB:.2f} MiB with it ({floor_with / floor_without:.3f}x)")
    tier_line = next((r.plan.chain.offload_line() for r in rows[1:] if r.offload), "")
    notes.append(f"second tier: {tier_line.split('(')[-1].rstrip(')')}")
    text = C.markdown_table(
        ["method", "budget MiB", "predicted MiB", "x plain (measured)", "predicted x without offload", "step s",
         "tracker MiB", "alloc MiB", "alloc/budget", "predicted step s", "moved each way", "grad diff vs plain",
         "vs without offload"], table,
    )
    for row in rows[1:]:
        if row.offload and row.plan.chain.offloads and row.budget == budgets[0]:
            notes.append(f"at the floor, the offloading plan:\n\n```\n{row.plan.summary()}\n```")
    return text, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--points", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stem", default="bench_offload", help="results file name (without .md)")
    parser.add_argument("--device", default="cpu", help="cpu (the disk tier) or cuda (pinned host memory)")
    parser.add_argument("--bf16", action="store_true", help="every step under bf16 autocast")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    started = time.perf_counter()
    device = torch.device(args.device)
    text, notes = run(args.layers, args.batch, args.seq, args.points, args.rounds, device, args.bf16)
    info = ", ".join(f"{k} {v}" for k, v in C.device_info(device, torch.get_num_threads()).items())
    command = (f"python benchmarks/bench_offload.py --layers {args.layers} --batch {args.batch} --seq {args.seq} "
               f"--points {args.points} --rounds {args.rounds}"
               + (f" --stem {args.stem}" if args.stem != "bench_offload" else "")
               + (f" --device {args.device}" if device.type != "cpu" else "") + (" --bf16" if args.bf16 else ""))
    header = (f"# bench_offload: GPT-2 {args.layers} layers, outputs='loss', offload=True vs without\n\n{info}\n\n"
              f"`{command}` ({time.perf_counter() - started:.0f} s)\n\n")
    body = text + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    C.write_results(C.RESULTS_DIR / f"{args.stem}.md", header + body)


if __name__ == "__main__":
    main()
