"""Benchmark: hierremat.checkpoint_sequential vs torch's checkpoint_sequential vs plain autograd (CPU).

What is measured, in one run, on a heterogeneous chain (an nn.Sequential of conv/BatchNorm/ReLU
blocks, Dropout, a token MLP with Linear+GELU and LayerNorm; each stage maps one tensor to one
tensor), for one training step = forward + ``y.float().pow(2).mean()`` + backward:

* plain autograd (no checkpointing);
* ``torch.utils.checkpoint.checkpoint_sequential(model, s, x, use_reentrant=False)`` for every
  segment count s = 1 .. number of stages (values torch rejects are skipped);
* ``hierremat.checkpoint_sequential(model, f"{n}B", x)`` at ~10 budgets from the smallest feasible
  one (asked of ``hierremat.plan_sequential`` through ``InfeasibleBudgetError.min_budget_bytes``)
  up to the plain-autograd peak, plus one budget equal to each peak measured for torch's segment
  counts (so the two are compared at equal memory), plus an "unlimited" budget of 100 GiB.

Per method: the peak bytes of the tensors created during the step (``hierremat.runtime.
LiveTensorTracker``; parameters, the input and preallocated ``.grad`` are not counted; measured in
a separate step from timing), the median wall time of a step over interleaved rounds (every round
runs every method once, in a shuffled order; grads zeroed between steps), and a deterministic cost:
the number of stage forward executions per step (plain: L; torch with s segments: L plus the stages
of the s-1 checkpointed segments, which it recomputes; hierremat: ``sum(plan.schedule.
forward_counts())``). The gradients of every checkpointed run are compared with plain autograd's
(same ``torch.manual_seed`` before each, so dropout masks match); the max abs difference is listed.

Targets (from the issue):
  At every budget where some ``segments`` value of torch's checkpoint_sequential fits, hierremat's
  plan is at least as fast at no more peak memory; and it runs at budgets below the smallest peak
  torch reaches. With an unlimited budget the runner's step time is within 3% of plain autograd
  (median of 20 steps).

Outputs: a Markdown report (tables + verdicts) and a Pareto plot (peak memory vs step time, one
series per method) under benchmarks/results/ (``bench_sequential.{md,png}``;
``bench_sequential_quick.{md,png}`` with ``--quick``, which runs a smaller chain in < 60 s).

CPU wall time is noisy (about +-15% per step on a shared 2-core machine): compare medians, and
read the forward-execution counts as the noise-free part of the comparison. torch runs with one
intra-op thread by default (``--threads``): with two threads on two cores, any other process
makes every parallel region wait for a descheduled thread and step times explode.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint_sequential as torch_checkpoint_sequential

import hierremat
from hierremat import InfeasibleBudgetError, parse_budget
from hierremat.device import LiveTensorTracker

from common import library_revision

MiB = 2**20
UNLIMITED_BYTES = 100 * 2**30
RESULTS_DIR = Path(__file__).resolve().parent / "results"


# --------------------------------------------------------------------------------------------
# model


class ToTokens(nn.Module):
    """(B, C, H, W) -> (B, H*W, C): the feature map as a sequence of tokens (a view)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(2).transpose(1, 2)


def conv_block(cin: int, cout: int, stride: int = 1) -> nn.Module:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


def linear_gelu(din: int, dout: int) -> nn.Module:
    return nn.Sequential(nn.Linear(din, dout), nn.GELU())


def build_chain(quick: bool) -> tuple[nn.Sequential, torch.Tensor, str]:
    """The benchmark chain and its input; quick: a shorter, smaller chain."""
    if quick:
        batch, size, c, d = 4, 32, 8, 64
        stages = [
            conv_block(3, c),
            conv_block(c, 2 * c, 2),
            nn.Dropout(0.1),
            conv_block(2 * c, 4 * c, 2),
            nn.Sequential(ToTokens(), nn.Linear(4 * c, d), nn.GELU()),
            nn.LayerNorm(d),
            linear_gelu(d, 4 * d),
            nn.Linear(4 * d, d),
            nn.Dropout(0.1),
            linear_gelu(d, 4 * d),
            nn.Linear(4 * d, d),
            nn.Linear(d, 16),
        ]
    else:
        batch, size, c, d = 8, 64, 16, 128
        stages = [
            conv_block(3, c),
            conv_block(c, c),
            conv_block(c, 2 * c, 2),
            conv_block(2 * c, 2 * c),
            nn.Dropout(0.1),
            conv_block(2 * c, 4 * c, 2),
            conv_block(4 * c, 4 * c),
            nn.Sequential(ToTokens(), nn.Linear(4 * c, d), nn.GELU()),
            nn.LayerNorm(d),
            linear_gelu(d, 4 * d),
            nn.Linear(4 * d, d),
            nn.Dropout(0.1),
            nn.LayerNorm(d),
            linear_gelu(d, 4 * d),
            nn.Linear(4 * d, d),
            nn.LayerNorm(d),
            linear_gelu(d, 4 * d),
            nn.Dropout(0.1),
            nn.Linear(4 * d, d),
            nn.Linear(d, 16),
        ]
    model = nn.Sequential(*stages).train()
    x = torch.randn(batch, 3, size, size)
    desc = (
        f"{len(stages)} stages: conv(3x3)+BN+ReLU blocks (widths {c}/{2 * c}/{4 * c}), Dropout, tokens -> "
        f"Linear+GELU / LayerNorm / Linear MLP (d={d}, hidden {4 * d}), Dropout; input {tuple(x.shape)}, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters"
    )
    return model, x, desc


def loss_of(y: torch.Tensor) -> torch.Tensor:
    return y.float().pow(2).mean()


# --------------------------------------------------------------------------------------------
# methods


@dataclass
class Method:
    kind: str  # "plain", "torch", "hierremat", "hierremat-unlimited"
    config: str
    step: Callable[[], None]
    forward_executions: int | None = None
    segments: int | None = None
    budget_bytes: int | None = None
    plan: object | None = None  # hierremat SequentialPlan
    plan_seconds: float | None = None
    peak_bytes: int | None = None
    grad_max_diff: float | None = None
    times: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def label(self) -> str:
        return f"{self.kind} [{self.config}]"

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else math.nan

    def quantile(self, q: float) -> float:
        if len(self.times) < 2:
            return self.median
        return statistics.quantiles(self.times, n=100, method="inclusive")[int(q * 100) - 1]


def make_step(model: nn.Sequential, x: torch.Tensor, kind: str, arg=None) -> Callable[[], None]:
    if kind == "plain":

        def step():
            loss_of(model(x)).backward()

    elif kind == "torch":

        def step():
            loss_of(torch_checkpoint_sequential(model, arg, x, use_reentrant=False)).backward()

    else:
        budget = f"{int(arg)}B"

        def step():
            loss_of(hierremat.checkpoint_sequential(model, budget, x)).backward()

    return step


def torch_forward_executions(n_stages: int, segments: int) -> int:
    """Stage forwards per step of torch's checkpoint_sequential: all but the last segment are recomputed."""
    segment_size = n_stages // segments
    return n_stages + segment_size * (segments - 1)


def torch_accepts(model: nn.Sequential, x: torch.Tensor, segments: int) -> str | None:
    """None when torch runs ``segments``, else why not (a check on a no-grad forward)."""
    if segments < 1 or segments > len(model):
        return f"segments={segments} outside 1..{len(model)}"
    if len(model) // segments == 0:
        return "segment size 0"
    return None


def cached_plan(model: nn.Sequential, x: torch.Tensor, budget_bytes: int):
    """The plan hierremat.checkpoint_sequential made (and runs) for this budget, from its plan cache."""
    try:
        from hierremat.dp.solve import DEFAULT_SLOTS
        from hierremat.api.sequential import PlanCache, as_stages

        entry = hierremat.plan_cache.get(PlanCache.key(as_stages(model), x, budget_bytes, DEFAULT_SLOTS))
        if entry is not None:
            return entry.plan
    except Exception:  # the cache layout changed: fall back to a fresh plan
        pass
    print(f"  (plan for {budget_bytes} B not found in hierremat.plan_cache; planning again to report it)")
    return hierremat.plan_sequential(model, f"{budget_bytes}B", x)


# --------------------------------------------------------------------------------------------
# measurement helpers


def params_of(model: nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def allocate_grads(model: nn.Module) -> None:
    for p in params_of(model):
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def zero_grads(model: nn.Module) -> None:
    for p in params_of(model):
        p.grad.zero_()


def measure_peak(model: nn.Module, step: Callable[[], None]) -> int:
    zero_grads(model)
    gc.collect()
    with LiveTensorTracker() as tracker:
        step()
    return tracker.peak_bytes


def grads_of(model: nn.Module, step: Callable[[], None], seed: int) -> list[torch.Tensor]:
    zero_grads(model)
    torch.manual_seed(seed)
    step()
    return [p.grad.detach().clone() for p in params_of(model)]


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((u - v).abs().max()) for u, v in zip(a, b))


def timed_step(model: nn.Module, step: Callable[[], None]) -> float:
    zero_grads(model)
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        step()
        return time.perf_counter() - t0
    finally:
        gc.enable()


def interleaved_rounds(model: nn.Module, methods: list[Method], rounds: int, seed: int, progress: str = "") -> None:
    rng = random.Random(seed)
    started = time.perf_counter()
    for r in range(rounds):
        order = list(methods)
        rng.shuffle(order)
        for m in order:
            m.times.append(timed_step(model, m.step))
        if progress:
            print(f"  {progress} round {r + 1}/{rounds} done ({time.perf_counter() - started:.0f} s)", flush=True)


def smallest_feasible_budget(model: nn.Module, x: torch.Tensor, log: list[str]) -> int:
    """min_budget_bytes from InfeasibleBudgetError, asking for "1KiB" and following the answers until one plans."""
    budget = "1KiB"
    for _ in range(6):
        try:
            hierremat.plan_sequential(model, budget, x)
            return parse_budget(budget)
        except InfeasibleBudgetError as err:
            log.append(f"plan_sequential(model, {budget!r}, x): InfeasibleBudgetError min_budget_bytes={err.min_budget_bytes}")
            if err.min_budget_bytes <= parse_budget(budget):
                raise
            budget = f"{err.min_budget_bytes}B"
    raise RuntimeError("hierremat never found a feasible budget: " + "; ".join(log))


def mib(n: float | None) -> str:
    return "-" if n is None or (isinstance(n, float) and math.isnan(n)) else f"{n / MiB:.2f}"


# --------------------------------------------------------------------------------------------
# report


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    out = [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in rows]
    return "\n".join(out)


def main_table(methods: list[Method], plain: Method) -> str:
    header = [
        "method", "config", "peak MiB", "peak/plain", "median ms", "time/plain", "IQR ms", "fwd execs",
        "pred peak MiB", "meas/pred", "<= budget", "pred ms", "plan s", "grad max|diff|",
    ]
    rows = []
    for m in methods:
        hr = m.kind.startswith("hierremat")
        if m.error:
            rows.append([m.kind, m.config, "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", m.error[:60]])
            continue
        pred = m.plan.predicted_peak_bytes if hr and m.plan is not None else None
        rows.append([
            m.kind,
            m.config,
            mib(m.peak_bytes),
            f"{m.peak_bytes / plain.peak_bytes:.3f}",
            f"{m.median * 1e3:.1f}",
            f"{m.median / plain.median:.3f}",
            f"{m.quantile(0.25) * 1e3:.0f}-{m.quantile(0.75) * 1e3:.0f}",
            str(m.forward_executions),
            mib(pred) if pred is not None else "-",
            f"{m.peak_bytes / pred:.3f}" if pred else "-",
            ("yes" if m.peak_bytes <= m.budget_bytes else "**NO**") if hr else "-",
            f"{m.plan.predicted_step_time * 1e3:.0f}" if hr and m.plan is not None else "-",
            f"{m.plan_seconds:.1f}" if m.plan_seconds is not None else "-",
            "0" if m.grad_max_diff == 0 else ("-" if m.grad_max_diff is None else f"{m.grad_max_diff:.2e}"),
        ])
    return markdown_table(header, rows)


def comparison_table(torch_rows: list[Method], hr_by_budget: dict[int, Method], tolerance: float) -> tuple[str, dict]:
    header = [
        "torch segments", "torch peak MiB", "torch ms", "torch fwd", "hierremat peak MiB", "hierremat ms",
        "hierremat fwd", "peak ratio hr/torch", "time ratio hr/torch", "hierremat faster/equal at <= memory",
    ]
    rows, counts = [], {"yes": 0, "within noise": 0, "no": 0, "missing": 0}
    for t in torch_rows:
        h = hr_by_budget.get(t.peak_bytes)
        if h is None or h.error:
            counts["missing"] += 1
            rows.append([str(t.segments), mib(t.peak_bytes), f"{t.median * 1e3:.1f}", str(t.forward_executions),
                         "-", "-", "-", "-", "-", "no hierremat run" + (f" ({h.error[:40]})" if h else "")])
            continue
        peak_ratio = h.peak_bytes / t.peak_bytes
        time_ratio = h.median / t.median
        fits = h.peak_bytes <= t.peak_bytes
        if fits and time_ratio <= 1.0:
            verdict = "yes"
        elif fits and time_ratio <= 1.0 + tolerance and h.forward_executions <= t.forward_executions:
            verdict = "within noise"
        else:
            verdict = "no"
        counts[verdict] += 1
        if verdict == "no":
            verdict = "**NO**" + ("" if fits else " (more memory)")
        rows.append([
            str(t.segments), mib(t.peak_bytes), f"{t.median * 1e3:.1f}", str(t.forward_executions),
            mib(h.peak_bytes), f"{h.median * 1e3:.1f}", str(h.forward_executions),
            f"{peak_ratio:.3f}", f"{time_ratio:.3f}", verdict,
        ])
    return markdown_table(header, rows), counts


def pareto_plot(path: Path, plain: Method, unlimited: Method | None, torch_rows: list[Method], hr_rows: list[Method],
                title: str, runner: Method | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def err(ms):
        return [[(m.median - m.quantile(0.25)) * 1e3 for m in ms], [(m.quantile(0.75) - m.median) * 1e3 for m in ms]]

    fig, ax = plt.subplots(figsize=(9, 6))
    t_sorted = sorted(torch_rows, key=lambda m: m.peak_bytes)
    ax.errorbar([m.peak_bytes / MiB for m in t_sorted], [m.median * 1e3 for m in t_sorted], yerr=err(t_sorted),
                fmt="s", color="tab:orange", capsize=2, label="torch checkpoint_sequential (segments)")
    for m in t_sorted:
        ax.annotate(str(m.segments), (m.peak_bytes / MiB, m.median * 1e3), textcoords="offset points", xytext=(4, 4),
                    fontsize=7, color="tab:orange")
    h_sorted = sorted(hr_rows, key=lambda m: m.peak_bytes)
    ax.errorbar([m.peak_bytes / MiB for m in h_sorted], [m.median * 1e3 for m in h_sorted], yerr=err(h_sorted),
                fmt="o-", color="tab:blue", capsize=2, markersize=4, label="hierremat checkpoint_sequential (budgets)")
    ax.errorbar([plain.peak_bytes / MiB], [plain.median * 1e3], yerr=err([plain]), fmt="*", color="black",
                markersize=14, capsize=2, label="plain autograd")
    if runner is not None and runner.times:
        ax.errorbar([runner.peak_bytes / MiB], [runner.median * 1e3], yerr=err([runner]), fmt="x", color="tab:red",
                    capsize=2, label="diagnostic: hierremat runner, keep-everything schedule")
    if unlimited is not None and not unlimited.error:
        ax.errorbar([unlimited.peak_bytes / MiB], [unlimited.median * 1e3], yerr=err([unlimited]), fmt="D",
                    color="tab:green", capsize=2, label="hierremat, 100 GiB budget")
    ax.set_xlabel("measured peak of tensors created in the step (MiB)")
    ax.set_ylabel("median step time (ms), whiskers: interquartile range")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller chain, fewer rounds and budgets (< 60 s)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 15, quick 3)")
    p.add_argument("--budgets", type=int, default=None, help="swept hierremat budgets (default 10, quick 4)")
    p.add_argument("--unlimited-steps", type=int, default=None,
                   help="steps of each of plain / 100 GiB hierremat in the unlimited-budget comparison (default 30, quick 5)")
    p.add_argument("--tolerance", type=float, default=0.03,
                   help="time ratio above 1 still called 'within noise' when hierremat also runs no more stage forwards")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (default 1; 0 keeps torch's default). Intra-op threads stall at "
                        "every barrier when the machine is oversubscribed (a 2-thread step on this 2-core machine "
                        "ran 5-100x slower while another job ran); one thread keeps timings usable")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--name", default=None, help="output file stem (default bench_sequential[_quick])")
    p.add_argument("--show-plans", action="store_true", help="print every hierremat plan summary")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 15)
    n_budgets = args.budgets or (4 if args.quick else 10)
    unlimited_steps = args.unlimited_steps or (5 if args.quick else 30)
    if args.threads:
        torch.set_num_threads(args.threads)
    name = args.name or ("bench_sequential_quick" if args.quick else "bench_sequential")
    wall_start = time.perf_counter()
    load_start = os.getloadavg()
    torch.manual_seed(args.seed)

    model, x, desc = build_chain(args.quick)
    L = len(model)
    allocate_grads(model)
    print(f"chain: {desc}")
    revision = library_revision()
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, hierremat {hierremat.__version__} "
          f"(git {revision}), "
          f"{platform.processor() or platform.machine()}, load average {load_start[0]:.2f}")

    problems: list[str] = []
    methods: list[Method] = []

    # -- plain autograd and torch's checkpoint_sequential ------------------------------------------
    plain = Method("plain", "-", make_step(model, x, "plain"), forward_executions=L)
    methods.append(plain)
    torch_rows: list[Method] = []
    for s in range(1, L + 1):
        why = torch_accepts(model, x, s)
        m = Method("torch", f"segments={s}", make_step(model, x, "torch", s), segments=s,
                   forward_executions=torch_forward_executions(L, s))
        try:
            if why:
                raise ValueError(why)
            m.step()  # warm-up; torch raises here on a segments value it rejects
        except Exception as err:  # noqa: BLE001 -- skip what torch rejects
            print(f"  torch rejects segments={s}: {err}")
            continue
        torch_rows.append(m)
        methods.append(m)
    plain.step()
    plain.step()

    print("measuring peaks of plain autograd and torch ...", flush=True)
    plain.peak_bytes = measure_peak(model, plain.step)
    for m in torch_rows:
        m.peak_bytes = measure_peak(model, m.step)

    # -- hierremat budgets --------------------------------------------------------------------------
    min_log: list[str] = []
    t0 = time.perf_counter()
    min_budget = smallest_feasible_budget(model, x, min_log)
    print(f"smallest feasible hierremat budget: {min_budget} B = {mib(min_budget)} MiB "
          f"({time.perf_counter() - t0:.1f} s; queries: {'; '.join(min_log)})")
    if len(min_log) > 1:
        problems.append(
            "InfeasibleBudgetError.min_budget_bytes for a tiny budget is not the smallest feasible budget: "
            + "; ".join(min_log) + f"; the budget that planned was {min_budget} B"
        )

    sweep = sorted({int(round(min_budget + (plain.peak_bytes - min_budget) * k / max(1, n_budgets - 1)))
                    for k in range(n_budgets)})
    torch_peaks = sorted({m.peak_bytes for m in torch_rows})
    budgets = sorted(set(sweep) | {p for p in torch_peaks if p >= min_budget})
    below_min = [p for p in torch_peaks if p < min_budget]
    if below_min:
        print(f"  torch peaks below hierremat's smallest budget (no hierremat run there): {[mib(p) for p in below_min]}")
    print(f"planning hierremat at {len(budgets)} budgets (first call of checkpoint_sequential per budget) ...", flush=True)
    hr_rows: list[Method] = []
    for b in budgets + [UNLIMITED_BYTES]:
        unlimited = b == UNLIMITED_BYTES
        kind = "hierremat-unlimited" if unlimited else "hierremat"
        sources = [f"torch s={m.segments}" for m in torch_rows if m.peak_bytes == b]
        config = "100 GiB" if unlimited else f"{b}B" + (f" (= {', '.join(sources)})" if sources else "")
        m = Method(kind, config, make_step(model, x, "hierremat", b), budget_bytes=b)
        t_plan = time.perf_counter()
        try:
            m.step()  # plans (profiles the chain) and caches the plan
            m.plan_seconds = time.perf_counter() - t_plan
            m.step()  # re-plans if the first backward showed the output released (this step releases it)
            m.plan = cached_plan(model, x, b)  # the plan the timed steps run
            m.forward_executions = sum(m.plan.schedule.forward_counts())
        except Exception as err:  # noqa: BLE001 -- a library failure is a finding, not a reason to stop
            m.error = f"{type(err).__name__}: {err}"
            problems.append(f"hierremat at budget {b} B failed: {m.error}")
            print(f"  budget {b} B: {m.error}")
        if args.show_plans and m.plan is not None:
            print(m.plan.summary())
        methods.append(m)
        if unlimited:
            unlimited_row = m
        else:
            hr_rows.append(m)
        if not m.error:
            print(f"  {config}: planned in {m.plan_seconds:.1f} s, {m.forward_executions} forwards", flush=True)

    # Diagnostic: hierremat's ChainRunner executing the keep-everything schedule (no recomputation), i.e. the
    # runner's own per-stage overhead; checkpoint_sequential itself bypasses the runner for that schedule.
    runner_row = None
    if unlimited_row.plan is not None:
        try:
            from hierremat.runtime import ChainRunner

            runner = ChainRunner(list(model.children()), unlimited_row.plan.schedule, unlimited_row.plan.mutated_buffers)

            def runner_step():
                loss_of(runner.run_schedule(x)).backward()

            runner_step()
            runner_row = Method("runner (diagnostic)", "ChainRunner, keep-everything schedule", runner_step,
                                forward_executions=sum(unlimited_row.plan.schedule.forward_counts()))
            methods.append(runner_row)
        except Exception as err:  # noqa: BLE001 -- internal API; the diagnostic is optional
            print(f"  (runner diagnostic skipped: {type(err).__name__}: {err})")

    ok_hr = [m for m in hr_rows if not m.error]
    for m in ok_hr + ([unlimited_row] if not unlimited_row.error else []) + ([runner_row] if runner_row else []):
        m.peak_bytes = measure_peak(model, m.step)
        if m.budget_bytes is not None and m.peak_bytes > m.budget_bytes:
            problems.append(f"hierremat measured peak {m.peak_bytes} B > budget {m.budget_bytes} B ({m.config})")

    # -- gradients vs plain autograd ----------------------------------------------------------------
    print("checking gradients against plain autograd ...", flush=True)
    reference = grads_of(model, plain.step, args.seed + 1)
    plain.grad_max_diff = max_abs_diff(grads_of(model, plain.step, args.seed + 1), reference)
    for m in methods[1:]:
        if m.error:
            continue
        m.grad_max_diff = max_abs_diff(grads_of(model, m.step, args.seed + 1), reference)
        if m.kind.startswith("hierremat") and m.grad_max_diff > 1e-5:
            problems.append(f"hierremat gradients differ from plain autograd by {m.grad_max_diff:.3e} ({m.config})")
    grad_scale = max(float(g.abs().max()) for g in reference)

    # -- timing -------------------------------------------------------------------------------------
    timed = [m for m in methods if not m.error]
    print(f"timing {len(timed)} configurations, {rounds} interleaved rounds ...", flush=True)
    interleaved_rounds(model, timed, rounds, args.seed, progress="main")

    print(f"unlimited budget vs plain autograd: {unlimited_steps} interleaved pairs ...", flush=True)
    pair_plain = Method("plain", "-", plain.step)
    pair_unl = Method("hierremat-unlimited", "100 GiB", unlimited_row.step)
    if not unlimited_row.error:
        rng = random.Random(args.seed + 7)
        for _ in range(unlimited_steps):
            pair = [pair_plain, pair_unl]
            rng.shuffle(pair)
            for m in pair:
                m.times.append(timed_step(model, m.step))

    # -- report -------------------------------------------------------------------------------------
    elapsed = time.perf_counter() - wall_start
    load_end = os.getloadavg()
    ordered = [plain, unlimited_row] + ([runner_row] if runner_row else []) + torch_rows + sorted(
        hr_rows, key=lambda m: -m.budget_bytes)
    table = main_table(ordered, plain)
    hr_by_budget = {m.budget_bytes: m for m in hr_rows}
    comp, counts = comparison_table(torch_rows, hr_by_budget, args.tolerance)

    torch_low = min(torch_rows, key=lambda m: m.peak_bytes)
    hr_low = min(ok_hr, key=lambda m: m.peak_bytes) if ok_hr else None
    lines = []
    lines.append(f"lowest peak reached by torch checkpoint_sequential: {mib(torch_low.peak_bytes)} MiB "
                 f"(segments={torch_low.segments}, {torch_low.median * 1e3:.1f} ms)")
    if hr_low:
        lines.append(f"lowest peak reached by hierremat: {mib(hr_low.peak_bytes)} MiB (budget {hr_low.budget_bytes} B, "
                     f"{hr_low.median * 1e3:.1f} ms, {hr_low.forward_executions} forwards) = "
                     f"{hr_low.peak_bytes / torch_low.peak_bytes:.3f} x torch's lowest; "
                     f"{'runs below' if hr_low.peak_bytes < torch_low.peak_bytes else 'does NOT run below'} "
                     f"the smallest peak torch reaches")
    lines.append(f"smallest feasible hierremat budget (plan_sequential): {mib(min_budget)} MiB")
    lines.append(f"gradient check: max |grad| of plain autograd = {grad_scale:.3e}; "
                 f"max |diff| over hierremat runs = "
                 f"{max((m.grad_max_diff for m in hr_rows + [unlimited_row] if m.grad_max_diff is not None), default=math.nan):.3e}, "
                 f"over torch runs = {max((m.grad_max_diff for m in torch_rows), default=math.nan):.3e}")
    verdict_line = (
        f"equal-memory comparison over {len(torch_rows)} torch segment counts: hierremat faster/equal at <= memory "
        f"in {counts['yes']}, within noise (time ratio <= {1 + args.tolerance:.2f} and no more forwards) in "
        f"{counts['within noise']}, not in {counts['no']}, no hierremat run in {counts['missing']}"
    )
    lines.append(verdict_line)
    unl_lines = []
    if pair_unl.times:
        ratio = pair_unl.median / pair_plain.median
        unl_lines.append(
            f"unlimited budget (100 GiB) vs plain autograd, {unlimited_steps} interleaved steps each: "
            f"plain {pair_plain.median * 1e3:.1f} ms, hierremat {pair_unl.median * 1e3:.1f} ms, "
            f"ratio {ratio:.3f} ({ratio - 1:+.1%}); target within 3%: {'MET' if abs(ratio - 1) <= 0.03 else 'NOT MET'}"
        )
        unl_lines.append(f"  (in the main rounds: ratio {unlimited_row.median / plain.median:.3f}; the 100 GiB plan "
                         f"{'keeps everything' if unlimited_row.forward_executions == L else 'recomputes'}: "
                         f"{unlimited_row.forward_executions} forwards)")
    if runner_row is not None and runner_row.times:
        unl_lines.append(
            f"diagnostic: hierremat's ChainRunner on the keep-everything schedule (same work as plain autograd) takes "
            f"{runner_row.median * 1e3:.1f} ms = {runner_row.median / plain.median:.3f} x plain "
            f"({(runner_row.median - plain.median) * 1e3 / L:+.2f} ms per stage): the runner's own overhead, "
            f"paid by every plan that recomputes anything"
        )
    if unlimited_row.plan is not None:
        pred_all = unlimited_row.plan.predicted_peak_bytes
        unl_lines.append(
            f"hierremat's predicted peak for keeping everything: {mib(pred_all)} MiB vs measured plain-autograd peak "
            f"{mib(plain.peak_bytes)} MiB ({pred_all / plain.peak_bytes - 1:+.1%}); at a budget equal to the plain peak "
            f"it therefore {'must recompute' if pred_all > plain.peak_bytes else 'can keep everything'}"
        )
    run_line = (f"run: {elapsed:.0f} s wall, hierremat git {revision}, {rounds} rounds, {n_budgets} swept budgets + {len(budgets) - len(sweep)} "
                f"torch-peak budgets, torch {torch.__version__}, threads={torch.get_num_threads()}, "
                f"load average {load_start[0]:.2f} at start / {load_end[0]:.2f} at end")

    print()
    print(table)
    print()
    print(comp)
    print()
    for line in lines + unl_lines:
        print(line)
    if problems:
        print("\nproblems found:")
        for p in problems:
            print(f"  - {p}")
    print(run_line)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    png = args.out_dir / f"{name}.png"
    md = args.out_dir / f"{name}.md"
    title = f"{'quick: ' if args.quick else ''}{L}-stage chain, input {tuple(x.shape)}, CPU threads={torch.get_num_threads()}"
    pareto_plot(png, plain, unlimited_row, torch_rows, ok_hr, title, runner_row)
    doc = [
        f"# bench_sequential{' (--quick)' if args.quick else ''}",
        "",
        f"Generated by `python benchmarks/bench_sequential.py{' --quick' if args.quick else ''}`. " + run_line + ".",
        "",
        f"Chain: {desc}. One step = forward + `y.float().pow(2).mean()` + backward.",
        "",
        "Peaks: bytes of the tensors created during one step (LiveTensorTracker; parameters, input and "
        "preallocated `.grad` not counted). Times: median over interleaved rounds (IQR = 25th-75th percentile). "
        "fwd execs: stage forwards per step (deterministic). pred: hierremat's plan prediction. "
        "grad max|diff|: vs plain autograd with the same seed.",
        "",
        "## All configurations",
        "",
        table,
        "",
        "## hierremat at the budget equal to each torch peak",
        "",
        comp,
        "",
        "## Summary",
        "",
        *[f"- {line}" for line in lines + [u.strip() for u in unl_lines]],
        "",
    ]
    if problems:
        doc += ["## Problems found", "", *[f"- {p}" for p in problems], ""]
    doc += [f"![Pareto plot]({png.name})", ""]
    md.write_text("\n".join(doc))
    print(f"wrote {md} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
