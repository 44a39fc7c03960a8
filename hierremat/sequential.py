"""``checkpoint_sequential`` and ``plan_sequential``: a chain of modules under a byte budget."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable, Sequence

import torch

from .budget import parse_budget
from .dp import min_peak_schedule, solve_chain
from .dp.baselines import keep_all_schedule, uniform_segments_schedule
from .dp.solve import DEFAULT_SLOTS
from .errors import InfeasibleBudgetError
from .sequential_plan import SequentialPlan
from .runtime.executor import ChainRunner, run_plainly, stage_buffers
from .runtime.profile import ChainProfile, profile_chain
from .runtime.rng import CPU_RNG_STATE_BYTES

log = logging.getLogger(__name__)


def as_stages(functions) -> list[Callable]:
    """The stages of an nn.Sequential (its children) or of a list of modules/callables."""
    if isinstance(functions, torch.nn.Sequential):
        stages = list(functions.children())
    elif isinstance(functions, (list, tuple)):
        stages = list(functions)
    else:
        raise TypeError(
            f"functions must be an nn.Sequential or a list of modules/callables, got {type(functions).__name__}"
        )
    if not stages:
        raise ValueError("functions is empty: there is nothing to checkpoint")
    for i, f in enumerate(stages):
        if not callable(f):
            raise TypeError(f"functions[{i}] ({type(f).__name__}) is not callable")
    return stages


def _replay_reserve(stages: Sequence[Callable], profile: ChainProfile, device: torch.device) -> list[int]:
    """Bytes the runtime holds for each stage if it is recomputed (RNG state, buffer snapshots)."""
    rng = CPU_RNG_STATE_BYTES if device.type == "cpu" else 0
    return [
        rng + 2 * sum(b.untyped_storage().nbytes() for b in stage_buffers(stage, names))
        for stage, names in zip(stages, profile.mutated_buffers)
    ]


STRATEGIES = "'optimal' (the DP), 'none' (no checkpointing) or 'segments=K' (torch's uniform segments)"


def fixed_schedule(costs, strategy: str):
    """The schedule of a baseline strategy ('none' or 'segments=K')."""
    if strategy == "none":
        return keep_all_schedule(costs)
    if strategy.startswith("segments="):
        try:
            segments = int(strategy.split("=", 1)[1])
        except ValueError:
            raise ValueError(f"strategy={strategy!r}: K in 'segments=K' must be an integer") from None
        return uniform_segments_schedule(costs, segments)
    raise ValueError(f"strategy={strategy!r} is not one of {STRATEGIES}")


def _fastest_fitting(costs, budget_bytes: int, reserve: list[int], reserved: Callable, slots: int):
    keep_all = keep_all_schedule(costs)
    fastest = all(st.options[0].fwd_time + st.options[0].bwd_time <= min(o.fwd_time + o.bwd_time for o in st.options)
                  for st in costs.stages)
    if fastest and keep_all.predicted_peak_bytes <= budget_bytes:
        return keep_all  # no recomputation at all; it runs as plain autograd
    for dp_budget in dict.fromkeys((budget_bytes, budget_bytes - sum(reserve))):
        if dp_budget <= 0:
            continue
        try:
            candidate = solve_chain(costs, dp_budget, slots=slots).schedule
        except InfeasibleBudgetError:
            continue
        if candidate.predicted_peak_bytes + reserved(candidate) <= budget_bytes:
            return candidate
    schedule = min_peak_schedule(costs)
    needed = schedule.predicted_peak_bytes + reserved(schedule)
    if needed > budget_bytes:
        raise InfeasibleBudgetError(budget_bytes, needed)
    return schedule


def plan_from_profile(
    stages: Sequence[Callable],
    profile: ChainProfile,
    budget_bytes: int,
    device: torch.device,
    *,
    slots: int,
    profile_seconds: float = 0.0,
    strategy: str = "optimal",
) -> SequentialPlan:
    """Solve the chain so that the schedule's peak plus the runtime's replay reserve fits.

    The reserve (RNG states and buffer snapshots) is only held for recomputed stages,
    which the plan decides: try the whole budget first and keep that plan if its own
    reserve still fits; else plan with the reserve of every stage set aside; else the
    schedule of least peak. Baseline strategies (see STRATEGIES) use a fixed schedule.
    """
    reserve = _replay_reserve(stages, profile, device)

    def reserved(schedule) -> int:
        return sum(r for r, c in zip(reserve, schedule.forward_counts()) if c > 1)

    started = time.perf_counter()
    if strategy == "optimal":
        schedule = _fastest_fitting(profile.costs, budget_bytes, reserve, reserved, slots)
    else:
        schedule = fixed_schedule(profile.costs, strategy)
        needed = schedule.predicted_peak_bytes + reserved(schedule)
        if needed > budget_bytes:
            raise InfeasibleBudgetError(budget_bytes, needed, what=f"budget for strategy={strategy!r}")
    schedule = replace(schedule, budget_bytes=budget_bytes)
    return SequentialPlan(
        profile.costs, schedule, profile.mutated_buffers, reserved(schedule), profile_seconds, time.perf_counter() - started
    )


def plan_sequential(
    functions, budget, input: torch.Tensor, *, slots: int = DEFAULT_SLOTS, repeats: int = 3, strategy: str = "optimal"
) -> SequentialPlan:
    """Profile ``functions`` on ``input`` and return the fastest plan that fits ``budget``.

    budget: bytes (int, at least 1 MiB) or a string such as "512MiB". Raises
    InfeasibleBudgetError with the smallest feasible budget when none fits.
    strategy: 'optimal', or a baseline ('none', 'segments=K') planned the same way.
    """
    stages = as_stages(functions)
    _check_input(input)
    return _plan(stages, parse_budget(budget), input, slots=slots, repeats=repeats, strategy=strategy)


def _plan(
    stages: list[Callable], budget_bytes: int, input: torch.Tensor, *, slots: int, repeats: int = 3, strategy: str = "optimal"
) -> SequentialPlan:
    started = time.perf_counter()
    profile = profile_chain(stages, input, repeats=repeats)
    return plan_from_profile(
        stages, profile, budget_bytes, input.device, slots=slots, profile_seconds=time.perf_counter() - started, strategy=strategy
    )


def _check_input(input) -> None:
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be a tensor, got {type(input).__name__}")


class PlanCache:
    """Plans per (stages, input shape/dtype/device, budget, slots); ``hits``/``misses`` count lookups."""

    def __init__(self):
        self._plans: dict[tuple, tuple[SequentialPlan, ChainRunner]] = {}
        self.hits = 0
        self.misses = 0

    def clear(self) -> None:
        self._plans.clear()
        self.hits = self.misses = 0

    @staticmethod
    def key(stages: Sequence[Callable], input: torch.Tensor, budget_bytes: int, slots: int) -> tuple:
        modes = tuple(getattr(s, "training", None) for s in stages)
        trainable = tuple(
            tuple(p.requires_grad for p in s.parameters()) if isinstance(s, torch.nn.Module) else () for s in stages
        )
        return (
            tuple(id(s) for s in stages), modes, trainable, tuple(input.shape), input.dtype, input.device,
            input.requires_grad, budget_bytes, slots,
        )

    def get(self, key: tuple):
        entry = self._plans.get(key)
        if entry is None:
            self.misses += 1
        else:
            self.hits += 1
        return entry

    def put(self, key: tuple, entry: tuple[SequentialPlan, ChainRunner]) -> None:
        self._plans[key] = entry


plan_cache = PlanCache()


def checkpoint_sequential(
    functions,
    budget,
    input: torch.Tensor,
    use_reentrant: bool | None = None,
    *,
    slots: int = DEFAULT_SLOTS,
    **kwargs,
) -> torch.Tensor:
    """Drop-in for ``torch.utils.checkpoint.checkpoint_sequential`` with a budget instead of segments.

    Runs ``functions`` (an nn.Sequential or a list of modules/callables, each mapping one
    tensor to one tensor) on ``input`` with the fastest rematerialization schedule whose
    forward+backward peak stays within ``budget`` (bytes or "512MiB"). Gradients equal
    plain autograd's, dropout and BatchNorm included. The plan is made on the first call
    for a given input shape and reused afterwards.

    ``use_reentrant`` and torch's ``preserve_rng_state`` are accepted for compatibility;
    RNG state is always preserved.
    """
    unknown = set(kwargs) - {"preserve_rng_state", "determinism_check", "debug"}
    if unknown:
        raise TypeError(f"checkpoint_sequential got unexpected keyword argument(s): {sorted(unknown)}")
    budget_bytes = parse_budget(budget)
    stages = as_stages(functions)
    _check_input(input)
    needs_grad = input.requires_grad or any(
        p.requires_grad for s in stages if isinstance(s, torch.nn.Module) for p in s.parameters()
    )
    if not torch.is_grad_enabled() or not needs_grad:
        return run_plainly(stages, input)  # nothing to plan for
    key = PlanCache.key(stages, input, budget_bytes, slots)
    entry = plan_cache.get(key)
    if entry is None:
        plan = _plan(stages, budget_bytes, input, slots=slots)
        log.debug("%s", plan.summary())
        entry = (plan, ChainRunner(stages, plan.schedule, plan.mutated_buffers))
        plan_cache.put(key, entry)
    return entry[1].run(input)
