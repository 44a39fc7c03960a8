"""Benchmark: a training loop whose sequence length grows a few tokens at a time, without any padding mask.

A sequence-length warm-up or a curriculum: a tiny GPT-2 (tests/models.py: 2 layers, 128 wide, vocabulary 256),
batch 2, lengths ``--start``, ``--start + --stride``, ... (``--lengths`` of them), each trained for ``--steps`` steps
(``model(ids, labels=ids).loss.backward()``, AdamW, PyTorch's default ``zero_grad``), under
``hierremat.remat`` at ``--fraction`` of plain's allocator peak at the longest length, planned at the first length
with a fresh cache. Nothing tells hierremat the lengths will vary: no attention mask, no padding.

Per new length: its cost to hierremat ("new-length s": the length's first step's wall time less its last step's,
i.e. capture, planning and any first-run work), and the process's memory after ``gc`` and glibc's
``malloc_trim(0)``. Printed: the median and largest new-length cost after the second length, the growth of the memory
held from the second length to the last, and, with ``--busy``, the same beside one CPU-bound process per core.
Targets: at most 0.3 s per new length after the second, at most +64 MiB over 60 lengths. ``--profile N``: a cProfile
of the N-th new length's first step, its 25 costliest functions.

Usage: python benchmarks/bench_growing_lengths.py [--lengths 60] [--busy] [--profile 10]
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import gc
import io
import logging
import pstats
import statistics
import sys
import tempfile
import time

import torch

import common as C
from bench_busy_plans import _load

sys.path.insert(0, str(C.REPO_ROOT / "tests"))

import hierremat as hr  # noqa: E402
from hierremat.device.memory import CpuAllocatorMeter  # noqa: E402
from models import tiny_gpt2  # noqa: E402

log = logging.getLogger("bench_growing_lengths")
BATCH = 2


def _held_bytes() -> int:
    """RSS after a garbage collection and glibc's malloc_trim(0): what the process holds."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (BATCH, length), generator=torch.Generator().manual_seed(seed))


def _plain_peak(length: int) -> int:
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2, n_embd=128, n_positions=1024)
    ids = _ids(length, 0)
    model(ids, labels=ids).loss.backward()  # a warm-up step
    model.zero_grad()  # (.grad None when the step starts, as in the loop)
    with CpuAllocatorMeter() as meter:
        model(ids, labels=ids).loss.backward()
    return int(meter.peak_bytes)


def run(lengths: list[int], steps: int, fraction: float, profile_at: int | None) -> dict:
    budget = int(fraction * _plain_peak(lengths[-1]))
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2, n_embd=128, n_positions=1024)
    with tempfile.TemporaryDirectory() as cache:
        first = _ids(lengths[0], 0)
        module = hr.remat(model, (), {"input_ids": first, "labels": first}, budget=budget,
                          settings=hr.Settings(cache=cache))
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
        costs, held, profiled = [], [], ""
        for n, length in enumerate(lengths):
            walls = []
            for step in range(steps):
                ids = _ids(length, n * steps + step)
                profiler = cProfile.Profile() if (step == 0 and n == profile_at) else None
                t0 = time.perf_counter()
                if profiler is not None:
                    profiler.enable()
                module(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                if profiler is not None:
                    profiler.disable()
                    out = io.StringIO()
                    profiler.dump_stats("/tmp/growing_lengths.prof")
                    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(25)
                    profiled = out.getvalue()
                walls.append(time.perf_counter() - t0)
            costs.append(walls[0] - walls[-1])
            held.append(_held_bytes())
            log.info("length %d: new-length %.3f s, held %.1f MiB", length, costs[-1], held[-1] / 2**20)
    later = costs[2:] or costs
    return dict(budget=budget, median=statistics.median(later), largest=max(later),
                growth=(held[-1] - held[1]) / 2**20 if len(held) > 1 else 0.0, profile=profiled)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, default=60)
    p.add_argument("--start", type=int, default=32)
    p.add_argument("--stride", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--fraction", type=float, default=0.5)
    p.add_argument("--busy", action="store_true", help="also run beside one CPU-bound process per core")
    p.add_argument("--profile", type=int, default=None, metavar="N", help="cProfile the N-th new length's first step")
    p.add_argument("--verbose", action="store_true", help="hierremat's own log (INFO) too")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("hierremat").setLevel(logging.INFO if args.verbose else logging.WARNING)
    lengths = [args.start + i * args.stride for i in range(args.lengths)]
    rows = []
    for busy in ([False, True] if args.busy else [False]):
        with _load(busy):
            result = run(lengths, args.steps, args.fraction, args.profile)
        rows.append(["busy" if busy else "idle", f"{result['budget'] / 2**20:.1f}", f"{result['median']:.3f}",
                     f"{result['largest']:.3f}", f"{result['growth']:+.1f}"])
        if result["profile"]:
            log.info("%s: the profiled length's first step\n%s", rows[-1][0], result["profile"])
    print(f"{len(lengths)} lengths {lengths[0]}..{lengths[-1]}, {args.steps} steps each, batch {BATCH}, "
          f"budget {args.fraction} of plain's peak at the longest (targets: 0.3 s, +64 MiB)\n")
    print(C.markdown_table(["host", "budget MiB", "new-length s (median after the 2nd)", "largest s",
                            "memory held, growth MiB"], rows))


if __name__ == "__main__":
    main()
