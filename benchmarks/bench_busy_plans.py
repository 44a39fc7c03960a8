"""Benchmark: how far two consecutive plans of one model disagree on its step time, on an idle and a busy host.

A tiny GPT-2 (tests/models.py: 2 layers, 64 wide, batch 2 x 48) is planned twice in a row with ``hierremat.plan``
(``cache=False``: every stage profiled afresh), and the two plans' predicted steps are compared: the step that keeps
everything (``no_remat_step_time``, the same schedule in both) and the plan's own. Each pair runs once per round
with each statistic of a stage's timed runs (hierremat.runtime.profile.run_seconds), interleaved: ``least`` (the
library's: their minimum, as Python's timeit advises) and ``median``. ``busy``: one CPU-bound process per core runs
beside it. Printed per statistic and load: the median and the largest ratio of the two plans' predictions (larger
over smaller; 1.00 is perfect agreement) over the rounds. Target: at most 1.10 under load.

Usage: python benchmarks/bench_busy_plans.py [--rounds 5] [--budget 1GiB]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import os
import statistics
import sys
import time

import torch

import common as C

sys.path.insert(0, str(C.REPO_ROOT / "tests"))

import hierremat as hr  # noqa: E402
from hierremat.runtime import profile  # noqa: E402
from models import tiny_gpt2  # noqa: E402

log = logging.getLogger("bench_busy_plans")
STATISTICS = {"median": statistics.median, "least": min}


def _burn(seconds: float) -> None:
    end = time.time() + seconds
    while time.time() < end:
        sum(i * i for i in range(10_000))


@contextlib.contextmanager
def _load(busy: bool, seconds: float = 3600.0):
    """One CPU-bound process per core while in the block, where ``busy``."""
    workers = [multiprocessing.Process(target=_burn, args=(seconds,), daemon=True)
               for _ in range(os.cpu_count() or 1)] if busy else []
    for w in workers:
        w.start()
    try:
        yield
    finally:
        for w in workers:
            w.terminate()
            w.join()


@contextlib.contextmanager
def _statistic(name: str):
    """Stage times taken with the statistic ``name`` while in the block."""
    before = profile.run_seconds
    profile.run_seconds = STATISTICS[name]
    try:
        yield
    finally:
        profile.run_seconds = before


def _two_plans(model, ids, budget: str) -> tuple[tuple[float, float], tuple[float, float]]:
    """(keep-everything step, planned step) in seconds of two consecutive plans."""
    out = []
    for _ in range(2):
        plan = hr.plan(model, (ids,), budget=budget, settings=hr.Settings(cache=False))
        out.append((plan.chain.no_remat_step_time, plan.predicted_step_time))
    return out[0], out[1]


def _ratio(a: float, b: float) -> float:
    return max(a, b) / min(a, b)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget", default="1GiB")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2, n_embd=64).train()
    ids = torch.randint(0, 256, (2, 48))
    ratios: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for load in ("idle", "busy"):
        with _load(load == "busy"):
            for r in range(args.rounds):
                names = list(STATISTICS) if r % 2 == 0 else list(reversed(STATISTICS))  # (interleaved)
                for name in names:
                    with _statistic(name):
                        first, second = _two_plans(model, ids, args.budget)
                    ratios.setdefault((name, load), []).append((_ratio(first[0], second[0]),
                                                                _ratio(first[1], second[1])))
                    log.info("%s %s round %d: keep-everything %.1f / %.1f ms, plan %.1f / %.1f ms", load, name, r,
                             first[0] * 1e3, second[0] * 1e3, first[1] * 1e3, second[1] * 1e3)
    rows = []
    for (name, load), pairs in sorted(ratios.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        keep, planned = [a for a, _ in pairs], [b for _, b in pairs]
        rows.append([load, name, f"{statistics.median(keep):.2f}", f"{max(keep):.2f}",
                     f"{statistics.median(planned):.2f}", f"{max(planned):.2f}"])
    print(C.markdown_table(["load", "statistic", "keep-all ratio (median)", "keep-all ratio (max)",
                            "plan ratio (median)", "plan ratio (max)"], rows))
    print(f"{args.rounds} rounds; ratio = larger / smaller prediction of two consecutive hr.plan calls; "
          f"{os.cpu_count()} cores, torch {torch.__version__}")


if __name__ == "__main__":
    main()
