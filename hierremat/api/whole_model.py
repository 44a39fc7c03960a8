"""``hierremat.remat`` and ``hierremat.plan``: whole models under a memory budget.

The model is captured with torch.export, cut into a chain (hierremat.graphs.segment),
profiled (stages with equal signatures once) and planned with the chain DP; the
returned module runs the model's own graph with the chain executed by the schedule.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils import _pytree as pytree

from ..graphs.capture import capture, check_outputs, uncompiled
from ..graphs.fake_weights import weights_faked_on
from ..graphs.eager_masks import has_value_branch, padding_key
from ..graphs.hf import call_kwargs, upcasts_outputs
from ..graphs.sources import clear_fake_tensor_cache, forget_sources, recorded_sources
from ..graphs.symbolic import SymbolicCapture, capture_symbolic, every_dim, marked_dims, padded_dims, varying_dims
from ..graphs.segment import CHAIN_ATTRIBUTE, ChainGraph, build_chain_graph, check_segmentation
from ..budget import format_bytes, parse_budget
from ..dp.solve import DEFAULT_SLOTS
from ..errors import InfeasibleBudgetError, UnsupportedModelError
from ..plans.model_plan import ModelPlan
from ..plans.sequential_plan import SequentialPlan
from ..device import is_abstract
from ..device.memory import profiler_active
from ..device.autocast import AutocastState
from ..runtime.executor import as_tuple
from ..runtime.fsdp import ShardedChain, is_fsdp_module, is_sharded, reserve_bytes, with_gathered, without_weights
from ..runtime.offload import Offloading, check_offload, second_tier
from ..runtime.lent_weights import bind_to_model, has_abstract_weights, lent_inputs, lent_weights
from ..runtime.profile import PROFILE_REPEATS, SLOW_STAGE_SECONDS, ChainProfile, profile_chain, storage_bytes
from ..runtime.stage_cost_cache import StageCostCache
from ..runtime.step_grads import StepGrads
from ..store.cache import OptionsCache, default_cache
from ..planning.chain_plan import (
    PLAN_TIME_LIMIT, PlannedChain, check_block_options, least_held_bytes, plan_from_profile, resolve_compile,
)
from .sequential import SUPPORTED_DEVICES, check_devices, check_slots, check_time_limit
from ..planning.compiled import compile_forwards, compile_options, offer_compiled, options_used, plan_compiled
from ..planning.menus import NOISE_MARGIN, StageMenu, build_menus, cost_model_version, stage_arguments
from ..planning.shape_fit import (
    ShapeFit, ShapeSample, add_sample, chain_pattern, memory_sizes_ahead, memory_sizes_to_sample, sizes_to_sample,
)

log = logging.getLogger(__name__)

#: How many input shapes' plans a RematModule keeps (least recently used dropped first): each holds
#: its graphs, about a megabyte for a 12-layer GPT-2; a dropped shape plans again when it comes back.
DEFAULT_MAX_SHAPES = 64
#: How a plan's ``times`` says that a measured shape's times are of one timed run each (_ProfiledChain.one_run)
ONE_RUN_NOTE = " (times of one run each, until its training steps time it)"
#: Steps per shape whose stage times are recorded (hierremat.runtime.step_times), for a family whose times are fitted
#: from its training steps (RematModule._times_from_steps): the median of a shape's first three steps.
TIMED_STEPS = 3
#: Shapes timed in the training steps kept per family to fit from (spread over the sizes: add_sample).
STEP_SAMPLES = 12


class ChainModule(nn.Module):
    """Runs the stages of a captured model as the plan's schedule (the orchestrator's chain).

    Under ``torch.compile`` its call is an explicit graph break (``torch.compiler.disable``):
    the runner executes the schedule with Python state (RNG states, tapes, the output's
    use) that Dynamo cannot trace, while the orchestrator's code around it (masks,
    positions, the output's assembly) is compiled.
    """

    def __init__(self, stages: list[nn.Module], planned: PlannedChain):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.planned = planned

    @torch.compiler.disable(reason="hierremat's chain runner: its schedule keeps Python state Dynamo cannot trace")
    def forward(self, x: torch.Tensor, *shared) -> tuple:
        for value in shared:
            if isinstance(value, torch.Tensor) and value.requires_grad:
                raise UnsupportedModelError(
                    "a value shared by all stages requires grad; hierremat's chain supports only shared inputs "
                    "without gradient (masks, ids). Pass such tensors with requires_grad=False."
                )
        return as_tuple(self.planned.run(x, tuple(shared)))


class _ChainInputs(Exception):
    def __init__(self, x, shared):
        super().__init__("chain inputs probed")
        self.x, self.shared = x, shared


class _Probe(nn.Module):
    def forward(self, x, *shared):
        raise _ChainInputs(x, shared)


def chain_inputs(chain: ChainGraph, args: tuple, kwargs: dict):
    """Run the orchestrator's precompute part only, returning the chain's input and shared values."""
    setattr(chain.orchestrator, CHAIN_ATTRIBUTE, _Probe())
    try:
        with torch.no_grad():
            chain.orchestrator(*args, **kwargs)
    except _ChainInputs as probe:
        return probe.x, probe.shared
    raise AssertionError("the orchestrator did not reach the chain")


class _Compiled:
    """A captured model bound to its plan; ``plan`` follows the chain's re-plans (PlannedChain)."""

    def __init__(self, chain: ChainGraph, plan: ModelPlan, chain_module: "ChainModule"):
        self.chain = chain
        self._plan = plan
        self.chain_module = chain_module
        self.family: tuple = ()  # the inputs' _family_key, set by RematModule
        self.sample: ShapeSample | None = None  # its measured costs (None: fitted, or run from a saved plan)
        self.bindings: dict | None = None  # its sizes by symbol in the symbolic capture it was planned with
        self.skeleton: tuple = ((), {})  # its inputs as meta tensors (their shapes)
        self.sources: list[str] = []  # fx's sources of the graphs traced to plan it (hierremat.graphs.sources)
        self.lent = False  # planned on meta with lent weights: bound to the model's own when it has them
        self.unsharded: ModelPlan | None = None  # the plan before shard() re-made it (what each re-shard starts from)
        self.least_held: int | None = None  # bytes of the output a caller that releases it still holds (its losses)
        self.saved = False  # run from a saved plan (remat(..., plan=)): never planned again here
        self.block_gain = 0.0  # _ProfiledChain.block_gain: seconds a step block options not re-costed could save
        self.build_estimate: float | None = None  # _ProfiledChain.build_estimate: planned before any were built
        self.menus_from_cache = False  # _ProfiledChain.menus_from_cache: block options built only as the cache had them
        self.steps_without = 1  # steps run without block options not re-costed (block_gain), the first included
        self.reduced_fit = False  # its times fitted from fewer shapes timed than the monomials (ShapeFit.reduced)
        self.family_timed = 0  # its family's shapes timed when it was planned (RematModule._timed_count)
        self.one_run = False  # measured from one timed run each (_ProfiledChain.one_run): also after its first step
        self.retimed_steps = 0  # its steps whose times it was last solved from (RematModule._retime)
        self.steps_sampled = 0  # its steps whose times are in its family's step samples (RematModule._step_samples)
        self.recipe_warned = False  # a saved plan run under the other autocast recipe: warned once
        self.copies_warned = False  # a saved plan run by a caller that copies the outputs to fp32: warned once

    def released_output(self) -> tuple[bool, ...] | None:
        """Where the caller released the chain output before the backward at this shape's last step (held no
        more of it than its losses: hierremat.planning.chain_plan.least_held_bytes), the outputs that got a
        gradient then; else None (not seen yet, or held)."""
        seen = self.chain_module.planned.runner.observed_output_use
        if seen is None or self.least_held is None or seen.held_bytes > self.least_held:
            return None
        return seen.grad_mask

    def graphs(self) -> list[nn.Module]:
        """Every graph that reads the model's tensors: the orchestrator, the stages and their other forms."""
        forms = [self.chain.orchestrator, *self.chain.stages]
        menus = self.chain_module.planned.menus
        if menus is not None:
            forms += [e.stage for executors in menus.executors for e in executors if hasattr(e, "stage")]
        return forms

    def bind_to(self, model: nn.Module) -> None:
        """Compute with ``model``'s own parameters and buffers (a model planned on meta, materialized
        since with ``to_empty`` and initialized); raises where it still has none."""
        if has_abstract_weights(model):
            raise UnsupportedModelError(
                f"{type(model).__name__} was planned without its weights and still has meta (or fake) parameters or "
                "buffers: materialize it before training (model.to_empty(device=...), then initialize its weights; "
                "a model built under FakeTensorMode: load_state_dict(..., assign=True), and set its buffers outside "
                "the state dict)"
            )
        bind_to_model(self.graphs(), model)
        self.chain_module.planned.reread_tensors()
        self.lent = False

    @property
    def times_note(self) -> str:
        """What its plan's ``times`` says of how its times are known besides the fit (ONE_RUN_NOTE, or the training
        steps it was solved again from: RematModule._retime), or nothing."""
        if self.retimed_steps:
            return f"; times from its first {self.retimed_steps} training steps"
        return ONE_RUN_NOTE if self.one_run else ""

    def relabel_times(self, old: str, new: str) -> None:
        """Say in the plan's ``times`` how its times are now known (``old`` replaced by ``new``; none: ``new``
        added at the end)."""
        times = self._plan.times.replace(old, new) if old else self._plan.times + new
        self._plan = replace(self._plan, times=times)

    @property
    def plan(self) -> ModelPlan:
        current = self.chain_module.planned.plan
        if self._plan.chain is not current:
            self._plan = replace(self._plan, chain=current)
        return self._plan

    @property
    def sharded(self) -> bool:
        return self.chain_module.planned.sharded is not None

    def shard(self, model: nn.Module, budget_bytes: int) -> None:
        """Re-plan for the FSDP2 modules ``fully_shard`` made of ``model`` (hierremat.runtime.fsdp):
        option 0 per stage, what FSDP2 gathers counted, rank 0's plan on every rank (a collective: every rank
        calls it together). Again after that, from the plan made before the first call (RematModule._orchestrator:
        where another rank plans a new shape, this rank re-plans with it)."""
        sharded = ShardedChain(model, self.chain.stages)
        gathered = sharded.gathered_bytes()
        planned = self.chain_module.planned
        if self.unsharded is None:
            self.unsharded = self.plan
        plan = self.unsharded
        costs = with_gathered(plan.chain.costs, gathered)
        reserve = reserve_bytes(gathered)
        profile = ChainProfile(costs, plan.chain.mutated_buffers, plan.chain.output_grad_mask)
        device = next(iter(model.parameters())).device
        try:
            outcome = plan_from_profile(
                planned.stages, profile, budget_bytes - plan.shared_bytes - plan.output_copies_bytes - reserve, device,
                slots=planned.slots, strategy=planned.strategy, output_held=costs.output_held_bytes,
                step_grads=StepGrads(planned.stages, model).bytes(), offloading=planned.offloading,
            )
        except InfeasibleBudgetError as err:
            outcome = err
        outcome = rank0s(outcome)
        if isinstance(outcome, InfeasibleBudgetError):
            raise outcome.plus(budget_bytes, plan.shared_bytes + plan.output_copies_bytes + reserve,
                               copies_note(plan.output_copies_bytes)) from None
        chain_plan = outcome
        log.info(
            "%s is sharded with FSDP2: re-planned with up to %d B gathered per stage and %d B held beside the chain",
            type(model).__name__, max(gathered.per_stage, default=0), reserve,
        )
        planned.shard(sharded, chain_plan, agree=rank0s)
        self._plan = replace(
            plan, chain=chain_plan, menus={}, gathered_stage_bytes=gathered.per_stage, sharded_reserve_bytes=reserve,
        )


def copies_note(output_copies_bytes: int) -> str:
    """What an InfeasibleBudgetError's minimums count of the caller's fp32 copies of the outputs (ModelPlan.output_copies_bytes)."""
    if not output_copies_bytes:
        return ""
    return (f"; each counts {format_bytes(output_copies_bytes)} of fp32 copies the caller makes of the model's fp16/bf16 "
            "outputs (accelerate's mixed precision, as the Trainer's bf16=True and fp16=True run it)")


def _ranks() -> int:
    """How many ranks the default process group has (1 without one)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank0s(outcome: SequentialPlan | InfeasibleBudgetError) -> SequentialPlan | InfeasibleBudgetError:
    """Rank 0's planning outcome (a plan, or the budget was infeasible) on every rank of the
    default process group: every rank must run the same schedule (its collectives happen in
    the schedule's order) or raise the same error. ``outcome`` itself without a group."""
    import torch.distributed as dist

    if _ranks() == 1:
        return outcome
    if isinstance(outcome, InfeasibleBudgetError):
        mine = {"infeasible": [outcome.budget_bytes, outcome.min_budget_bytes, outcome.what,
                               outcome.min_budget_bytes_output_held, outcome.min_budget_bytes_grads_kept]}
    else:
        mine = {"plan": outcome.to_json()}
    box = [json.dumps(mine) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    theirs = json.loads(box[0])
    if "infeasible" in theirs:
        return InfeasibleBudgetError(*theirs["infeasible"])
    return SequentialPlan.from_json(theirs["plan"])


#: The budget a new shape of a sharded model is first planned within (RematModule._add_sharded): none.
UNBOUNDED_BYTES = 1 << 62


def _ranks_plan(shape_key, plans: bool, refuses: bool = False) -> tuple[bool, bool]:
    """Under FSDP2 every rank runs one schedule (its all-gathers happen in the schedule's order): whether any rank
    of the default process group plans in this call (``plans``: this one does), where every rank then re-plans for
    the shards together with it (_Compiled.shard: rank 0's plan on every rank). One small all-gather of the ranks'
    input keys per call where the group has several ranks. Ranks called with inputs of other shapes, dtypes or
    autocast (``shape_key``: the call's input key without its padding state) raise UnsupportedModelError, every
    one of them, before any plans or runs a step; a padding state differing between ranks is one schedule's
    (rank 0's), as at the first call after fully_shard. Returns (whether any rank plans, whether any refuses to:
    ``refuses``, a new shape with ``on_new_shape="error"``)."""
    import torch.distributed as dist

    if _ranks() == 1:
        return plans, refuses

    def without_index(part):  # (each rank's inputs are on its own device: cuda:0, cuda:1, ...)
        if isinstance(part, tuple):
            return tuple(without_index(p) for p in part)
        return part.type if isinstance(part, torch.device) else part

    mine = (repr(without_index(shape_key)), plans, refuses)
    every = [None] * _ranks()
    dist.all_gather_object(every, mine)
    keys = [k for k, _, _ in every]
    if len(set(keys)) > 1:
        other = next(r for r, k in enumerate(keys) if k != keys[0])
        raise UnsupportedModelError(
            f"under FSDP2 every rank must be called with inputs of the same shapes, dtypes and autocast setting (every "
            f"rank runs one schedule, whose all-gathers must match), but rank 0 and rank {other} differ: {keys[0]} "
            f"against {keys[other]}. Pad every rank's batch to one length (the global batch's longest, or a fixed "
            "multiple)"
        )
    return any(p for _, p, _ in every), any(r for _, _, r in every)


@dataclass(frozen=True)
class PlanSettings:
    """How a whole model is planned (see hierremat.plan for each field)."""

    slots: int = DEFAULT_SLOTS
    strategy: str = "optimal"
    output_held: bool | None = None
    block_options: str = "ilp"
    cache: bool | str = True
    segmentation: str = "blocks"
    variants: bool = True
    compile: bool | str = "auto"
    outputs: tuple[str, ...] | None = None
    time_limit: float | None = PLAN_TIME_LIMIT
    device: str | None = None
    offload: bool | str = False
    offload_limit: int | str | None = None
    #: under autocast, whether the caller's backward runs under it too (one context around forward and backward);
    #: None: not known (RematModule learns it at the first backward: hierremat.planning.menus.exact_under_autocast)
    backward_autocast: bool | None = None
    #: whether a shape may run without block options until building them pays (rent or buy: _profile_and_solve);
    #: remat's default, not hierremat.plan's
    defer_block_options: bool = False

    def __post_init__(self) -> None:
        if self.backward_autocast not in (None, True, False):
            raise ValueError("backward_autocast must be True (the backward runs inside the autocast context), False "
                             f"(after it closed) or None (not known), got {self.backward_autocast!r}")
        check_offload(self.offload, self.offload_limit)
        if not isinstance(self.offload, bool):
            object.__setattr__(self, "offload", os.fspath(self.offload))
        if self.device is not None:
            try:
                kind = torch.device(self.device).type
            except (RuntimeError, TypeError) as err:
                raise ValueError(f"device must name a device ('cuda', 'cuda:1', 'cpu'), got {self.device!r}") from err
            if kind not in SUPPORTED_DEVICES:
                raise ValueError(f"device must be where the model trains ({' or '.join(SUPPORTED_DEVICES)}), "
                                 f"got {self.device!r}")
        check_block_options(self.block_options)
        check_slots(self.slots)
        check_time_limit(self.time_limit)
        check_segmentation(self.segmentation)
        if not isinstance(self.defer_block_options, bool):
            raise ValueError("defer_block_options must be True (block options built once they pay) or False (at "
                             f"once), got {self.defer_block_options!r}")
        resolve_compile(self.compile, torch.device("cpu"))  # checks the value
        object.__setattr__(self, "outputs", check_outputs(self.outputs))

    def options_cache(self) -> OptionsCache:
        if isinstance(self.cache, str):
            return default_cache(self.cache)
        return default_cache(enabled=bool(self.cache))

    def offloading(self, device: torch.device) -> Offloading | None:
        """The second tier plans on ``device`` may offload to (hierremat.runtime.offload), or None."""
        return second_tier(self.offload, self.offload_limit, device, self.options_cache())

    def deadline(self, started: float) -> float | None:
        """When planning that began at ``started`` (``time.perf_counter()``) must be done."""
        return None if self.time_limit is None else started + self.time_limit

    def inductor_cache(self) -> Path | None:
        """Where compiled block options are cached (Inductor's caches): under the options cache."""
        cache = self.options_cache()
        return cache.directory / "inductor" if cache.enabled else None


def _lending_device(model: nn.Module, args: tuple, kwargs: dict, device: str | None) -> torch.device | None:
    """Where a model without weights (meta or fake parameters or inputs: device.is_abstract) is planned with
    lent weights (hierremat.runtime.lent_weights): ``device``, by default the one fake tensors stand for
    (meta ones say nothing); None for a model that has its weights, planned where they are (``device``, if
    given, must be that device)."""
    abstract_inputs = any(isinstance(v, torch.Tensor) and is_abstract(v) for v in pytree.tree_leaves((args, kwargs)))
    if not (has_abstract_weights(model) or abstract_inputs):
        if device is not None:
            wanted = torch.device(device)
            where = {p.device for p in model.parameters()}
            if any(d.type != wanted.type or (wanted.index is not None and d.index != wanted.index) for d in where):
                raise ValueError(
                    f"device={device!r}, but {type(model).__name__}'s parameters are on "
                    f"{', '.join(sorted(str(d) for d in where))}: hierremat plans a model where its weights are. "
                    "Leave device= out, or build the model on meta to plan it for another device"
                )
        return None
    fakes = {t.device for t in (*model.parameters(), *model.buffers()) if is_fake(t)}
    if device is None and len(fakes) == 1:
        return fakes.pop()
    if device is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has parameters or inputs without storage (meta): pass device='cuda' (or 'cpu'), "
            "where it will train. hierremat then lends each distinct stage real weights there while it plans"
        )
    return torch.device(device)


def _captured_chain(model: nn.Module, args: tuple, kwargs: dict, settings: PlanSettings, autocast: AutocastState,
                    started: float, symbolic: SymbolicCapture | None = None, lent_to: torch.device | None = None,
                    export: bool = True):
    """(the model captured and cut into a chain, its first stage's input, the shared values, capture seconds,
    whether the capture was specialized from ``symbolic``). lent_to: a model without weights is captured as on
    this device (hierremat.graphs.fake_weights), its chain inputs computed there with lent weights. export:
    where ``symbolic`` does not hold at these inputs, export them (else ValueError: hierremat.graphs.capture)."""
    inputs = (args, kwargs)
    if lent_to is None:
        captured = capture(model, args, kwargs, variants=settings.variants, outputs=settings.outputs, symbolic=symbolic,
                           export=export)
    else:  # captured as on lent_to with fake weights, bound to the model's own (meta) ones after
        inputs = lent_inputs(inputs, lent_to)
        with weights_faked_on(model, lent_to) as fake:
            captured = capture(model, *fake(inputs), variants=settings.variants, outputs=settings.outputs)
        bind_to_model([captured.module], model)
    try:
        chain = build_chain_graph(captured, model, settings.segmentation, context=autocast.key())
    except (ValueError, StopIteration) as err:
        raise UnsupportedModelError(f"{type(model).__name__} could not be cut into a chain of stages: {err}") from err
    capture_seconds = time.perf_counter() - started
    with lent_weights([chain.orchestrator], ["orchestrator"], lent_to) if lent_to else contextlib.nullcontext():
        x0, shared = chain_inputs(chain, *inputs)
    return chain, x0, tuple(shared), capture_seconds, captured.specialized


@dataclass
class _ProfiledChain:
    """A captured chain with its measured costs and block menus: what plans at any budget are solved from."""

    chain: ChainGraph
    x0: torch.Tensor
    shared: tuple
    settings: PlanSettings
    profile: ChainProfile
    profile_seconds: float
    menus: object  # hierremat.planning.menus.ChainMenus, or None

    fitted: ShapeFit | None = None
    #: a model planned on meta: the gradients its step allocates are its own parameters' (the lent copies
    #: are shared by identical stages), read from it by name
    weights_of: nn.Module | None = None
    #: planned without block options at a fitted shape, where they could not pay (_profile_and_solve)
    blocks_not_recosted: bool = False
    #: there, the seconds per step they could still save (0: within the timing noise): RematModule re-costs them
    #: once the steps run without them have lost what re-costing takes
    block_gain: float = 0.0
    #: the stages' arguments (hierremat.planning.menus.stage_arguments) the fused-head-only menus were built from,
    #: kept for with_block_menus to build the blocks' from (None once they are built)
    arguments: tuple | None = None
    #: the caller's fp32 copies of the outputs (ModelPlan.output_copies_bytes), held beside the chain
    output_copies_bytes: int = 0
    #: planned without block options at a measured shape (none built yet: _profile_and_solve), what building them
    #: is taken to cost (seconds): what capturing and profiling the shape took
    build_estimate: float | None = None
    #: block options built at a measured shape, none built before, only because the cache had them there (a lookup;
    #: nothing said they pay: _profile_and_solve)
    menus_from_cache: bool = False
    #: a measured shape's times are those of one timed run each, not the medians of PROFILE_REPEATS (``of``'s
    #: ``one_run``)
    one_run: bool = False

    @classmethod
    def of(
        cls, chain: ChainGraph, x0: torch.Tensor, shared: tuple, settings: PlanSettings, deadline: float | None,
        fitted: ShapeFit | None = None, weights_of: nn.Module | None = None, blocks: bool = True, timed: bool = True,
        one_run: bool = False,
    ) -> "_ProfiledChain":
        """deadline: when building the block menus must be done (``time.perf_counter()``).
        fitted: this shape's costs fitted from shapes measured before (hierremat.planning.shape_fit):
        its times, and its memory where the fit is exact (else measured). weights_of: see the field.
        blocks: False leaves the stages without block menus (the output's fused head only: with_block_menus
        adds them). timed: False measures memory alone, in single runs (their times kept: a sample for memory
        fits), and builds no menu, not even the fused head's. one_run: a shape measured (not fitted) is timed from one
        run of each of its stages' no-grad forward, forward and backward after the memory runs, not the medians of
        PROFILE_REPEATS (two thirds of the timed runs, a third of a 4-layer GPT-2's profile, saved): where its
        training steps time it (RematModule._times_from_steps), which solve its plan again from theirs. (The memory
        runs' own times are no estimate: the allocator meter's recording made them up to 50% slower.)"""
        started = time.perf_counter()
        signatures = [info.signature for info in chain.infos]
        known, measure = (fitted.profile() if fitted is not None else None) or (None, frozenset())
        if known is not None and not measure:
            profile = known
        else:
            profile = profile_chain(
                chain.stages, x0, shared=shared, signatures=signatures,
                cost_cache=StageCostCache(settings.options_cache()), residents=chain.residents,
                timed=timed and fitted is None, repeats=1 if one_run and fitted is None else PROFILE_REPEATS,
                known=known, measure=measure,
            )
        if fitted is not None:
            profile = replace(profile, costs=fitted.stage_costs(profile.costs))
        profile_seconds = time.perf_counter() - started
        profiled = cls(chain, x0, shared, settings, profile, profile_seconds, None, fitted, weights_of,
                       one_run=one_run and fitted is None and profile.repeats < PROFILE_REPEATS)
        return profiled.with_block_menus(deadline, blocks) if timed else profiled  # (memory alone: no menu used)

    def with_block_menus(self, deadline: float | None, blocks: bool = True) -> "_ProfiledChain":
        """This chain with its menus built (where the settings ask for block options; ``blocks`` False: the
        output's fused head alone)."""
        if self.settings.block_options != "ilp" or self.settings.strategy != "optimal":
            return self
        signatures = [info.signature for info in self.chain.infos]
        arguments = self.arguments or stage_arguments(self.chain.stages, self.x0, self.shared, self.chain.residents,
                                                      signatures)
        menus = build_menus(
            self.chain.stages, self.x0, self.shared, signatures, cache=self.settings.options_cache(),
            variants=self.settings.variants, deadline=deadline, residents=self.chain.residents,
            recompute_across_dropouts=self.settings.segmentation != "none", fitted=self.fitted, blocks=blocks,
            backward_autocast=self.settings.backward_autocast, arguments=arguments,
        )
        if blocks:
            cost_cache = StageCostCache(self.settings.options_cache())
            for i, signature in self._distinct_stages(arguments[0], lambda i: menus.signatures[i] in menus.menus):
                cost_cache.put_menu_built(signature, arguments[0][i], self._menu_settings())
        return replace(self, menus=menus, arguments=None if blocks else arguments)

    def _distinct_stages(self, xs: Sequence[torch.Tensor], wanted=lambda i: True) -> list[tuple[int, str]]:
        """(index, signature) of the first stage ``wanted`` of each signature and input dtype and device (what a
        menu marker is keyed by: StageCostCache.menu_built), so that stages of one signature read or write it once."""
        first: dict[tuple, tuple[int, str]] = {}
        for i, (info, x) in enumerate(zip(self.chain.infos, xs)):
            if wanted(i):
                first.setdefault((info.signature, x.dtype, x.device), (i, info.signature))
        return list(first.values())

    def _menu_settings(self) -> str:
        """What a stage's menu depends on besides its signature and input (StageCostCache.put_menu_built)."""
        s = self.settings
        return f"variants={s.variants}:segmentation={s.segmentation}:backward_autocast={s.backward_autocast}"

    def menus_cached(self) -> bool:
        """Whether a stage's block menu was built at this shape with this cache and these settings before
        (StageCostCache.menu_built): then building them is a cache lookup (a menu the planning deadline cut short
        is not cached: built again). Needs the stages' arguments (``of`` with ``blocks`` False keeps them)."""
        cost_cache, xs = StageCostCache(self.settings.options_cache()), self.arguments[0]
        return any(cost_cache.menu_built(signature, xs[i], self._menu_settings())
                   for i, signature in self._distinct_stages(xs))

    @property
    def options_profile(self) -> ChainProfile:
        """The measured profile with the block menus' options (the profile alone without menus)."""
        return self.menus.extend(self.profile) if self.menus is not None else self.profile

    def block_options_gain(self, plan: SequentialPlan) -> float | None:
        """The most block options could save per step (seconds) on ``plan``, solved without them at a shape whose
        times are fitted: its predicted step less a bound on any plan's, each stage's fastest forward and backward
        once (a block option's bounded without tracing the stage: ShapeFit.least_block_time); None where a stage
        has no such bound. A plan that keeps every activation at a length well within the budget saves nothing
        more than what generated code may run faster."""
        profile = self.options_profile
        bound = 0.0
        for i, st in enumerate(profile.costs.stages):
            least = min(o.fwd_time + o.bwd_time for o in st.options)
            if self.fitted is not None and self.fitted.had_menu(i):
                block = self.fitted.least_block_time(i)
                if block is None:
                    return None
                least = min(least, block)
            bound += least
        log.debug("without block options: predicted step %.2f ms, any plan's at least %.2f ms",
                  plan.predicted_step_time * 1e3, bound * 1e3)
        return max(0.0, plan.predicted_step_time - bound)

    def _blocks_line(self) -> str:
        if not self.blocks_not_recosted:
            return ""
        if self.fitted is None:
            if not self.block_gain:
                return (f"; block options not built (they could save at most {NOISE_MARGIN:.0%} of its step, "
                        "the timing noise)")
            return (f"; block options not built yet (they could save at most {self.block_gain * 1e3:.1f} ms a step: "
                    f"built once the steps have lost what building them is taken to cost, {self.build_estimate:.2f} s)")
        if not self.block_gain:
            return f"; block options not re-costed at this shape (they could save at most {NOISE_MARGIN:.0%} of its step)"
        return (f"; block options not re-costed at this shape yet (they could save at most {self.block_gain * 1e3:.1f} "
                "ms a step: re-costed once its steps have lost what re-costing takes, or built once the steps of every "
                "shape have lost what building them takes where none is built yet)")

    @property
    def skipped_seconds(self) -> float:
        """Where the times are of one run each (``one_run``), what the other timed runs of a full profile would have
        taken: PROFILE_REPEATS - 1 more of each distinct stage's no-grad forward, forward and backward (a stage slower
        than SLOW_STAGE_SECONDS keeps its memory runs' times anyway)."""
        if not self.one_run:
            return 0.0
        distinct = {info.signature: st for info, st in zip(self.chain.infos, self.profile.costs.stages)}
        return (PROFILE_REPEATS - 1) * sum(st.nograd_fwd_time + st.options[0].fwd_time + st.options[0].bwd_time
                                     for st in distinct.values() if st.nograd_fwd_time <= SLOW_STAGE_SECONDS)

    def sample(self, times_measured: bool = True) -> ShapeSample:
        """This shape's measured costs (bindings unset), to fit later shapes' from (``times_measured`` False:
        its memory only)."""
        return ShapeSample.of(self.profile, self.menus, [info.signature for info in self.chain.infos], times_measured)

    @property
    def shared_bytes(self) -> int:
        return sum(storage_bytes(v) for v in self.shared if isinstance(v, torch.Tensor))

    @property
    def beside_chain_bytes(self) -> int:
        """Held beside the chain's schedule: the shared values and the caller's fp32 copies of the outputs (residents
        are in the chain's costs)."""
        return self.shared_bytes + self.output_copies_bytes

    def solve(self, budget_bytes: int, profile: ChainProfile | None = None, strategy: str | None = None,
              offload: bool = True, output_released: tuple[bool, ...] | None = None) -> SequentialPlan:
        """The chain's plan within ``budget_bytes`` for the whole model (the shared values set aside), from
        ``profile`` (default: the measured one, with the block menus' options), offloading where the settings
        say so (``offload`` False: never). output_released: the outputs that got a gradient where the caller
        released the output at another shape (_Compiled.released_output): with the same outputs here and no
        ``output_held`` setting, planned with it released from the start (else the first backward would find
        it released, and the next call re-plan). Raises InfeasibleBudgetError with the model's smallest feasible
        budget."""
        if profile is None:
            profile = self.options_profile
        output_held = self.settings.output_held
        if output_held is None and output_released is not None and output_released == profile.output_grad_mask:
            output_held = least_held_bytes(profile)
        try:
            return plan_from_profile(
                self.chain.stages, profile, budget_bytes - self.beside_chain_bytes, self.x0.device,
                slots=self.settings.slots, profile_seconds=self.profile_seconds,
                strategy=strategy or self.settings.strategy, output_held=output_held,
                step_grads=StepGrads(self.chain.stages, self.weights_of).bytes() if self.weights_of is not None else None,
                offloading=self.settings.offloading(self.x0.device) if offload else None,
            )
        except InfeasibleBudgetError as err:
            raise err.plus(budget_bytes, self.beside_chain_bytes, copies_note(self.output_copies_bytes)) from None

    def model_plan(self, chain_plan: SequentialPlan, capture_seconds: float, compiled: bool = False,
                   specialized: bool = False) -> ModelPlan:
        menus = self.menus
        return ModelPlan(
            chain_plan, tuple(self.chain.infos), self.shared_bytes, capture_seconds,
            menus={sig: m.to_dict() for sig, m in menus.menus.items()} if menus else {},
            options_seconds=menus.seconds if menus else 0.0, options_solves=menus.solves if menus else 0,
            segmentation=self.settings.segmentation, variants=self.settings.variants, compiled=compiled,
            outputs=self.settings.outputs,
            compile_seconds=menus.compile_seconds if menus else 0.0,
            capture_kind="specialized" if specialized else "exported",
            times=(self.fitted.describe() if self.fitted is not None else "measured" + (
                ONE_RUN_NOTE if self.one_run else ""))
            + self._blocks_line(),
            backward_autocast=menus.backward_autocast if menus else None,
            output_copies_bytes=self.output_copies_bytes,
            cost_model=cost_model_version(),
        )


def _profile_and_solve(
    chain: ChainGraph, x0: torch.Tensor, shared: tuple, settings: PlanSettings, started: float,
    fitted: ShapeFit | None, budget_bytes: int, weights_of: nn.Module | None = None,
    output_released: tuple[bool, ...] | None = None, recost_seconds: float | None = None, output_copies_bytes: int = 0,
    defer: bool = False, one_run: bool = False, profiling: bool = False,
) -> tuple[_ProfiledChain, SequentialPlan, bool]:
    """Profile the chain, build its block menus (compiled forms too where ``settings.compile``) and solve
    its plan within ``budget_bytes``: (the profiled chain, the plan, whether its options run compiled).
    weights_of: the model, where it is planned on meta (_ProfiledChain.weights_of). output_released: as
    _ProfiledChain.solve takes it. output_copies_bytes: the caller's fp32 copies of the outputs, held beside the chain.

    At a shape whose times are fitted, the plan is first solved without block options (no stage traced). It
    stands where they could save no more than NOISE_MARGIN of its step (the timing noise), or less per step
    than re-costing them takes (``recost_seconds``, as measured at another shape; None: re-cost them): the
    rent-or-buy choice of a shape that may never come back (RematModule re-costs them once its steps have lost
    that much: _ProfiledChain.block_gain).

    defer: at a measured shape, no block options built yet (RematModule: ``defer_block_options``), the plan is first
    solved without them too, and stands where they could save no more than the timing noise, or less per step than
    building them is taken to cost (``recost_seconds``, else what capturing and profiling this shape took: building
    a menu traces, profiles and runs each distinct stage again, and solves its ILP; _ProfiledChain.build_estimate;
    profiled with ``one_run``, the timed runs skipped counted in: _ProfiledChain.skipped_seconds).
    Where a stage's menu was built at this shape with this cache before (_ProfiledChain.menus_cached), they are
    built at once (a lookup).

    profiling: the caller's torch.profiler session runs (RematModule): on CPU, where the budget does not need them,
    block options are neither built nor re-costed at this shape (that measures the CPU allocator with a session of
    its own, which would end the caller's: hierremat.device.memory.check_no_profiler); RematModule builds them at a
    step after the session, at its first where they were to be built now."""
    compiling = resolve_compile(settings.compile, x0.device)
    profiling = profiling and x0.device.type == "cpu"
    lazy = (fitted is not None or defer or profiling) and settings.block_options == "ilp" \
        and settings.strategy == "optimal" and not compiling
    profiled = replace(_ProfiledChain.of(chain, x0, shared, settings, settings.deadline(started), fitted, weights_of,
                                         blocks=not lazy, one_run=one_run),
                       output_copies_bytes=output_copies_bytes)
    cached = lazy and fitted is None and profiled.menus_cached()  # (built at once: a lookup)
    if lazy and fitted is None and not cached and recost_seconds is None:  # (what capturing and profiling it took)
        recost_seconds = time.perf_counter() - started + profiled.skipped_seconds
    if lazy and not cached:
        try:
            chain_plan = profiled.solve(budget_bytes, output_released=output_released)
        except InfeasibleBudgetError:
            chain_plan = None
        gain = profiled.block_options_gain(chain_plan) if chain_plan is not None else None
        if profiling and chain_plan is not None and gain is None:
            gain = chain_plan.predicted_step_time  # (no bound without tracing the stages: at most the step)
        if gain is not None:
            noise = gain <= NOISE_MARGIN * (chain_plan.predicted_step_time - gain)
            if noise or profiling or (recost_seconds is not None and gain < recost_seconds):
                what = "re-costed" if fitted is not None else "built"
                later = "" if noise else " (after the torch.profiler session running now)" if profiling else \
                    f" ({what} after steps that lose about {recost_seconds:.2f} s)"  # (None only where noise)
                log.info("block options not %s at this shape: they could save at most %.1f ms of the plan's "
                         "predicted %.1f ms a step%s", what, gain * 1e3, chain_plan.predicted_step_time * 1e3, later)
                build = recost_seconds if fitted is None else None
                if profiling and not defer and fitted is None:
                    build = 0.0  # (they were to be built now: at the first step after the session)
                deferred = replace(profiled, blocks_not_recosted=True, block_gain=0.0 if noise else gain,
                                   build_estimate=build)
                return deferred, chain_plan, False
    if lazy:
        profiled = replace(profiled.with_block_menus(settings.deadline(started)), menus_from_cache=cached)
    menus = profiled.menus
    compiled = menus is not None and compiling
    if compiled:
        chain_plan = plan_compiled(
            menus, profiled.profile, lambda p: profiled.solve(budget_bytes, p, output_released=output_released),
            chain.stages, x0, shared,
            settings.inductor_cache(), settings.deadline(started),
        )
    else:
        chain_plan = profiled.solve(budget_bytes, output_released=output_released)
    return profiled, chain_plan, compiled


def _compile(
    model: nn.Module, args: tuple, kwargs: dict, budget_bytes: int | None, plan: ModelPlan | None, settings: PlanSettings,
    symbolic: SymbolicCapture | None = None, samples: Sequence[ShapeSample] = (), shards: bool = False,
    output_released: tuple[bool, ...] | None = None, recost_seconds: float | None = None, upcasts: bool = False,
    defer: bool = False, steps_time: bool = False, profiling: bool = False,
) -> _Compiled:
    """Capture (specialized from ``symbolic`` where it holds at these inputs), profile and plan, or run ``plan``.
    samples: times measured at other shapes of these inputs (hierremat.planning.shape_fit): where they
    span this shape, its times are fitted from them and only its memory is measured. steps_time: the training steps
    time this shape (RematModule._times_from_steps): its times are fitted from fewer shapes timed than a fit's
    monomials too (ShapeFit.of's ``reduced``), and where it is measured, it is timed from one run each; its plan is
    solved again from its steps' times once they are recorded (RematModule._retime). shards: the model is
    sharded with FSDP2 and planned here within hierremat.runtime.fsdp.without_weights (RematModule._add_sharded).
    output_released: how the caller used the output at the inputs' other shapes (_ProfiledChain.solve).
    recost_seconds: what re-costing block options at a fitted shape takes (_profile_and_solve). upcasts: the caller
    copies the fp16/bf16 outputs to fp32 (hierremat.graphs.hf.upcasts_outputs): the copies are planned for.
    defer: a measured shape may be planned without block options, none built yet (_profile_and_solve). profiling:
    the caller's torch.profiler session runs: block options are put off where the budget allows (_profile_and_solve)."""
    started = time.perf_counter()
    model = uncompiled(model)
    if is_sharded(model) and not shards:
        raise UnsupportedModelError(
            f"{type(model).__name__} is already sharded with fully_shard: hierremat plans the whole model first. Call "
            "hierremat.remat(model, ...) before fully_shard (as activation checkpointing is applied before it), then "
            "fully_shard each block and the model; the first call re-plans for the shards"
        )
    lent_to = _lending_device(model, args, kwargs, settings.device)
    if lent_to is None:
        check_devices(_device_types(args, kwargs), "the example inputs")
        autocast = AutocastState.capture(_device_types(args, kwargs))
    else:
        if plan is not None:
            raise UnsupportedModelError("a saved plan runs on a materialized model: call remat(..., plan=) after "
                                        "to_empty and initialization, or plan the model on meta here")
        symbolic = None  # (each shape of a model without weights is exported on meta)
        autocast = AutocastState.capture((lent_to.type,))
    chain, x0, shared, capture_seconds, specialized = _captured_chain(
        model, args, kwargs, settings, autocast, started, symbolic, lent_to
    )
    signatures = [info.signature for info in chain.infos]
    menus = None
    fitted = None
    bindings = symbolic.bindings(args, kwargs) if symbolic is not None else None
    if plan is None and bindings and specialized:
        fitted = ShapeFit.of(samples, bindings, chain_pattern(signatures), reduced=steps_time)
    sample = None
    profiled = None
    if plan is None:
        with lent_weights(chain.stages, signatures, lent_to) if lent_to is not None else contextlib.nullcontext(0) as lent:
            profiled, chain_plan, compiled = _profile_and_solve(
                chain, x0, shared, settings, started, fitted, budget_bytes, model if lent_to is not None else None,
                output_released, recost_seconds, chain.half_outputs_in_fp32_bytes if upcasts else 0, defer,
                one_run=steps_time and fitted is None, profiling=profiling,
            )
        if fitted is None:
            sample = profiled.sample()
        elif fitted.unfitted_memory is None and profiled.profile.memory_trace is not None:
            sample = profiled.sample(times_measured=False)  # its memory measured in full: for memory fits
        menus = profiled.menus
        plan = replace(profiled.model_plan(chain_plan, capture_seconds, compiled, specialized), lent_weight_bytes=lent)
        log.info(
            "planned %s: %d stages, predicted peak %s, step %.1f ms", type(model).__name__, len(plan.stages),
            format_bytes(plan.predicted_peak_bytes), plan.predicted_step_time * 1e3,
        )
        if log.isEnabledFor(logging.DEBUG):  # (a summary replays the plan: not on every new shape unasked)
            log.debug("%s", plan.summary())
    else:
        if plan.chain.autocast != autocast.describe():
            raise ValueError(
                f"plan was made with autocast {plan.chain.autocast!r} and is used with autocast {autocast.describe()!r}: "
                "call hierremat.plan/remat under the autocast context you train with"
            )
        if plan.signatures != tuple(signatures):
            raise ValueError(
                "plan does not match this model and input: its stages have other signatures "
                f"({len(plan.signatures)} planned, {len(signatures)} captured); make a new plan with hierremat.plan"
            )
        if plan.cost_model != cost_model_version():
            log.warning(
                "the saved plan's costs were measured by %s and this hierremat measures as %s: its predicted peak and "
                "times may differ from what it would plan now; plan again (hierremat.plan) and save the new plan",
                f"the cost model {plan.cost_model}" if plan.cost_model else "a hierremat from before 2026-11-26",
                cost_model_version(),
            )
        if plan.menus or options_used(plan.chain.schedule):  # (a fused head alone is an option with no menu stored)
            stored = {sig: StageMenu.from_dict(m) for sig, m in plan.menus.items()}
            menus = build_menus(
                chain.stages, x0, shared, signatures, stored=stored, variants=settings.variants, residents=chain.residents,
                backward_autocast=plan.backward_autocast,
            )
            if plan.compiled:  # its costs are those of compiled options and forwards: run them so
                offer_compiled(menus)
                compile_options(
                    menus, options_used(plan.chain.schedule), chain.stages, x0, shared, settings.inductor_cache(),
                    measure=False,
                )
                compiled_forwards = {i for i, st in enumerate(plan.chain.costs.stages) if st.nograd_form == "compiled"}
                if compiled_forwards:
                    compile_forwards(
                        menus, chain.stages, x0, shared, settings.inductor_cache(), wanted=compiled_forwards,
                        measure=False,
                    )
    planned = PlannedChain(
        chain.stages, plan.chain, slots=settings.slots, strategy=settings.strategy, signatures=signatures, menus=menus,
        residents=chain.residents, offloading=settings.offloading(x0.device),
    )
    chain_module = ChainModule(chain.stages, planned)
    setattr(chain.orchestrator, CHAIN_ATTRIBUTE, chain_module)
    compiled = _Compiled(chain, plan, chain_module)
    if lent_to is not None:  # other forms (the fused head) were made while weights were lent: give them back
        bind_to_model(compiled.graphs(), model)
        compiled.lent = True
    compiled.sample = sample
    compiled.saved = profiled is None
    compiled.bindings = bindings
    compiled.reduced_fit = fitted is not None and fitted.reduced
    compiled.one_run = profiled is not None and profiled.one_run
    if profiled is not None:
        compiled.least_held = least_held_bytes(profiled.profile)
        compiled.block_gain = profiled.block_gain
        compiled.build_estimate = profiled.build_estimate
        compiled.menus_from_cache = profiled.menus_from_cache
    compiled.skeleton = pytree.tree_map(
        lambda v: torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v, (args, kwargs)
    )
    return compiled


def _sample_at(model: nn.Module, args: tuple, kwargs: dict, settings: PlanSettings, symbolic: SymbolicCapture,
               blocks: bool = True, timed: bool = True, cached_blocks: bool = False) -> ShapeSample | None:
    """The costs measured in full at these inputs (times and memory, no plan solved), captured from
    ``symbolic`` (never exported on their own), bound to their sizes; None where the capture does not take
    them, or ``timed`` is False (memory alone, in single runs: a sample for memory fits) and the meter recorded
    no memory trace. blocks: False measures no block menu (their node times and speeds: none was built yet);
    ``cached_blocks``: only where this cache has them at these sizes (_ProfiledChain.menus_cached)."""
    bindings = symbolic.bindings(args, kwargs)
    if bindings is None:
        return None
    started = time.perf_counter()
    autocast = AutocastState.capture(_device_types(args, kwargs))
    chain, x0, shared, _, _ = _captured_chain(model, args, kwargs, settings, autocast, started, symbolic, export=False)
    deadline = settings.deadline(started)
    profiled = _ProfiledChain.of(chain, x0, shared, settings, deadline, blocks=blocks and not cached_blocks, timed=timed)
    if blocks and cached_blocks and profiled.arguments is not None and profiled.menus_cached():
        profiled = profiled.with_block_menus(deadline)
    if not timed and profiled.profile.memory_trace is None:
        return None
    return profiled.sample(times_measured=timed).bound(bindings)


def _shapes(inputs: tuple) -> tuple:
    """The shapes of the tensors among ``inputs`` (``(args, kwargs)``, tensors or meta skeletons)."""
    return tuple(tuple(v.shape) for v in pytree.tree_leaves(inputs) if isinstance(v, torch.Tensor))


def _device_types(args: tuple, kwargs: dict) -> tuple[str, ...]:
    leaves = pytree.tree_leaves((args, kwargs))
    return tuple(dict.fromkeys(v.device.type for v in leaves if isinstance(v, torch.Tensor)))


def _family_key(args: tuple, kwargs: dict) -> tuple:
    """What one symbolic capture serves (hierremat.graphs.symbolic): the inputs' structure, dtypes,
    devices, ranks and non-tensor values, and the autocast setting; not their sizes."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    autocast = AutocastState.capture(_device_types(args, kwargs)).key()
    return (str(spec), autocast) + tuple(
        (v.dim(), v.dtype, v.device, v.requires_grad) if isinstance(v, torch.Tensor) else repr(v) for v in leaves
    )


def _input_key(model: nn.Module, args: tuple, kwargs: dict, padding: bool) -> tuple:
    """What a plan for ``model(*args, **kwargs)`` is specific to: the inputs' structure, shapes, dtypes,
    devices, the autocast setting, and with ``padding``, which padding masks are all ones
    (hierremat.graphs.eager_masks)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    autocast = AutocastState.capture(_device_types(args, kwargs)).key()
    return (str(spec), autocast, padding_key(model, args, kwargs) if padding else ()) + tuple(
        (tuple(v.shape), v.dtype, v.device, v.requires_grad) if isinstance(v, torch.Tensor) else repr(v) for v in leaves
    )


class RematModule(nn.Module):
    """The model, called exactly like it, whose training step fits the budget.

    Plans are cached per input shapes and autocast setting; a call with new shapes re-plans
    (``on_new_shape="replan"``) or raises (``"error"``). A call under an autocast setting
    not planned for yet plans for it (logged once per setting): call ``remat`` inside the
    autocast context you train with to plan once. For a model whose attention bias eager mode
    masks otherwise in batches without padding (hierremat.graphs.eager_masks), so does a first
    batch whose padding masks (``*attention_mask``) are all ones where the planned one's were
    not, or the reverse.

    It presents what training loops read from the model they are given (Hugging Face's Trainer,
    accelerate): its forward's signature (Trainer keeps the dataset columns the forward names),
    every attribute it does not have itself (``config``, ``main_input_name``, ``save_pretrained``,
    ...: the model's), and the model's ``state_dict`` keys (saved and loaded without a prefix).
    """

    def __init__(self, model: nn.Module, budget_bytes: int, on_new_shape: str, settings: PlanSettings,
                 max_shapes: int = DEFAULT_MAX_SHAPES, dynamic: bool | None = None):
        super().__init__()
        if on_new_shape not in ("replan", "error"):
            raise ValueError(f"on_new_shape must be 'replan' or 'error', got {on_new_shape!r}")
        if not (dynamic is None or isinstance(dynamic, bool)):
            raise ValueError(f"dynamic must be None (sizes marked dynamic or a padded attention_mask make them "
                             f"symbolic at the first shape, the sizes that vary at the second), True (every size "
                             f"symbolic at the first shape) or False (each shape captured on its own), got {dynamic!r}")
        if not isinstance(max_shapes, int) or isinstance(max_shapes, bool) or max_shapes < 1:
            raise ValueError(f"max_shapes must be a positive int (how many input shapes' plans are kept), got {max_shapes!r}")
        self.model = uncompiled(model)
        self.budget_bytes = budget_bytes
        self.on_new_shape = on_new_shape
        self.dynamic = dynamic
        self.settings = settings
        self.max_shapes = max_shapes
        self._compiled: OrderedDict[tuple, _Compiled] = OrderedDict()  # least recently used first
        self._symbolic: dict[tuple, SymbolicCapture | None] = {}  # per _family_key; None: export each shape
        self._symbolic_dims: dict[tuple, frozenset] = {}  # per _family_key: the dimensions its capture made symbolic
        #: per _family_key whose first shape's symbolic capture failed: the dimensions it tried (not tried again)
        self._first_capture_failed: dict[tuple, frozenset] = {}
        self._samples: dict[tuple, list[ShapeSample]] = {}  # per _family_key: times measured at its shapes
        #: per _family_key whose times the training steps give (_times_from_steps): the shapes timed there
        self._step_samples: dict[tuple, list[ShapeSample]] = {}
        self._per_padding = False  # plans kept per all-ones padding state (a captured graph branches on it)
        self._recost_seconds: float | None = None  # what re-costing block options at a fitted shape took, last time
        self._blocks_built = False  # whether any shape's plan has block options built (block menus)
        self._blocks_pay = False  # whether block options were built because they pay or the budget needs them
        self._lost_without_blocks = 0.0  # seconds block options could have saved the steps run before any was built
        self._profiler_logged = False  # whether block options were put off for a torch.profiler session (logged once)
        self._present_signature()
        self.register_state_dict_post_hook(_without_model_prefix)
        self.register_load_state_dict_pre_hook(_with_model_prefix)

    def _present_signature(self) -> None:
        """Make ``inspect.signature(self.forward)`` the wrapped model's (a forward of this instance)."""
        try:
            signature = inspect.signature(self.model.forward)
        except (TypeError, ValueError):  # a builtin or C forward: keep (*args, **kwargs)
            return
        self.__dict__["forward"] = _PresentedForward(self, signature)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules
        except AttributeError:
            model = self.__dict__.get("_modules", {}).get("model")
            if model is None or name.startswith("__"):
                raise
            return getattr(model, name)  # config, main_input_name, save_pretrained, ...

    @property
    def plans(self) -> list[ModelPlan]:
        return [c.plan for c in self._compiled.values()]

    def _add(self, args: tuple, kwargs: dict, plan: ModelPlan | None = None, settings: PlanSettings | None = None,
             budget_bytes: int | None = None, shards: bool = False, defer_blocks: bool = True,
             carry_steps: bool = True) -> _Compiled:
        """Plan the model for these inputs (``settings`` and ``budget_bytes``: this module's, unless given; ``shards``:
        as _compile takes it; ``defer_blocks`` False: block options re-costed at a fitted shape wherever they could
        pay, and built at a measured shape, none built yet, whatever ``settings.defer_block_options`` says; a shape
        planned again goes on with the steps its plan before timed unless ``carry_steps`` is False) and keep the
        plan."""
        settings = settings or self.settings
        budget_bytes = budget_bytes if budget_bytes is not None else self.budget_bytes
        kwargs = call_kwargs(self.model, kwargs)
        lending = settings.device or has_abstract_weights(self.model)
        lent_to = _lending_device(self.model, args, kwargs, settings.device) if lending else None
        if lent_to is not None:  # planned for inputs on the device it trains on
            args, kwargs = lent_inputs((args, kwargs), lent_to)
        check_devices(_device_types(args, kwargs), "the inputs" if self._compiled else "the example inputs")
        symbolic = self._symbolic_capture(args, kwargs) if plan is None and lent_to is None else None
        family = _family_key(args, kwargs)
        first = not any(c.family == family for c in self._compiled.values())
        samples = self._samples.setdefault(family, [])
        from_steps = self._times_from_steps(family, args, kwargs, settings, shards or plan is not None
                                            or lent_to is not None)
        if symbolic is not None:
            self._sample_shorter_length(symbolic, args, kwargs, samples, from_steps)
        key = _input_key(self.model, args, kwargs, self._per_padding)
        sources: list[str] = []
        try:
            with recorded_sources() as sources:
                compiled = _compile(self.model, args, kwargs, budget_bytes, plan, settings, symbolic,
                                    [*samples, *self._step_samples_of(family)], shards, self._released_output(family),
                                    self._recost_seconds if defer_blocks else None, upcasts_outputs(self),
                                    defer_blocks and self._deferring(settings), steps_time=from_steps,
                                    profiling=profiler_active())
        except BaseException:  # (an infeasible budget, an unsupported model: nothing of it is kept)
            forget_sources(sources)
            raise
        compiled.sources = sources
        compiled.family_timed = self._timed_count(family)
        if from_steps:  # (a shape planned again goes on with the steps timed before)
            before = self._compiled.get(key)
            earlier = before.chain_module.planned.step_times if before is not None and carry_steps else None
            compiled.chain_module.planned.time_steps(TIMED_STEPS, earlier)  # (the plan before's go on, same chain)
            self._retime(compiled)
        recosted = any(m.get("recosted") for m in compiled.plan.menus.values())
        if recosted and not compiled.plan.times.startswith("measured"):
            self._recost_seconds = compiled.plan.options_seconds  # (block options re-costed at a fitted shape)
        elif compiled.build_estimate is not None and self._recost_seconds is None:
            self._recost_seconds = compiled.build_estimate  # (none built yet: what building them is taken to cost)
        elif compiled.plan.menus and not self._blocks_built:  # built (solved): the next fitted shape re-costs at once,
            self._recost_seconds = None  # as after a first shape planned with them, and learns what re-costing takes
        self._blocks_built |= bool(compiled.plan.menus)
        self._blocks_pay |= bool(compiled.plan.menus) and not compiled.menus_from_cache
        if self._compiled:  # a new shape: what torch cached for this one's traces is not needed again
            clear_fake_tensor_cache()
        if compiled.sample is not None and compiled.bindings:
            add_sample(samples, compiled.sample.bound(compiled.bindings))
            if first and from_steps:  # (captured at its first shape: sizes said to vary; memory_sizes_ahead: that alone)
                self._sample_memory_ahead(symbolic, args, kwargs, samples)
        if not self._per_padding and any(has_value_branch(s.graph_module) for s in compiled.chain.stages):
            self._per_padding = True
            self._drop_plans()  # (keyed without the padding state; planned again when called)
        compiled.family = family
        self._compiled[_input_key(self.model, args, kwargs, self._per_padding)] = compiled
        while len(self._compiled) > self.max_shapes:
            _, dropped = self._compiled.popitem(last=False)
            forget_sources(dropped.sources)
        return compiled

    def _times_from_steps(self, family: tuple, args: tuple, kwargs: dict, settings: PlanSettings,
                          elsewhere: bool) -> bool:
        """Whether the family's stage times are taken from its training steps (hierremat.runtime.step_times) rather
        than profiled apart for them: for inputs on CPU (where a step's ops are timed as they run) while block options
        are still to be built once they pay, decided at the family's first shape and confirmed at its second (where
        block options were built by then, from the cache or because the budget needs them, its shapes are profiled
        for times as before: those samples carry the node times that re-cost block options at the shapes fitted).
        ``elsewhere``: this shape is planned elsewhere (FSDP2's shards, a saved plan, a model without weights): no.

        Every shape of such a family records its first TIMED_STEPS steps; a shape measured is timed from one
        run each (_ProfiledChain.of's ``one_run``) and solved again from its steps' times once they are recorded; a
        shape fitted is fitted from the shapes timed so far however few (ShapeFit.of's ``reduced``: the second
        length's times are the first's scaled by the tokens) and planned again whenever more are timed
        (``_refreshed``); every shape is solved again from its own steps' times once they are recorded (_retime); no
        shape is profiled for times alone (sizes_to_sample)."""
        shapes = {_shapes(c.skeleton) for c in self._compiled.values() if c.family == family}
        steps = self._step_samples.get(family)
        if steps is None:
            if shapes or elsewhere or _device_types(args, kwargs) != ("cpu",) or not self._deferring(settings):
                return False
            self._step_samples[family] = []
            return True
        if len(shapes) == 1 and _shapes((args, kwargs)) not in shapes and not self._deferring(settings):
            del self._step_samples[family]  # (its second shape, block options built since)
            return False
        return not elsewhere

    def _step_samples_of(self, family: tuple) -> list[ShapeSample]:
        """The family's shapes timed in its training steps (none where its times are not fitted from them), with
        the steps recorded since the last call added: each shape's stage times, bound by the family's symbolic
        capture (what its steps did not time taken from its plan's times: _observed_times)."""
        samples = self._step_samples.get(family)
        symbolic = self._symbolic.get(family)
        if samples is None or symbolic is None:
            return []
        for compiled in self._compiled.values():
            step_times = compiled.chain_module.planned.step_times
            if compiled.family != family or step_times is None or step_times.steps <= compiled.steps_sampled:
                continue
            compiled.steps_sampled = step_times.steps
            bindings = symbolic.bindings(*compiled.skeleton)
            times = self._observed_times(compiled)
            if bindings and times is not None:
                pattern = chain_pattern([info.signature for info in compiled.chain.infos])
                add_sample(samples, ShapeSample.from_step_times(bindings, pattern, times), STEP_SAMPLES)
        return samples

    @staticmethod
    def _observed_times(compiled: _Compiled) -> tuple | None:
        """The stage times observed in ``compiled``'s training steps (StepTimes.stage_times: what a stage's steps did
        not time taken from its plan's times), or None where none were."""
        step_times = compiled.chain_module.planned.step_times
        if step_times is None:
            return None
        return step_times.stage_times([(st.nograd_fwd_time, st.options[0].fwd_time, st.options[0].bwd_time)
                                       for st in compiled.plan.chain.costs.stages])

    def _retime(self, compiled: _Compiled) -> None:
        """Solve a shape's plan again (the chain DP alone) from its training steps' times once its TIMED_STEPS steps
        are recorded (their medians: _times_from_steps), and, where it was measured from one timed run each, after
        its first step too: the times it runs with are then what its own steps took, whatever it was planned from
        (a fit from other lengths' single steps, one of them a noisy step, had predicted a 268-token step at 2.8x
        the measured)."""
        step_times = compiled.chain_module.planned.step_times
        steps = step_times.steps if step_times is not None else 0
        early = compiled.one_run and not compiled.retimed_steps  # (after its first step)
        if steps == compiled.retimed_steps or (step_times.recording and not early):
            return
        times = self._observed_times(compiled)
        if times is None:
            return
        before, note = compiled.plan.predicted_step_time, compiled.times_note
        compiled.chain_module.planned.retime(times, torch.device("cpu"))  # (steps are timed on CPU alone)
        compiled.retimed_steps = steps
        compiled.relabel_times(note, compiled.times_note)
        if before > 0:  # (a heuristic: what block options could save, a share of the step, kept as that share)
            compiled.block_gain *= compiled.plan.predicted_step_time / before
        log.info("%s solved again at this shape from the times of its first %d training steps: predicted step %.1f ms "
                 "(%.1f ms before)", type(self.model).__name__, steps, compiled.plan.predicted_step_time * 1e3,
                 before * 1e3)

    def _deferring(self, settings: PlanSettings) -> bool:
        """Whether block options are still to be built once they pay (``defer_block_options``, none built yet)."""
        return settings.defer_block_options and not self._blocks_built

    def _plan_again(self, key: tuple, args: tuple, kwargs: dict, defer_blocks: bool = True,
                    carry_steps: bool = True) -> _Compiled:
        """The plan of ``key`` (these inputs') made again (the same shape: whatever on_new_shape says), in its place;
        the old one kept until then (what the caller did with the output is read from it; on error it stays)."""
        old = self._compiled[key]
        compiled = self._add(args, kwargs, defer_blocks=defer_blocks, carry_steps=carry_steps)
        if self._compiled.get(key) is not old:  # (replaced, or dropped with the others: a padding state now keyed)
            forget_sources(old.sources)
        return compiled

    def _refreshed(self, key: tuple, compiled: _Compiled, args: tuple, kwargs: dict) -> _Compiled:
        """``compiled``, the plan of ``key``, or the plan made again in its place: for the caller's autocast recipe,
        now known (_planned_for_another_recipe), or with its block options re-costed once a grad step without them
        has lost what re-costing takes (rent or buy: _profile_and_solve; none built yet: built once the grad steps of
        every shape have lost what building them is taken to cost), or for fp32 copies of the outputs the
        caller now makes or no longer makes (accelerate's mixed precision wraps the forward after remat planned it)."""
        if self._planned_for_another_recipe(compiled):  # (the steps timed before ran the other recipe)
            return self._plan_again(key, args, kwargs, carry_steps=False)
        if compiled.reduced_fit and torch.is_grad_enabled() and compiled.family_timed < self._timed_count(
                compiled.family):
            log.info("%s planned again at this shape: its times were fitted from fewer shapes than a fit needs, and "
                     "the training steps have timed more since", type(self.model).__name__)
            return self._plan_again(key, args, kwargs)
        if torch.is_grad_enabled():
            self._retime(compiled)
        copies = compiled.chain.half_outputs_in_fp32_bytes if upcasts_outputs(self) else 0
        if copies != compiled.plan.output_copies_bytes:
            if not compiled.saved:
                log.info("%s's outputs are %s copied to fp32 by the caller (accelerate's mixed precision): planned again",
                         type(self.model).__name__, "now" if copies else "no longer")
                return self._plan_again(key, args, kwargs)
            if copies and not compiled.copies_warned:
                compiled.copies_warned = True
                log.warning("the caller copies the model's fp16/bf16 outputs to fp32 (accelerate's mixed precision), "
                            "and the saved plan does not count the copies (%d B): its peak may exceed its budget by "
                            "that much; plan with hierremat.remat under the same wrapper instead", copies)
        if not compiled.block_gain or not torch.is_grad_enabled():
            return compiled
        if profiler_active():  # (building or re-costing them measures the CPU allocator with one: after it)
            if not self._profiler_logged:
                self._profiler_logged = True
                log.info("a torch.profiler session runs: block options are not built or re-costed until it ends")
            return compiled
        if not self._blocks_built:  # building them serves every shape: the steps of all count
            self._lost_without_blocks += compiled.block_gain
            if self._lost_without_blocks < self._recost_seconds:
                compiled.steps_without += 1
                return compiled
            log.info("block options built at this shape after steps without them lost up to %.2f s (building them "
                     "was taken to cost %.2f s)", self._lost_without_blocks, self._recost_seconds)
            return self._plan_again(key, args, kwargs, defer_blocks=False)
        if self._recost_seconds is not None and compiled.steps_without * compiled.block_gain < self._recost_seconds:
            compiled.steps_without += 1  # (None: built since this shape was planned, what re-costing takes not known)
            return compiled
        log.info("block options re-costed at this shape after %d steps without them (each up to %.1f ms slower)",
                 compiled.steps_without, compiled.block_gain * 1e3)
        return self._plan_again(key, args, kwargs, defer_blocks=False)

    def _timed_count(self, family: tuple) -> int:
        """How many of the family's shapes are timed, profiled or in the training steps (a shape whose times were
        fitted from fewer than a fit's monomials is planned again once more are: its own steps' times make it exact
        at itself, a third shape's the fit whole)."""
        timed = {s.bindings for s in self._samples.get(family, ()) if s.times_measured}
        return len(timed | {s.bindings for s in self._step_samples_of(family)})

    def _learn_backward_recipe(self) -> None:
        """Take the caller's autocast recipe (PlanSettings.backward_autocast) from the last backward under autocast of
        any of this module's plans: every shape planned from now on is traced for it (warned where it contradicts
        the one given)."""
        seen = self._observed_backward_autocast()
        given = self.settings.backward_autocast
        if seen is None or given == seen:
            return
        self.settings = replace(self.settings, backward_autocast=seen)
        (log.info if given is None else log.warning)(
            "the backward runs %s autocast%s: %s's shapes are planned for it", "under" if seen else "outside",
            "" if given is None else f", not as backward_autocast={given} said", type(self.model).__name__,
        )

    def _planned_for_another_recipe(self, compiled: _Compiled) -> bool:
        """Whether ``compiled`` is to be planned again for the caller's autocast recipe, now known
        (_learn_backward_recipe): planned before, with stages left without block options for it, or for the other
        recipe. A saved plan for the other recipe is warned about once, not planned again."""
        menus = compiled.chain_module.planned.menus
        recipe = self.settings.backward_autocast
        if menus is None or recipe is None:
            return False
        other = menus.backward_autocast is not None and menus.backward_autocast != recipe
        if compiled.saved:
            if other and not compiled.recipe_warned:
                compiled.recipe_warned = True
                log.warning("the saved plan's block options were traced for the backward %s autocast, and it runs %s "
                            "it: their gradients may differ from plain autocast's in the last bits; plan again with "
                            "backward_autocast=%s", "under" if menus.backward_autocast else "outside",
                            "under" if recipe else "outside", recipe)
            return False
        return bool(menus.recipe_dependent) or other

    def _observed_backward_autocast(self) -> bool | None:
        """Whether the last backward under autocast of this module's plans (most recently used first) ran under it."""
        for compiled in reversed(self._compiled.values()):
            seen = compiled.chain_module.planned.runner.observed_backward_autocast
            if seen is not None and compiled.plan.chain.autocast != "off":
                return seen
        return None

    def _released_output(self, family: tuple) -> tuple[bool, ...] | None:
        """_Compiled.released_output of the last shape of these inputs (``family``: _family_key) run with a
        backward since it was planned: a new shape is planned for the output's use seen there."""
        for compiled in reversed(self._compiled.values()):
            if compiled.family == family and compiled.chain_module.planned.runner.observed_output_use is not None:
                return compiled.released_output()
        return None

    def _add_sharded(self, args: tuple, kwargs: dict) -> _Compiled:
        """A new input shape after ``fully_shard`` (every rank called with it: _ranks_plan): planned
        as a model built on meta is (its parameters' whole shapes, weights lent on the device its shards are on:
        hierremat.runtime.fsdp.without_weights), without block options (FSDP2 runs option 0) and without a budget
        (the whole model's gradients would be counted, not the shards'), then re-planned for the shards within the
        budget, every rank on rank 0's plan or raising rank 0's InfeasibleBudgetError."""
        device = str(next(iter(self.model.parameters())).device)  # (a DTensor's: where its local shard is)
        settings = replace(self.settings, device=device, block_options="autograd", compile=False)
        with without_weights(self.model):
            compiled = self._add(args, kwargs, settings=settings, budget_bytes=UNBOUNDED_BYTES, shards=True)
        log.info("%s is sharded: a new input shape planned without its weights, then for the shards",
                 type(self.model).__name__)
        compiled.shard(self.model, self.budget_bytes)
        return compiled

    def _sample_shorter_length(self, symbolic: SymbolicCapture, args: tuple, kwargs: dict,
                               samples: list[ShapeSample], from_steps: bool = False) -> None:
        """At a family's second shape (while its measured shapes cannot fit a new one's times), measure the
        model also at shorter lengths cut from these inputs (hierremat.planning.shape_fit.sizes_to_sample),
        so that this shape or the shapes after it are fitted rather than each measured (``from_steps``: not, the
        training steps time the shapes: _times_from_steps); then, while the shapes whose memory was measured are
        too few to check a memory fit, its memory alone at shorter lengths still (memory_sizes_to_sample). A length
        the model cannot take is skipped (logged)."""
        bindings = symbolic.bindings(args, kwargs)
        if not bindings:
            return
        self._sample_at_lengths(symbolic, args, kwargs, samples,
                                sizes_to_sample(samples, bindings) if not from_steps else None, timed=True)
        family = _family_key(args, kwargs)
        wanted = memory_sizes_to_sample(samples, bindings, self._step_samples_of(family) if from_steps else None)
        self._sample_at_lengths(symbolic, args, kwargs, samples, wanted, timed=False)

    def _sample_memory_ahead(self, symbolic: SymbolicCapture, args: tuple, kwargs: dict,
                             samples: list[ShapeSample]) -> None:
        """At a family's first shape, captured symbolically because its sizes were said to vary: measure its
        memory alone at shorter lengths cut from these inputs now (hierremat.planning.shape_fit.memory_sizes_ahead),
        so that the shapes after it are planned from fits alone, none measured (the cost of a second shape, paid
        at the first where the caller said shapes will vary)."""
        wanted = memory_sizes_ahead(samples, symbolic.bindings(args, kwargs) or {})
        self._sample_at_lengths(symbolic, args, kwargs, samples, wanted, timed=False)

    def _sample_at_lengths(self, symbolic: SymbolicCapture, args: tuple, kwargs: dict, samples: list[ShapeSample],
                           wanted: tuple[tuple[str, ...], tuple[int, ...]] | None, timed: bool) -> None:
        """_sample_at_length at each of ``wanted``'s values (its sizes, its values: planning.shape_fit's
        sizes_to_sample and kin; None: none)."""
        for value in wanted[1] if wanted is not None else ():
            self._sample_at_length(symbolic, args, kwargs, samples, wanted[0], value, timed=timed)

    def _sample_at_length(self, symbolic: SymbolicCapture, args: tuple, kwargs: dict, samples: list[ShapeSample],
                          names: tuple[str, ...], value: int, timed: bool) -> None:
        """Measure the model at the inputs cut to ``value`` along ``names`` (``timed`` False: its memory alone) and
        add the sample to ``samples``; a length the model or its symbolic capture cannot take is skipped (logged).
        With block options built once they pay (``defer_block_options``), a sample measures their node times
        none while none is built, and, while those built were built only because the cache had them
        (``_blocks_pay`` False), only where this cache has their menus at its sizes: a run whose cache an earlier
        one filled (which never built menus at the lengths it sampled) traced and profiled the blocks at two
        lengths for nothing but fits, where the shapes fitted re-cost block options only once they pay. Once they
        were built because they pay or the budget needs them, a sample builds them (the shapes fitted then
        re-cost them from node times fitted, not each profiled)."""
        name = "=".join(names)
        started = time.perf_counter()
        narrowed = self._narrowed(symbolic, args, kwargs, names, value)
        sources: list[str] = []
        try:
            with recorded_sources() as sources:
                sample = _sample_at(self.model, *narrowed, self.settings, symbolic, timed=timed,
                                    blocks=timed and not self._deferring(self.settings) and not profiler_active(),
                                    cached_blocks=self.settings.defer_block_options and not self._blocks_pay,
                                    ) if narrowed else None
        except Exception as err:  # noqa: BLE001 - a length the model rejects: not a sample, nothing else
            log.info("%s not measured at %s=%d (%s: %s)", type(self.model).__name__, name, value,
                     type(err).__name__, str(err).splitlines()[0][:200] if str(err) else "")
            return
        finally:
            forget_sources(sources)
            clear_fake_tensor_cache()
        if sample is None:
            log.info("%s not measured at %s=%d (its symbolic capture does not take it)", type(self.model).__name__,
                     name, value)
            return
        add_sample(samples, sample)
        log.info("%s measured at %s=%d in %.2f s (%s), to fit shapes from", type(self.model).__name__, name, value,
                 time.perf_counter() - started, "times and memory" if timed else "memory alone")

    def _narrowed(self, symbolic: SymbolicCapture, args: tuple, kwargs: dict, names: tuple[str, ...],
                  value: int) -> tuple[tuple, dict] | None:
        """The inputs cut to ``value`` along the sizes ``names``: each row's first entries, or its last
        where only those keep which padding masks are all ones as the call has them (right-padded rows cut
        to a prefix lose their padding, and a model may run a mask of all ones otherwise)."""
        wanted = padding_key(self.model, args, kwargs)
        cut = symbolic.narrowed(args, kwargs, names, value)
        if cut is not None and padding_key(self.model, *cut) != wanted:
            suffix = symbolic.narrowed(args, kwargs, names, value, last=True)
            if suffix is not None and padding_key(self.model, *suffix) == wanted:
                return suffix
        return cut

    def _drop_plans(self, keep_lent: bool = False) -> None:
        """Forget every plan (``keep_lent``: but those made on meta, not yet bound to the model's tensors)."""
        for key, compiled in list(self._compiled.items()):
            if not (keep_lent and compiled.lent):
                forget_sources(compiled.sources)
                del self._compiled[key]

    def _symbolic_capture(self, args: tuple, kwargs: dict) -> SymbolicCapture | None:
        """The symbolic capture for calls like this one (hierremat.graphs.symbolic), made when a second
        shape of them comes (a model called at one shape never pays for it), with the sizes that differ between
        the shapes seen symbolic (graphs.symbolic.varying_dims); at the first shape already where its inputs say
        sizes vary (_dims_said_to_vary: marked dynamic, a padded attention mask, ``dynamic=True``), those symbolic;
        None before that (or while no size differs: a shape planned again), with ``dynamic=False``, or where the
        model has none. A later call that varies another size has the model exported again with that one symbolic
        too, kept where it takes every shape the one before took (its samples rebound to it), else the one before
        stays and this shape is exported on its own; dimensions whose capture failed are not tried again (where
        the first shape's failed, the second tries the sizes that differ where those are others)."""
        if is_sharded(self.model) or self.dynamic is False:  # (FSDP2 shards: export cannot run them)
            return None
        family = _family_key(args, kwargs)
        earlier = self._symbolic.get(family)
        if family in self._symbolic and (earlier is None or earlier.bindings(args, kwargs) is not None):
            return earlier
        shapes = [c.skeleton for c in self._compiled.values() if c.family == family]
        if not shapes and family not in self._symbolic:  # the family's first shape: symbolic at once where sizes
            # are said to vary (and shapes planned; not again where its plans were all dropped since)
            return self._first_shape_capture(family, args, kwargs) if self.on_new_shape == "replan" else None
        dims = varying_dims([*shapes, (args, kwargs)]) | self._symbolic_dims.get(family, frozenset())
        if dims and self._first_capture_failed.get(family) == dims:  # (failed at the first shape with these)
            self._symbolic[family], self._symbolic_dims[family] = None, dims
            return None
        if not dims or (earlier is not None and dims <= self._symbolic_dims[family]):
            # (no size varies yet: another padding state of a shape seen; or the capture does not hold here for
            # another reason, or failed with these dimensions before: this shape is exported on its own)
            return earlier
        started = time.perf_counter()
        symbolic = capture_symbolic(self.model, args, kwargs, dims)
        self._symbolic_dims[family] = dims
        samples = self._samples.setdefault(family, [])
        if earlier is not None:  # it replaces the one before only where it takes every shape that one took
            took = [skeleton for skeleton in shapes if earlier.bindings(*skeleton) is not None]
            rebound = [symbolic.rebound(dict(s.bindings), earlier) for s in samples] if symbolic is not None else []
            if symbolic is None or not all(rebound) or any(symbolic.bindings(*skeleton) is None for skeleton in took):
                log.info("%s's new input shape varies another size, and a capture with it symbolic does not take "
                         "the shapes before: this shape is exported on its own", type(self.model).__name__)
                return earlier
            samples[:] = [s.bound(bindings) for s, bindings in zip(samples, rebound)]
            steps = self._step_samples.get(family, [])  # (the shapes timed in the steps, rebound where they can be)
            steps[:] = [s.bound(b) for s in steps for b in [symbolic.rebound(dict(s.bindings), earlier)] if b]
        self._symbolic[family] = symbolic
        for c in self._compiled.values():  # the shapes measured before: samples to fit later shapes' times from
            bindings = symbolic.bindings(*c.skeleton) if symbolic is not None and c.family == family else None
            if c.sample is not None and bindings:
                add_sample(samples, c.sample.bound(bindings))
        if symbolic is not None:
            log.info("%s has a new input shape: captured %s with symbolic sizes (%d dimensions: those that differ "
                     "between its shapes) in %.2f s; every later shape is specialized from it",
                     type(self.model).__name__, "again" if earlier is not None else "once",
                     len(symbolic.symbolic_dims), time.perf_counter() - started)
        return symbolic

    def _first_shape_capture(self, family: tuple, args: tuple, kwargs: dict) -> SymbolicCapture | None:
        """The symbolic capture at a family's first shape, with the sizes said to vary symbolic
        (_dims_said_to_vary), or None where none is or the capture fails (logged; the second shape then captures
        with the sizes that differ, as where none is said to vary)."""
        if family in self._first_capture_failed:  # (not tried again where its plans were all dropped since)
            return None
        dims, why = self._dims_said_to_vary(args, kwargs)
        if not dims:
            return None
        started = time.perf_counter()
        symbolic = capture_symbolic(self.model, args, kwargs, dims)
        if symbolic is None:
            self._first_capture_failed[family] = dims
            log.info("%s's %s, and no capture with them symbolic holds: captured at this shape, symbolically at the "
                     "second", type(self.model).__name__, why)
            return None
        self._symbolic[family] = symbolic
        self._symbolic_dims[family] = dims
        log.info("%s's %s: captured once with %d sizes symbolic in %.2f s, every shape specialized from it",
                 type(self.model).__name__, why, len(symbolic.symbolic_dims), time.perf_counter() - started)
        return symbolic

    def _dims_said_to_vary(self, args: tuple, kwargs: dict) -> tuple[frozenset, str]:
        """The input dimensions a first shape is captured with symbolic, and why: every one with ``dynamic=True``
        (graphs.symbolic.every_dim); else those its inputs mark dynamic (marked_dims: ``torch._dynamo.mark_dynamic``)
        and the length of a padded ``attention_mask`` (padded_dims: a batch padded to its longest row says the
        lengths will vary)."""
        if self.dynamic:
            return every_dim(args, kwargs), "sizes are all dynamic (dynamic=True)"
        marked, padded = marked_dims(args, kwargs), padded_dims(self.model, args, kwargs)
        why = " and ".join(text for dims, text in ((marked, "inputs mark sizes dynamic"),
                                                   (padded, "attention_mask pads its rows (lengths will vary)")) if dims)
        return marked | padded, why

    def forward(self, *args, **kwargs):
        orchestrator, kwargs = self._orchestrator(args, kwargs)
        return orchestrator(*args, **kwargs)

    @torch.compiler.disable(reason="hierremat plans (captures, profiles, solves) eagerly")
    def _orchestrator(self, args: tuple, kwargs: dict) -> tuple[fx.GraphModule, dict]:
        """The captured model planned for these inputs and autocast setting (planned now if new),
        and the keyword arguments to call it with (hierremat.graphs.hf.call_kwargs).

        Outside what ``torch.compile`` traces: planning runs eagerly, and the returned
        orchestrator is traced (and guarded on) by Dynamo like any module it is handed."""
        kwargs = call_kwargs(self.model, kwargs)
        key = _input_key(self.model, args, kwargs, self._per_padding)
        compiled = self._compiled.get(key)
        if compiled is not None:
            self._compiled.move_to_end(key)
        sharded = is_sharded(self.model)
        if not sharded:  # (FSDP2 runs option 0 of every stage: nothing to re-cost)
            self._learn_backward_recipe()
            if compiled is not None:
                compiled = self._refreshed(key, compiled, args, kwargs)
        variant = compiled is None and any(k[:1] + k[3:] == key[:1] + key[3:] for k in self._compiled)
        refuses = compiled is None and not variant and self.on_new_shape == "error"
        # under FSDP2, whether any rank plans in this call (every rank then agrees on one schedule) and whether any
        # refuses to (every rank then raises: ranks whose plans differ, as their padding states may, would otherwise
        # leave one raising while the others wait in a collective); the key compared across ranks is this one without
        # its padding state (_input_key's third part)
        others_plan, others_refuse = _ranks_plan(key[:2] + key[3:], compiled is None, refuses) if sharded else \
            (False, refuses)
        if others_refuse:
            raise ValueError(
                "inputs differ (shape, dtype, device or non-tensor values) from the planned ones"
                + ("" if refuses else " on another rank")
                + "; call hierremat.remat(..., on_new_shape='replan') to plan per shape"
            )
        if compiled is None or not compiled.sharded or others_plan:  # has fully_shard been applied since the plan?
            if is_fsdp_module(self):
                raise UnsupportedModelError(
                    "fully_shard was applied to the module hierremat.remat returned: apply it to the model passed to "
                    "remat (each block, then the model itself)"
                )
            if compiled is not None and sharded:
                compiled.shard(self.model, self.budget_bytes)
        if compiled is None:
            if variant:  # all but autocast and padding
                log.info(
                    "%s called under autocast %r%s for the first time: planning for it",
                    type(self.model).__name__, AutocastState.capture(_device_types(args, kwargs)).describe(),
                    f" with padding masks all ones {dict(key[2])}" if self._per_padding else "",
                )
            compiled = self._add_sharded(args, kwargs) if sharded else self._add(args, kwargs)
        if compiled.lent:  # planned on meta: the model's own weights from now on
            compiled.bind_to(self.model)
        return compiled.chain.orchestrator, kwargs

    def _apply(self, fn, recurse=True):
        # captured graphs hold the old tensors: re-plan after .to()/.cuda(), but for plans made on meta
        # (to_empty materializes the model they were made for: they bind to its tensors when next called)
        self._drop_plans(keep_lent=True)
        self._symbolic.clear()
        self._symbolic_dims.clear()
        self._first_capture_failed.clear()
        self._samples.clear()
        self._step_samples.clear()
        self._recost_seconds, self._blocks_built, self._lost_without_blocks = None, False, 0.0  # (another device's)
        self._blocks_pay = False
        return super()._apply(fn, recurse)


class _PresentedForward:
    """A RematModule's forward with the wrapped model's signature (``__signature__``, which
    ``inspect.signature`` reads): Trainer keeps the dataset columns it names. Copied with its
    module (``copy.deepcopy`` binds the copy to the module's copy)."""

    def __init__(self, module: "RematModule", signature: inspect.Signature):
        self.module = module
        self.__signature__ = signature

    def __call__(self, *args, **kwargs):
        return type(self.module).forward(self.module, *args, **kwargs)


def _without_model_prefix(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """RematModule's state_dict keys are the model's: ``model.`` taken off (a state-dict post-hook).

    A tensor stored under two names (a tied embedding and LM head) is there under both, the second
    as a copy: Trainer writes a model that is not a PreTrainedModel with safetensors' ``save_file``,
    which refuses tensors that share memory (loading writes both names into the one parameter)."""
    inner = prefix + "model."
    seen: set[tuple] = set()
    for key in [k for k in state_dict if k.startswith(inner)]:
        value = state_dict.pop(key)
        if isinstance(value, torch.Tensor) and value.numel():
            where = (value.device, value.untyped_storage().data_ptr())
            value = value.detach().clone() if where in seen else value
            seen.add(where)
        state_dict[prefix + key[len(inner):]] = value


def _with_model_prefix(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """Load the model's keys (or, as saved before, ``model.``-prefixed ones) into RematModule."""
    inner = prefix + "model."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


def plan(
    model: nn.Module,
    example_args,
    example_kwargs: dict | None = None,
    *,
    budget,
    slots: int = DEFAULT_SLOTS,
    strategy: str = "optimal",
    output_held: bool | None = None,
    block_options: str = "ilp",
    cache: bool | str = True,
    segmentation: str = "blocks",
    variants: bool = True,
    compile: bool | str = "auto",
    outputs: str | tuple[str, ...] | None = None,
    time_limit: float | None = PLAN_TIME_LIMIT,
    device: str | torch.device | None = None,
    offload: bool | str = False,
    offload_limit: int | str | None = None,
    backward_autocast: bool | None = None,
) -> ModelPlan:
    """Capture, segment, profile and solve ``model`` on example inputs under ``budget``.

    strategy: 'optimal' (default), or a baseline on the same chain and runtime: 'none'
    (no checkpointing) or 'segments=K' (torch's uniform checkpoint_sequential segments).
    block_options: 'ilp' (default): every distinct block also offers the optimal options
    of its per-block ILP (hierremat.planning.menus); 'autograd': only what autograd keeps
    (Rotor on blocks, a baseline).
    cache: where solved block options are cached: True (``$HIERREMAT_CACHE_DIR`` or
    ``~/.cache/hierremat``), a directory, or False (no cache).
    segmentation: 'blocks' (default): one stage per repeated block (decoder layer, ResNet
    block), each distinct block solved once; 'none': everything before the output stage
    solved as ONE block by one ILP (Checkmate on the full graph): the optimality reference
    for small models, and a baseline. Its ILP grows with the model: small models only.
    variants: whether operators may run as hierremat's memory-lean variants
    (hierremat.graphs.variants): a cross-entropy whose backward works on blocks of rows, dropout
    masks packed to bits (so a dropout's output can be recomputed from its input).
    Each computes bitwise what the operator computes; False runs the model's own operators.
    output_held: whether the caller keeps the model's outputs alive through the backward
    (``out = model(...); out.loss.backward()``) or not (``model(...).loss.backward()``).
    None (default): assume held unless only a plan assuming release fits; the module
    checks on every backward and re-plans if the caller does otherwise. Of several
    outputs, only scalar losses are expected to receive gradients (also checked).
    compile: whether block options run compiled by Inductor (hierremat.planning.compiled): True,
    False, or "auto" (default: True on CUDA, False on CPU). Compiled options are chosen with
    costs measured on their compiled form; the options the plan uses are compiled while
    planning (cached on disk by Inductor under ``cache``), and ``summary()`` shows the time
    that took. Gradients then agree with eager ones to within the rounding of fused
    arithmetic, as with ``torch.compile``; dropout stays bitwise.
    outputs: None (default): the model's outputs, all of them, exactly as it returns them.
    The names of the outputs the caller uses (e.g. ``"loss"`` for a Hugging Face language
    model trained with ``model(...).loss.backward()``): the other named outputs are returned
    as None and never computed for their own sake, so a language model's logits need not
    exist whole: its head may then run fused with the loss, chunk by chunk (an option the
    plan picks by budget; hierremat.planning.output_stage). A model that returns only its loss gets
    that option without ``outputs=``.
    time_limit: seconds planning may take (default 300; None: no bound). No block ILP solve
    and no compile runs past it: a block left without time gets the coarser heuristic menu
    (keep everything, recompute everything, keep what is costliest to recompute), as does a
    block whose ILP would be too large; the summary says which. Every solve also has a
    limit of its own; an option its limit stopped shows its MIP gap in the summary.
    device: where the model trains, for a model built without its weights (``torch.device("meta")``:
    parameters with shapes and no storage, or ``FakeTensorMode``; example inputs may be meta or fake too):
    it is captured without values and planned with real weights lent per distinct stage on ``device``
    (hierremat.runtime.lent_weights), so planning holds one block's weights, not the model's. The plan is
    then used once the model is materialized (``to_empty(device=...)`` and its initialization). None
    (default): where the model's parameters are (the device its fake tensors stand for); a model on meta
    needs it.
    offload: False (default); True: checkpointed activations may also be offloaded to a second tier, where
    that is faster than recomputing them (the chain DP chooses per value, with the tier's bandwidths measured
    on this machine; Beaumont, Eyraud-Dubois and Shilova, NeurIPS 2021): pinned host memory on CUDA, a
    temporary directory on CPU (the process's RAM is freed); or a directory to offload to (a disk tier, on
    either device). ``budget`` still counts the bytes on the device only. The summary says what is offloaded,
    the bytes moved per step and the predicted stall. offload_limit: the most the second tier holds at once
    (bytes or "8GiB"); default half of the available host memory, or of the directory's free space. A
    directory that cannot be written, or has less free space than the limit, raises OffloadError here.
    backward_autocast: under autocast, whether the training step runs its backward inside the autocast context
    (True: one context around forward and backward) or after it closed (False: torch's AMP recipe, Hugging
    Face's Trainer, accelerate). None (default): not known; a block whose backward autocast changes (on CPU,
    attention with dropout) then gets no block options (remat learns it at the first backward).
    """
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    settings = PlanSettings(
        slots, strategy, output_held, block_options, cache, segmentation, variants, compile, outputs, time_limit,
        None if device is None else str(device), offload, offload_limit, backward_autocast,
    )
    kwargs = call_kwargs(uncompiled(model), example_kwargs or {})
    return _compile(model, args, kwargs, parse_budget(budget), None, settings).plan


class BudgetExplorer:
    """What each memory budget costs a model, from one capture and one profile (see hierremat.explore).

    smallest_feasible_bytes: the smallest feasible budget InfeasibleBudgetError reports (a plan
    exists there; it sets aside the replay reserve of every stage, so the exact minimum may be
    up to that reserve lower); keep_all_bytes: the predicted peak of keeping everything
    (plain autograd's schedule). Plans at any budget
    are solved from the same measured costs, so their predicted times compare exactly; with ``offload=``
    given to explore, ``plan(budget, offload=False)`` is the plan without the second tier, from the same costs.
    """

    def __init__(self, profiled: _ProfiledChain, capture_seconds: float):
        self._profiled = profiled
        self._capture_seconds = capture_seconds
        self.keep_all_bytes = profiled.solve(2**62, strategy="none").predicted_peak_bytes + profiled.beside_chain_bytes
        self.smallest_feasible_bytes = self._smallest_feasible()
        self._without_offload: int | None = None

    def _smallest_feasible(self, offload: bool = True) -> int:
        budget = 1
        for _ in range(4):  # follow the reported minimum until a plan exists there
            try:
                self._profiled.solve(budget, offload=offload)
                return budget
            except InfeasibleBudgetError as err:
                if err.min_budget_bytes <= budget:
                    raise
                budget = err.min_budget_bytes
        raise AssertionError(f"no plan at the smallest feasible budget reported ({budget} B)")

    def smallest_feasible(self, offload: bool = True) -> int:
        """The smallest feasible budget (as smallest_feasible_bytes), with the second tier or, ``offload``
        False, without it."""
        if _check_offload_flag(offload):
            return self.smallest_feasible_bytes
        if self._without_offload is None:
            self._without_offload = self._smallest_feasible(offload=False)
        return self._without_offload

    def plan(self, budget, offload: bool = True) -> ModelPlan:
        """The plan within ``budget`` (bytes or "512MiB"); InfeasibleBudgetError below the smallest feasible one.
        offload: False plans without the second tier explore was given (the same costs: to compare)."""
        budget_bytes = parse_budget(budget)
        solved = self._profiled.solve(budget_bytes, offload=_check_offload_flag(offload))
        return self._profiled.model_plan(solved, self._capture_seconds)

    def menu(self, points: int = 6) -> tuple[ModelPlan, ...]:
        """Plans at ``points`` budgets spaced evenly from the smallest feasible one to keeping everything."""
        if points < 2:
            raise ValueError(f"points must be at least 2, got {points}")
        low, high = self.smallest_feasible_bytes, max(self.keep_all_bytes, self.smallest_feasible_bytes)
        budgets = sorted({low + (high - low) * i // (points - 1) for i in range(points)})
        return tuple(self._profiled.model_plan(self._profiled.solve(b), self._capture_seconds) for b in budgets)


def _check_offload_flag(offload) -> bool:
    if not isinstance(offload, bool):
        raise TypeError(f"offload must be True (with the second tier explore was given) or False (without it), got "
                        f"{offload!r}: the tier itself is chosen by explore(..., offload=)")
    return offload


def explore(
    model: nn.Module,
    example_args,
    example_kwargs: dict | None = None,
    *,
    slots: int = DEFAULT_SLOTS,
    output_held: bool | None = None,
    block_options: str = "ilp",
    cache: bool | str = True,
    segmentation: str = "blocks",
    variants: bool = True,
    outputs: str | tuple[str, ...] | None = None,
    time_limit: float | None = PLAN_TIME_LIMIT,
    offload: bool | str = False,
    offload_limit: int | str | None = None,
    backward_autocast: bool | None = None,
) -> BudgetExplorer:
    """Capture, profile and build the block menus of ``model`` once, to see what budgets cost.

    ``explore(model, args).menu()`` gives plans from the smallest feasible budget to keeping
    everything (``python -m hierremat`` prints them); ``.plan(budget)`` one plan, which
    ``remat(model, ..., plan=...)`` runs. Options as for hierremat.plan (block options run
    eagerly here: compiled forms are priced only when compiled, see ``compile=``; offload, offload_limit and
    backward_autocast as for hierremat.plan).
    """
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    settings = PlanSettings(
        slots, "optimal", output_held, block_options, cache, segmentation, variants, False, outputs, time_limit,
        offload=offload, offload_limit=offload_limit, backward_autocast=backward_autocast,
    )
    model = uncompiled(model)
    kwargs = call_kwargs(model, example_kwargs or {})
    started = time.perf_counter()
    check_devices(_device_types(args, kwargs), "the example inputs")
    autocast = AutocastState.capture(_device_types(args, kwargs))
    chain, x0, shared, capture_seconds, _ = _captured_chain(model, args, kwargs, settings, autocast, started)
    return BudgetExplorer(_ProfiledChain.of(chain, x0, shared, settings, settings.deadline(started)), capture_seconds)


def remat(
    model: nn.Module,
    example_args,
    example_kwargs: dict | None = None,
    *,
    budget=None,
    plan: ModelPlan | None = None,
    slots: int = DEFAULT_SLOTS,
    on_new_shape: str = "replan",
    strategy: str = "optimal",
    output_held: bool | None = None,
    block_options: str = "ilp",
    cache: bool | str = True,
    segmentation: str | None = None,
    variants: bool | None = None,
    compile: bool | str | None = None,
    outputs: str | tuple[str, ...] | None = None,
    time_limit: float | None = PLAN_TIME_LIMIT,
    max_shapes: int = DEFAULT_MAX_SHAPES,
    device: str | torch.device | None = None,
    offload: bool | str | None = None,
    offload_limit: int | str | None = None,
    backward_autocast: bool | None = None,
    defer_block_options: bool = True,
    dynamic: bool | None = None,
) -> RematModule:
    """Return a module called like ``model`` whose training step fits ``budget`` (or ``plan``'s).

    strategy, output_held, block_options, cache, segmentation, variants, compile, outputs,
    time_limit (each plan's, re-plans for new shapes included): as for hierremat.plan (segmentation, variants, compile and outputs default to ``plan``'s,
    else 'blocks', True, "auto" and None).
    on_new_shape: "replan" (default): a call whose inputs have a new shape is planned for it. From
    the second shape on, the model is captured once with symbolic sizes and each new shape's graph
    is specialized from that capture (no trace; hierremat.graphs.symbolic), and the block menus
    solved for another shape are re-costed at the new sizes (no ILP solve); "error": raise.
    max_shapes: how many shapes' plans are kept (least recently used dropped first; a dropped
    shape is planned again when it comes back).
    device: as for hierremat.plan. A module planned on meta computes with the model's own weights from
    its first call after ``to_empty`` and initialization (a call before raises).
    offload, offload_limit: as for hierremat.plan; offload defaults to True where ``plan`` offloads, else False.
    backward_autocast: as for hierremat.plan; None (default): seen at the first backward, a shape planned before
    then is planned again at its next call where that gives blocks options.
    dynamic: which input sizes are captured symbolic at the first shape, as torch.compile's ``dynamic``. None
    (default): those the example inputs mark dynamic (``torch._dynamo.mark_dynamic``, as for torch.compile), and
    the length where a 2-D ``attention_mask`` pads a row (a batch padded to its longest row: the lengths will vary);
    with none, the sizes that differ are made symbolic at the second shape (a model called at one shape never pays
    for the symbolic capture). Captured at the first shape, that shape also measures three shorter lengths' memory,
    so that every later length is planned from fits alone (a 4-layer GPT-2 on 2 CPU cores: 0.04-0.58 s a new
    length, against 2.8-4.8 s at the second length captured then; the first shape pays 2-6 s more). True: every
    size symbolic at the first shape (those the model lets vary). False: no symbolic capture; each shape is
    captured and measured on its own.
    defer_block_options: True (default): block options are built once they pay (rent or buy). A shape is first
    planned without them, where they could save less per step than building them costs: at the first shape, with
    none built yet, what capturing and profiling it took (building them traces, profiles and runs each distinct
    block again and solves its ILP); at a later shape whose times are fitted, what re-costing them took last. They
    are built once the steps run without them have lost that much (they could save at most the recomputation of
    the plan without them), and at once where they could save more, where the budget needs them, or where this
    cache built them for the shape before. So a short run never pays for what cannot pay back, and a long one
    loses at most what building them costs. False: built at once at a shape measured in full (as hierremat.plan
    does); a shape whose times are fitted re-costs them (no ILP solve) only where that pays, either way.
    """
    if budget is None and plan is None:
        raise TypeError("remat needs budget= (bytes or '3GiB') or plan= (from hierremat.plan)")
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    budget_bytes = parse_budget(budget) if budget is not None else plan.budget_bytes
    if segmentation is None:
        segmentation = plan.segmentation if plan is not None else "blocks"
    if variants is None:
        variants = plan.variants if plan is not None else True
    if compile is None:
        compile = plan.compiled if plan is not None else "auto"
    if outputs is None and plan is not None:
        outputs = plan.outputs
    if offload is None:
        offload = plan is not None and plan.chain.offloads
    settings = PlanSettings(
        slots, strategy, output_held, block_options, cache, segmentation, variants, compile, outputs, time_limit,
        None if device is None else str(device), offload, offload_limit, backward_autocast, defer_block_options,
    )
    module = RematModule(model, budget_bytes, on_new_shape, settings, max_shapes, dynamic)
    module._add(args, example_kwargs or {}, plan)
    return module
