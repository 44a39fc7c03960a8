"""Benchmark of the chain DP: the Numba kernel against its pure-Python reference.

Measures, on random chains with realistic sizes (~1 MB activations, K options per
stage trading kept memory for time), at a budget of 1.5x the chain's min-peak:
  - numba kernel: ``fill_tables`` alone, median of 3 runs after a warm-up call (the
    first call's compile / cache-load time is reported once, separately);
  - solve_chain: the whole solve (discretise + fill + backtrack), median of 3 runs;
  - reference: ``fill_tables_reference`` once, only on small configs whose estimated
    time is under --max-ref-seconds; where it runs, its tables must equal the kernel's.
Targets: L=96, K=8, 1000 slots under 2 s; Numba >= 50x faster than the reference.
Usage: python benchmarks/bench_dp.py [--quick] [--max-ref-seconds S]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from hierremat.plans.costs import ChainCosts, OptionCosts, StageCosts
from hierremat.dp import min_peak_schedule, solve_chain
from hierremat.dp.discretize import ceil_div, discretize
from hierremat.dp.kernel import fill_tables
from hierremat.dp.reference import fill_tables_reference

RESULTS = Path(__file__).parent / "results" / "bench_dp.md"


def random_chain(rng: np.random.Generator, L: int, K: int) -> ChainCosts:
    """L stages of ~1 MB activations, each with K options: keeping less costs more time."""
    a = [int(v) * 4 for v in rng.integers(125_000, 500_000, size=L + 1)]
    stages = []
    for i in range(L):
        out, grad_in = a[i + 1], a[i]
        internal = int(rng.uniform(1.0, 4.0) * out)  # what the fastest option keeps
        fwd, bwd = rng.uniform(0.5e-3, 2e-3), rng.uniform(1e-3, 4e-3)
        options = []
        for k in range(K):
            kept = internal * (K - k) // K
            slower = 1.0 + 0.5 * k / K  # recomputing internals inside B
            options.append(OptionCosts(
                fwd_time=fwd, bwd_time=bwd * slower, kept_bytes=kept,
                fwd_overhead_bytes=kept + out + int(rng.integers(0, out // 4)),
                bwd_overhead_bytes=grad_in + int(rng.integers(0, out // 2)),
                pins_output=bool(rng.integers(0, 2)), pins_input=bool(rng.integers(0, 2)),
                name=f"opt{k}"))
        stages.append(StageCosts(nograd_fwd_time=0.9 * fwd,
                                 nograd_fwd_overhead_bytes=out + int(rng.integers(0, out // 4)),
                                 options=tuple(options), name=f"stage{i}"))
    return ChainCosts(tuple(a), tuple(stages))


def dp_inputs(costs: ChainCosts, budget: int, slots: int) -> tuple:
    """The arguments solve_chain passes to the kernel at its first attempt."""
    unit = max(1, ceil_div(budget, slots))
    return discretize(costs, unit).kernel_args(budget // unit)


def reference_work(L: int, K: int, M: int) -> float:
    """Candidate terms the reference evaluates: per (s, t, m), K options + splits of cost O(s'-s)."""
    return 2 * (M + 1) * sum((L - d) * (K + 1 + d * (d + 1) / 2) for d in range(L))


def timed_seconds(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def first_call_seconds() -> tuple[float, str]:
    """Time the kernel's first call (compile or load from cache) on a tiny chain."""
    args = dp_inputs(random_chain(np.random.default_rng(0), 2, 2), 10**8, 10)
    started = time.perf_counter()
    fill_tables(*args)
    seconds = time.perf_counter() - started
    how = "loaded from cache" if sum(fill_tables.stats.cache_hits.values()) else "compiled"
    return seconds, how


def run(lengths, option_counts, slot_counts, ref_lengths, ref_max_k, ref_slots, max_ref_seconds) -> list[tuple]:
    rows = []
    ref_rate = None  # seconds per unit of reference_work, from the last reference run
    for L in lengths:
        for K in option_counts:
            costs = random_chain(np.random.default_rng(1000 * L + K), L, K)
            budget = int(1.5 * min_peak_schedule(costs).predicted_peak_bytes)
            for slots in slot_counts:
                args = dp_inputs(costs, budget, slots)
                kernel_s = timed_seconds(lambda: fill_tables(*args))
                solve_s = timed_seconds(lambda: solve_chain(costs, budget, slots=slots))
                ref_s = None
                if L in ref_lengths and K <= ref_max_k and slots in ref_slots:
                    work = reference_work(L, K, int(args[-1]))
                    estimate = ref_rate * work if ref_rate is not None else 0.0
                    if estimate <= max_ref_seconds:
                        started = time.perf_counter()
                        C_ref, D_ref = fill_tables_reference(*args)
                        ref_s = time.perf_counter() - started
                        ref_rate = ref_s / work
                        C, D = fill_tables(*args)
                        assert np.array_equal(C, C_ref) and np.array_equal(D, D_ref), (L, K, slots)
                    else:
                        print(f"  skip reference L={L} K={K} slots={slots}: ~{estimate:.0f} s estimated")
                rows.append((L, K, slots, kernel_s, solve_s, ref_s))
                print(f"  done L={L} K={K} slots={slots}", flush=True)
    return rows


def table(rows: list[tuple]) -> str:
    lines = ["| L | K | slots | numba kernel ms | solve_chain ms | reference ms | speed-up |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for L, K, slots, kernel_s, solve_s, ref_s in rows:
        ref = f"{1e3 * ref_s:.0f}" if ref_s is not None else "-"
        speedup = f"{ref_s / kernel_s:.0f}x" if ref_s is not None else "-"
        lines.append(f"| {L} | {K} | {slots} | {1e3 * kernel_s:.1f} | {1e3 * solve_s:.1f} | {ref} | {speedup} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="L in (12, 24), K in (1, 4), 500 slots; no file written")
    parser.add_argument("--max-ref-seconds", type=float, default=60.0, help="skip reference runs estimated longer")
    opts = parser.parse_args()
    if opts.quick:
        config = dict(lengths=(12, 24), option_counts=(1, 4), slot_counts=(500,))
    else:
        config = dict(lengths=(12, 24, 48, 96), option_counts=(1, 4, 8), slot_counts=(500, 1000))
    started = time.perf_counter()
    compile_s, how = first_call_seconds()
    rows = run(**config, ref_lengths=(12, 24), ref_max_k=4, ref_slots=(500,), max_ref_seconds=opts.max_ref_seconds)
    header = (f"Chain DP benchmark, {datetime.datetime.now():%Y-%m-%d %H:%M}\n"
              f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
              f"Python {platform.python_version()}\n"
              f"numba kernel first call ({how}): {1e3 * compile_s:.0f} ms (excluded below)\n"
              f"budget 1.5x min-peak; kernel and solve_chain: median of 3; reference: 1 run\n")
    report = f"{header}\n{table(rows)}\n\ntotal benchmark time: {time.perf_counter() - started:.0f} s"
    print("\n" + report)
    if not opts.quick:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(report + "\n")
        print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
