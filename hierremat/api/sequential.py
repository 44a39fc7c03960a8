"""``checkpoint_sequential`` and ``plan_sequential``: a chain of modules under a byte budget."""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable, Sequence

import torch

from ..budget import parse_budget
from ..dp.solve import DEFAULT_SLOTS
from ..errors import UnsupportedModelError
from ..store.cache import default_cache
from ..plans import clock
from ..plans.sequential_plan import SequentialPlan
from ..device.autocast import AutocastState
from ..runtime.executor import run_plainly
from ..runtime.offload import Offloading, check_offload, offload_key, second_tier
from ..runtime.profile import profile_chain
from ..session import current_session
from ..planning.chain_plan import PLAN_TIME_LIMIT, PlannedChain, check_block_options, plan_from_profile, resolve_compile

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


def plan_sequential(
    functions, budget, input: torch.Tensor, *, slots: int = DEFAULT_SLOTS, repeats: int = 3, strategy: str = "optimal",
    output_held: bool | None = True, block_options: str = "ilp", variants: bool = True, compile: bool | str = "auto",
    time_limit: float | None = PLAN_TIME_LIMIT, offload: bool | str = False, offload_limit: int | str | None = None,
) -> SequentialPlan:
    """Profile ``functions`` on ``input`` and return the fastest plan that fits ``budget``.

    budget: bytes (int, at least 1 MiB) or a string such as "512MiB". Raises
    InfeasibleBudgetError with the smallest feasible budget when none fits.
    strategy: 'optimal', or a baseline ('none', 'segments=K') planned the same way.
    output_held: whether the caller keeps the output alive through the backward (True,
    the usual ``y = ...; loss_fn(y).backward()``); False when it is released once the
    loss is computed; None to assume held unless only a released plan fits.
    block_options: 'ilp' (default): module stages also offer the optimal options of their
    per-block ILP (solved once per distinct stage, cached on disk; see hierremat.plan);
    'autograd': only what autograd keeps.
    variants: whether the block options may use hierremat's operator variants (packed
    dropout masks, recomputable dropout outputs; hierremat.blocks.variants). They compute
    bitwise what the operators compute.
    compile: whether block options run compiled by Inductor: True, False or "auto" (True
    on CUDA in fp32); see hierremat.plan.
    time_limit: seconds planning may take (see hierremat.plan); None: no bound.
    offload, offload_limit: whether checkpoints may be offloaded to a second tier, and its size (see
    hierremat.plan).
    """
    stages = as_stages(functions)
    _check_input(input)
    budget_bytes = parse_budget(budget)
    _check_options(block_options, slots, time_limit)  # (before a second tier is made and measured)
    return _plan(
        stages, budget_bytes, input, slots=slots, repeats=repeats, strategy=strategy, output_held=output_held,
        block_options=block_options, variants=variants, compile=compile, time_limit=time_limit,
        offloading=second_tier(offload, offload_limit, input.device, default_cache()),
    ).plan


def _plan(
    stages: list[Callable], budget_bytes: int, input: torch.Tensor, *, slots: int, repeats: int = 3,
    strategy: str = "optimal", output_held: bool | None = True, block_options: str = "ilp", variants: bool = True,
    compile: bool | str = "auto", time_limit: float | None = PLAN_TIME_LIMIT, offloading: Offloading | None = None,
) -> PlannedChain:
    _check_options(block_options, slots, time_limit)
    compiled = resolve_compile(compile, input.device, stages, input)
    started = time.perf_counter()
    deadline = clock.deadline_after(time_limit, started)
    profile = profile_chain(stages, input, repeats=repeats, deadline=deadline)
    profile_seconds = time.perf_counter() - started
    menus = None
    if block_options == "ilp" and strategy == "optimal" and torch.is_grad_enabled():
        from ..planning.menus import build_menus  # torch-side planning, loaded when used

        menus = build_menus(stages, input, (), None, variants=variants, deadline=deadline)

    def solve(profile):
        return plan_from_profile(
            stages, profile, budget_bytes, input.device, slots=slots, profile_seconds=profile_seconds,
            strategy=strategy, output_held=output_held, offloading=offloading,
        )

    if menus is not None and compiled:
        from ..planning.compiled import plan_compiled  # loaded when used: it compiles with Inductor

        cache = default_cache()
        plan = plan_compiled(
            menus, profile, solve, stages, input, (), cache.directory / "inductor" if cache.enabled else None, deadline,
        )
    else:
        plan = solve(menus.extend(profile) if menus is not None else profile)
    return PlannedChain(stages, plan, slots=slots, strategy=strategy, menus=menus, offloading=offloading)


def _check_options(block_options: str, slots, time_limit) -> None:
    check_block_options(block_options)
    check_slots(slots)
    check_time_limit(time_limit)


def _check_input(input) -> None:
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be a tensor, got {type(input).__name__}")
    check_devices((input.device.type,), "input")


#: Devices hierremat plans for: it measures the step it plans, so the tensors must be real.
SUPPORTED_DEVICES = ("cpu", "cuda")


def check_devices(device_types: Sequence[str], what: str) -> None:
    """Raise UnsupportedModelError naming ``what`` if a tensor lives on a device hierremat cannot measure."""
    bad = [d for d in device_types if d not in SUPPORTED_DEVICES]
    if bad:
        raise UnsupportedModelError(
            f"{what} on device {bad[0]!r}: hierremat plans on {' and '.join(SUPPORTED_DEVICES)} only (it measures "
            "each stage's time and memory); move the model and inputs there"
        )


def check_time_limit(time_limit) -> None:
    if time_limit is None:
        return
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not time_limit > 0:
        raise ValueError(f"time_limit must be a positive number of seconds (planning's bound; default "
                         f"{PLAN_TIME_LIMIT:g}) or None (no bound), got {time_limit!r}")


def check_slots(slots) -> None:
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots must be a positive int (memory slots of the chain DP; default {DEFAULT_SLOTS}), "
                         f"got {slots!r}")


#: Plans a PlanCache keeps at once (the least recently used goes first).
PLANS_KEPT = 256


class PlanCache:
    """Plans per (stages, input shape/dtype/device, autocast setting, budget, slots, block options, variants,
    compile, offloading), the latest PLANS_KEPT used; ``hits``/``misses`` count lookups. A plan holds its
    stages, so the ids in a key stay theirs while it is kept."""

    def __init__(self):
        self._plans: collections.OrderedDict[tuple, PlannedChain] = collections.OrderedDict()
        self.hits = 0
        self.misses = 0

    def clear(self) -> None:
        self._plans.clear()
        self.hits = self.misses = 0

    @staticmethod
    def key(
        stages: Sequence[Callable], input: torch.Tensor, budget_bytes: int, slots: int, block_options: str = "ilp",
        variants: bool = True, compile: bool | str = "auto", offload: tuple = (False, None),
    ) -> tuple:
        modes = tuple(getattr(s, "training", None) for s in stages)
        parameters = tuple(  # (trainable, and their dtypes: with autocast and the input's, what "auto" compile reads)
            tuple((p.requires_grad, p.dtype) for p in s.parameters()) if isinstance(s, torch.nn.Module) else ()
            for s in stages
        )
        return (
            tuple(id(s) for s in stages), modes, parameters, tuple(input.shape), input.dtype, input.device,
            input.requires_grad, AutocastState.capture((input.device.type,)).key(), budget_bytes, slots, block_options,
            variants, compile, offload,
        )

    def get(self, key: tuple):
        entry = self._plans.get(key)
        if entry is None:
            self.misses += 1
        else:
            self.hits += 1
            self._plans.move_to_end(key)
        return entry

    def put(self, key: tuple, entry: PlannedChain) -> None:
        self._plans[key] = entry
        self._plans.move_to_end(key)
        while len(self._plans) > PLANS_KEPT:
            self._plans.popitem(last=False)


def _plan_cache() -> PlanCache:
    """checkpoint_sequential's plans in the planner session (hierremat.session)."""
    return current_session().opened("checkpoint_sequential plans", PlanCache)


def __getattr__(name: str):
    if name == "plan_cache":  # (``plan_cache``: the current session's, read when asked for)
        return _plan_cache()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@torch.compiler.disable(reason="hierremat.checkpoint_sequential plans eagerly and runs its schedule with Python state")
def checkpoint_sequential(
    functions,
    budget,
    input: torch.Tensor,
    use_reentrant: bool | None = None,
    *,
    slots: int = DEFAULT_SLOTS,
    output_held: bool | None = True,
    block_options: str = "ilp",
    variants: bool = True,
    compile: bool | str = "auto",
    time_limit: float | None = PLAN_TIME_LIMIT,
    offload: bool | str = False,
    offload_limit: int | str | None = None,
    **kwargs,
) -> torch.Tensor:
    """Drop-in for ``torch.utils.checkpoint.checkpoint_sequential`` with a budget instead of segments.

    Runs ``functions`` (an nn.Sequential or a list of modules/callables, each mapping one
    tensor to one tensor) on ``input`` with the fastest rematerialization schedule whose
    forward+backward peak stays within ``budget`` (bytes or "512MiB"). Gradients equal
    plain autograd's, dropout and BatchNorm included. The plan is made on the first call
    for a given input shape and reused afterwards.

    output_held: whether the caller keeps the returned tensor alive through the backward
    (as in ``y = checkpoint_sequential(...); loss_fn(y).backward()``); see plan_sequential.
    Every backward checks how the output was used, and a different use re-plans the
    next call (releasing it early gives a faster plan; holding it when the plan assumed
    otherwise logs a warning). block_options, variants, compile, time_limit, offload, offload_limit: see
    plan_sequential.

    ``use_reentrant`` and torch's ``preserve_rng_state`` are accepted for compatibility;
    RNG state is always preserved. Inside a ``torch.compile``'d function the call is a
    graph break: the code around it is compiled, the chain runs eagerly.
    """
    unknown = set(kwargs) - {"preserve_rng_state", "determinism_check", "debug"}
    if unknown:
        raise TypeError(f"checkpoint_sequential got unexpected keyword argument(s): {sorted(unknown)}")
    budget_bytes = parse_budget(budget)
    stages = as_stages(functions)
    _check_input(input)
    check_offload(offload, offload_limit)
    needs_grad = input.requires_grad or any(
        p.requires_grad for s in stages if isinstance(s, torch.nn.Module) for p in s.parameters()
    )
    if not torch.is_grad_enabled() or not needs_grad:
        return run_plainly(stages, input)  # nothing to plan for
    key = PlanCache.key(
        stages, input, budget_bytes, slots, block_options, variants, compile, offload_key(offload, offload_limit)
    )
    plans = _plan_cache()
    entry = plans.get(key)
    if entry is None:
        _check_options(block_options, slots, time_limit)
        entry = _plan(
            stages, budget_bytes, input, slots=slots, output_held=output_held, block_options=block_options,
            variants=variants, compile=compile, time_limit=time_limit,
            offloading=second_tier(offload, offload_limit, input.device, default_cache()),
        )
        log.debug("%s", entry.plan.summary())
        plans.put(key, entry)
    return entry.run(input)
