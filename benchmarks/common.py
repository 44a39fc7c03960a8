"""Helpers shared by the benchmark scripts (``run_all.py``, ``bench_gpt2.py``).

The scripts are run as ``python benchmarks/<name>.py``, so ``benchmarks/`` is on ``sys.path`` and
this module is imported as ``common``. Nothing here is part of the hierremat library.

Memory meters:
  * ``peak_bytes(step, device)``: hierremat's own meter (``hierremat.device.memory_meter``): on CPU
    the live-tensor tracker (a TorchDispatchMode: bytes of the storages created during the step
    and alive at the same time; parameters, inputs and preallocated ``.grad`` not counted); on
    CUDA the ``torch.cuda.max_memory_allocated`` delta. This is what a hierremat budget counts.
  * ``allocator_peak_bytes(step)``: CPU only, the peak of the running sum of the CPU allocator's
    allocations and frees during the step, read from ``torch.profiler`` memory events. It sees the
    buffers that compiled (Inductor) code allocates, which the tracker cannot: under an active
    TorchDispatchMode, TorchDynamo runs the original Python code instead of the compiled graph.
    For eager code the two agree (checked in run_all.py, column "alloc MiB").
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import math
import os
import platform
import random
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterable

import torch

import hierremat
from hierremat import InfeasibleBudgetError, parse_budget
from hierremat.device import memory_meter

MIB = 2**20
RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------------------------
# parameters and gradients


def params_of(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def zero_grads(params: Iterable[torch.Tensor]) -> None:
    """Zero ``.grad`` in place, allocating it first if needed (as in any training loop after step one)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()


def grads_of(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in params]


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    if len(a) != len(b):
        raise ValueError(f"{len(a)} vs {len(b)} gradients")
    return max((float((u - v).abs().max()) for u, v in zip(a, b)), default=0.0)


# --------------------------------------------------------------------------------------------
# measuring


def step_autocast(device: torch.device, bf16: bool):
    """The context a benchmark's forwards (and hierremat's planning) run in: bf16 autocast on ``device``, or none."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_bytes(step: Callable[[], None], device: torch.device) -> int:
    """Peak bytes of one step with hierremat's meter for ``device`` (tracker on CPU, allocator delta on CUDA)."""
    gc.collect()
    with memory_meter(device) as meter:
        step()
    synchronize(device)
    return int(meter.peak_bytes)


def allocator_peak_bytes(step: Callable[[], None]) -> int:
    """CPU: peak of the running sum of allocator allocations minus frees during ``step``
    (torch.profiler's memory events, hierremat.device.memory.CpuAllocatorMeter)."""
    from hierremat.device.memory import CpuAllocatorMeter

    gc.collect()
    with CpuAllocatorMeter() as meter:
        step()
    return int(meter.peak_bytes)


def timed_step(step: Callable[[], None], params: list, device: torch.device) -> float:
    """Wall seconds of one step, grads zeroed beforehand and the garbage collector paused."""
    zero_grads(params)
    gc.collect()
    synchronize(device)
    gc.disable()
    try:
        t0 = time.perf_counter()
        step()
        synchronize(device)
        return time.perf_counter() - t0
    finally:
        gc.enable()


def interleave(items: list, rounds: int, seed: int, run: Callable, after_round: Callable | None = None,
               deadline: float | None = None) -> int:
    """Run ``run(item, round)`` for every item once per round, in a seeded shuffled order; returns rounds done.

    Interleaving spreads slow phases of a noisy machine over all methods instead of one.
    ``deadline``: a ``time.perf_counter()`` value after which no new round starts (at least one runs).
    """
    rng = random.Random(seed)
    done = 0
    for r in range(rounds):
        if r > 0 and deadline is not None and time.perf_counter() > deadline:
            break
        order = list(items)
        rng.shuffle(order)
        for item in order:
            run(item, r)
        done += 1
        if after_round is not None:
            after_round(r)
    return done


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


@contextlib.contextmanager
def time_limit(seconds: float | None, what: str = "operation"):
    """Raise TimeoutError in the main thread after ``seconds``, and again every 2 s until the block ends.

    SIGALRM based: main thread only, a no-op where unavailable. Code that catches the exception and goes on
    (as Inductor's compile can) gets it again.
    """
    if not seconds or not hasattr(signal, "SIGALRM") or seconds <= 0:
        yield
        return

    def on_alarm(signum, frame):
        raise TimeoutError(f"{what} exceeded {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds, 2.0)  # and every 2 s after: code may swallow one exception
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# --------------------------------------------------------------------------------------------
# hierremat helpers


def smallest_feasible_budget(plan_at: Callable[[str], object], notes: list[str] | None = None) -> int:
    """hierremat's smallest feasible budget: ask ``plan_at("1KiB")`` and follow ``min_budget_bytes`` until one plans."""
    budget = "1KiB"
    for _ in range(6):
        try:
            plan_at(budget)
            return parse_budget(budget)
        except InfeasibleBudgetError as err:
            if notes is not None:
                notes.append(f"plan at {budget}: InfeasibleBudgetError(min_budget_bytes={err.min_budget_bytes})")
            if err.min_budget_bytes <= parse_budget(budget):
                raise
            budget = f"{err.min_budget_bytes}B"
    raise RuntimeError("hierremat never found a feasible budget")


def model_plan_seconds(plan) -> float:
    """Planning cost recorded in a hierremat ModelPlan (capture + profile + solve + compiling block
    options) or SequentialPlan."""
    if hasattr(plan, "chain"):
        return plan.capture_seconds + plan.chain.profile_seconds + plan.chain.solve_seconds + plan.compile_seconds
    return plan.profile_seconds + plan.solve_seconds


# --------------------------------------------------------------------------------------------
# environment


def library_revision() -> str:
    """The git commit of the checkout (plus '+dirty' if hierremat/ has local changes), if any."""
    root = Path(hierremat.__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "hierremat"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (rev or "unknown") + ("+dirty" if dirty else "")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device: torch.device, threads: int) -> dict:
    info = {
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "hierremat": getattr(hierremat, "__version__", "?"),
        "revision": library_revision(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


# --------------------------------------------------------------------------------------------
# report helpers


def write_results(path: Path, text: str) -> None:
    """Write a benchmark's Markdown report to ``path`` (creating its folder) and print it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)


def markdown_table(header: list[str], rows: list[list[str]], align: str | None = None) -> str:
    """A Markdown table; ``align``: one letter per column, 'l' or 'r' (default: first two left, rest right)."""
    align = align or ("ll" + "r" * (len(header) - 2))
    sep = ["---:" if a == "r" else "---" for a in align]
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(sep) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def fmt(x, spec: str = ".2f", missing: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return missing
    return format(x, spec)


def replace_between_markers(text: str, body: str, start: str, end: str) -> str | None:
    """``text`` with the part between the ``start`` and ``end`` marker lines replaced by ``body``; None if absent."""
    i = text.find(start)
    j = text.find(end, i + len(start)) if i >= 0 else -1
    if i < 0 or j < 0:
        return None
    return text[: i + len(start)] + "\n" + body.strip("\n") + "\n" + text[j:]
