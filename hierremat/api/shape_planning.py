"""Planning one input shape of a whole model: capture (or specialize the symbolic capture), cut into a chain,
profile each distinct stage, build block-option menus where they pay, solve the chain DP, compile.

``PlanSettings`` is how a model is planned (hierremat.plan's arguments); ``ProfiledChain`` a captured chain with
its profile and menus; ``profile_and_solve`` decides whether block options are built at this shape;
``plan_shape`` makes a shape's PlannedShape (hierremat.api.planned_shape); ``sample_at`` measures a shape
only to fit others from (hierremat.planning.shape_fit). hierremat.api.whole_model's RematModule calls these per
shape; hierremat.api.explore for hr.plan and hr.explore.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils import _pytree as pytree

from ..blocks.capture import capture, check_outputs, uncompiled
from ..blocks.fake_weights import weights_faked_on
from ..blocks.symbolic import SymbolicCapture
from ..blocks.segment import CHAIN_ATTRIBUTE, ChainGraph, build_chain_graph, check_segmentation
from ..budget import format_bytes
from ..dp.solve import DEFAULT_SLOTS
from ..errors import InfeasibleBudgetError, UnsupportedModelError
from ..plans import clock
from ..plans.model_plan import ModelPlan
from ..plans.sequential_plan import SequentialPlan
from ..device import is_abstract
from ..device.autocast import AutocastState
from ..runtime.fsdp import is_sharded
from ..runtime.offload import Offloading, check_offload, second_tier
from ..runtime.lent_weights import bind_to_model, has_abstract_weights, lent_inputs, lent_weights
from ..runtime.profile import PROFILE_REPEATS, SLOW_STAGE_SECONDS, ChainProfile, profile_chain, storage_bytes
from ..runtime.stage_cost_cache import StageCostCache
from ..runtime.step_grads import StepGrads
from ..store.cache import OptionsCache, default_cache
from ..planning.chain_plan import (
    PLAN_TIME_LIMIT, PlannedChain, check_block_options, computes_in_low_precision, least_held_bytes, plan_from_profile,
    resolve_compile,
)
from .sequential import SUPPORTED_DEVICES, check_devices, check_slots, check_time_limit
from ..planning.compiled import compile_forwards, compile_options, offer_compiled, options_used, plan_compiled
from ..planning.family_programs import FamilyPrograms
from ..planning.chain_menus import NOISE_MARGIN, PlanMenu, StageMenu
from ..planning.menu_store import cost_model_version
from ..planning.menus import build_menus
from ..planning.stage_calls import stage_arguments
from ..planning.shape_fit import ShapeFit, ShapeSample, chain_pattern
from .planned_shape import ONE_RUN_NOTE, ChainModule, PlannedShape, chain_inputs, copies_note

log = logging.getLogger(__name__)


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
    #: None: not known (RematModule learns it at the first backward: hierremat.planning.autocast_exactness.exact_under_autocast)
    backward_autocast: bool | None = None
    #: whether a shape may run without block options until building them pays (rent or buy: profile_and_solve);
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
        return clock.deadline_after(self.time_limit, started)

    def inductor_cache(self) -> Path | None:
        """Where compiled block options are cached (Inductor's caches): under the options cache."""
        cache = self.options_cache()
        return cache.directory / "inductor" if cache.enabled else None


def lending_device(model: nn.Module, args: tuple, kwargs: dict, device: str | None) -> torch.device | None:
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


def captured_chain(model: nn.Module, args: tuple, kwargs: dict, settings: PlanSettings, autocast: AutocastState,
                   started: float, symbolic: SymbolicCapture | None = None, lent_to: torch.device | None = None,
                   export: bool = True):
    """(the model captured and cut into a chain, its first stage's input, the shared values, capture seconds,
    whether the capture was specialized from ``symbolic``). lent_to: a model without weights is captured as on
    this device (hierremat.blocks.fake_weights), its chain inputs computed there with lent weights. export:
    where ``symbolic`` does not hold at these inputs, export them (else ValueError: hierremat.blocks.capture)."""
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
class ProfiledChain:
    """A captured chain with its measured costs and block menus: what plans at any budget are solved from."""

    chain: ChainGraph
    x0: torch.Tensor
    shared: tuple
    settings: PlanSettings
    profile: ChainProfile
    profile_seconds: float
    menus: object  # hierremat.planning.chain_menus.ChainMenus, or None

    fitted: ShapeFit | None = None
    #: a model planned on meta: the gradients its step allocates are its own parameters' (the lent copies
    #: are shared by identical stages), read from it by name
    weights_of: nn.Module | None = None
    #: planned without block options at a fitted shape, where they could not pay (profile_and_solve)
    blocks_not_recosted: bool = False
    #: there, the seconds per step they could still save (0: within the timing noise): RematModule re-costs them
    #: once the steps run without them have lost what re-costing takes
    block_gain: float = 0.0
    #: the stages' arguments (hierremat.planning.stage_calls.stage_arguments) the fused-head-only menus were built from,
    #: kept for with_block_menus to build the blocks' from (None once they are built)
    arguments: tuple | None = None
    #: the caller's fp32 copies of the outputs (ModelPlan.output_copies_bytes), held beside the chain
    output_copies_bytes: int = 0
    #: planned without block options at a measured shape (none built yet: profile_and_solve), what building them
    #: is taken to cost (seconds): what capturing and profiling the shape took
    build_estimate: float | None = None
    #: block options built at a measured shape, none built before, only because the cache had them there (a lookup;
    #: nothing said they pay: profile_and_solve)
    menus_from_cache: bool = False
    #: a measured shape's times are those of one timed run each, not the medians of PROFILE_REPEATS (``of``'s
    #: ``one_run``)
    one_run: bool = False
    #: at a fitted shape of a family timed in its training steps: how much slower the steps run option 0 than the
    #: profile did (ShapeFit.step_ratios: no-grad forward, forward, backward). ``profile`` then holds option 0's
    #: times fitted from the steps divided by them (as the profile would have timed it), so that block options,
    #: priced from node times profiled apart, compare with option 0 as they were measured; :meth:`in_steps` scales
    #: the whole chain back to the steps
    step_ratios: tuple[float, float, float] | None = None
    #: the stages' family's joint graphs and programs for every shape (hierremat.planning.family_programs), where
    #: they run a size-generic chain: what build_menus costs and runs their block options with
    programs: FamilyPrograms | None = None

    @classmethod
    def of(
        cls, chain: ChainGraph, x0: torch.Tensor, shared: tuple, settings: PlanSettings, deadline: float | None,
        fitted: ShapeFit | None = None, weights_of: nn.Module | None = None, blocks: bool = True, timed: bool = True,
        one_run: bool = False, menus: bool = True, programs: FamilyPrograms | None = None,
    ) -> "ProfiledChain":
        """deadline: when profiling and building the block menus must be done (hierremat.plans.clock): the
        stages measured after it are timed from one run, the blocks' node costs modelled (ModelPlan.time_limit_cuts).
        fitted: this shape's costs fitted from shapes measured before (hierremat.planning.shape_fit):
        its times, and its memory where the fit is exact (else measured). weights_of: see the field.
        blocks: False leaves the stages without block menus (the output's fused head only: with_block_menus
        adds them). timed: False measures memory alone, in single runs (their times kept: a sample for memory
        fits), and builds no menu, not even the fused head's. one_run: a shape measured (not fitted) is timed from one
        run of each of its stages' no-grad forward, forward and backward after the memory runs, not the medians of
        PROFILE_REPEATS (two thirds of the timed runs, a third of a 4-layer GPT-2's profile, saved): where its
        training steps time it (StepRetimer.times_from_steps), which solve its plan again from theirs. (The memory
        runs' own times are no estimate: the allocator meter's recording made them up to 50% slower.) menus: False
        builds no menu, not even the fused head's (a shape measured to fit others from: sample_at's ``one_run``)."""
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
                known=known, measure=measure, deadline=deadline,
            )
        ratios = None
        if fitted is not None:
            costs, ratios = fitted.stage_costs(profile.costs), fitted.step_ratios
            if ratios is not None:  # (option 0 fitted from the steps: as the profile would have timed it)
                costs = costs.with_times_scaled(tuple(1 / r for r in ratios))
            profile = replace(profile, costs=costs)
        profile_seconds = time.perf_counter() - started
        profiled = cls(chain, x0, shared, settings, profile, profile_seconds, None, fitted, weights_of,
                       one_run=one_run and fitted is None and profile.repeats < PROFILE_REPEATS,
                       step_ratios=ratios, programs=programs)
        return profiled.with_block_menus(deadline, blocks) if timed and menus else profiled  # (a sample: no menu used)

    def with_block_menus(self, deadline: float | None, blocks: bool = True) -> "ProfiledChain":
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
            backward_autocast=self.settings.backward_autocast, arguments=arguments, programs=self.programs,
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
        """The measured profile with the block menus' options (the profile alone without menus), as the training
        steps run them where they time the shapes (:meth:`in_steps`)."""
        return self.in_steps(self.menus.extend(self.profile) if self.menus is not None else self.profile)

    def in_steps(self, profile: ChainProfile) -> ChainProfile:
        """``profile`` (``self.profile``, its menus' options added) with every time of each stage scaled as the
        training steps run it (``step_ratios``: option 0's times then as fitted from the steps, ChainCosts.
        with_times_scaled), where they are set; else ``profile``."""
        if self.step_ratios is None:
            return profile
        return replace(profile, costs=profile.costs.with_times_scaled(self.step_ratios))

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

    def node_sample(self) -> ShapeSample | None:
        """The node times and speeds of the block options measured at this shape (bindings unset), where any were:
        ShapeSample.nodes_of."""
        return ShapeSample.nodes_of(self.profile, self.menus, [info.signature for info in self.chain.infos])

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
        ``profile`` (default: the measured one, with the block menus' options; in ``self.profile``'s times either
        way, scaled to the training steps' here: :meth:`in_steps`), offloading where the settings say so
        (``offload`` False: never). output_released: the outputs that got a gradient where the caller
        released the output at another shape (PlannedShape.released_output): with the same outputs here and no
        ``output_held`` setting, planned with it released from the start (else the first backward would find
        it released, and the next call re-plan). Raises InfeasibleBudgetError with the model's smallest feasible
        budget."""
        profile = self.in_steps(profile) if profile is not None else self.options_profile
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
            menus={sig: PlanMenu(m) for sig, m in menus.menus.items()} if menus else {},
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
            time_limit_cuts=self._time_limit_cuts(),
        )

    def _time_limit_cuts(self) -> tuple[str, ...]:
        """What this chain's profile and menus left out because the planning deadline had passed."""
        cuts, menus = [], self.menus
        if self.profile.timed_once:
            cuts.append(f"{self.profile.timed_once} stage(s) timed from one run, not {PROFILE_REPEATS}")
        if menus is not None and menus.modelled:
            cuts.append(f"node costs of {', '.join(menus.modelled)} modelled from FLOPs and bytes, not measured")
        if menus is not None and menus.timed_once:
            cuts.append(f"generated code of {', '.join(menus.timed_once)} timed from one run")
        return tuple(cuts)


def profile_and_solve(
    chain: ChainGraph, x0: torch.Tensor, shared: tuple, settings: PlanSettings, started: float,
    fitted: ShapeFit | None, budget_bytes: int, weights_of: nn.Module | None = None,
    output_released: tuple[bool, ...] | None = None, recost_seconds: float | None = None, output_copies_bytes: int = 0,
    defer: bool = False, one_run: bool = False, profiling: bool = False, programs: FamilyPrograms | None = None,
) -> tuple[ProfiledChain, SequentialPlan, bool]:
    """Profile the chain, build its block menus (compiled forms too where ``settings.compile``) and solve
    its plan within ``budget_bytes``: (the profiled chain, the plan, whether its options run compiled).
    weights_of: the model, where it is planned on meta (ProfiledChain.weights_of). output_released: as
    ProfiledChain.solve takes it. output_copies_bytes: the caller's fp32 copies of the outputs, held beside the chain.

    At a shape whose times are fitted, the plan is first solved without block options (no stage traced). It
    stands where they could save no more than NOISE_MARGIN of its step (the timing noise), or less per step
    than re-costing them takes (``recost_seconds``, as measured at another shape; None: re-cost them): the
    rent-or-buy choice of a shape that may never come back (RematModule re-costs them once its steps have lost
    that much: ProfiledChain.block_gain).

    defer: at a measured shape, no block options built yet (RematModule: ``defer_block_options``), the plan is first
    solved without them too, and stands where they could save no more than the timing noise, or less per step than
    building them is taken to cost (``recost_seconds``, else what capturing and profiling this shape took: building
    a menu traces, profiles and runs each distinct stage again, and solves its ILP; ProfiledChain.build_estimate;
    profiled with ``one_run``, the timed runs skipped counted in: ProfiledChain.skipped_seconds).
    Where a stage's menu was built at this shape with this cache before (ProfiledChain.menus_cached), they are
    built at once (a lookup).

    profiling: the caller's torch.profiler session runs (RematModule): on CPU, where the budget does not need them,
    block options are neither built nor re-costed at this shape (that measures the CPU allocator with a session of
    its own, which would end the caller's: hierremat.device.memory.check_no_profiler); RematModule builds them at a
    step after the session, at its first where they were to be built now."""
    compiling = resolve_compile(settings.compile, x0.device, chain.stages, x0)
    profiling = profiling and x0.device.type == "cpu"
    lazy = (fitted is not None or defer or profiling) and settings.block_options == "ilp" \
        and settings.strategy == "optimal" and not compiling
    profiled = replace(ProfiledChain.of(chain, x0, shared, settings, settings.deadline(started), fitted, weights_of,
                                        blocks=not lazy, one_run=one_run, programs=None if compiling else programs),
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


@dataclass(frozen=True)
class ShapeRequest:
    """What RematModule knows about one input shape it asks plan_shape for, beside the model, inputs, budget and
    settings (each field's default: a shape planned on its own, as hierremat.plan plans one).

    symbolic: the family's symbolic capture (hierremat.blocks.symbolic); the shape is specialized from it where it
    holds. samples: times measured at other shapes of these inputs (hierremat.planning.shape_fit): where they span
    this shape, its times are fitted from them and only its memory is measured. shards: the model is sharded with
    FSDP2 and planned within hierremat.runtime.fsdp.without_weights. output_released: how the caller used the output
    at the inputs' other shapes (ProfiledChain.solve). recost_seconds: what re-costing block options at a fitted
    shape takes (s; profile_and_solve). upcasts: the caller copies the fp16/bf16 outputs to fp32
    (hierremat.blocks.hf.upcasts_outputs): the copies are planned for. defer: a measured shape may be planned without
    block options, none built yet. steps_time: the training steps time this shape (StepRetimer.times_from_steps): its
    times are fitted, where too few shapes are timed, from fewer than a fit's monomials too (ShapeFit.of's
    ``reduced``), and where it is measured, it is timed from one run each. profiling: the caller's torch.profiler
    session runs: block options are put off where the budget allows. programs_for: the joint graphs and programs of
    the size-generic chain a chain specialized from ``symbolic`` runs (hierremat.planning.family_programs; None where
    it runs none yet): its block options are costed and run on them."""

    symbolic: SymbolicCapture | None = None
    samples: tuple[ShapeSample, ...] = ()
    shards: bool = False
    output_released: tuple[bool, ...] | None = None
    recost_seconds: float | None = None
    upcasts: bool = False
    defer: bool = False
    steps_time: bool = False
    profiling: bool = False
    programs_for: Callable[[ChainGraph], FamilyPrograms | None] | None = None


def plan_shape(model: nn.Module, args: tuple, kwargs: dict, budget_bytes: int | None, plan: ModelPlan | None,
               settings: PlanSettings, request: ShapeRequest = ShapeRequest()) -> PlannedShape:
    """Capture (specialized from ``request.symbolic`` where it holds at these inputs), profile and plan within
    ``budget_bytes``, or run ``plan``, a saved plan; the shape's plan made runnable."""
    started = time.perf_counter()
    model = uncompiled(model)
    if is_sharded(model) and not request.shards:
        raise UnsupportedModelError(
            f"{type(model).__name__} is already sharded with fully_shard: hierremat plans the whole model first. Call "
            "hierremat.remat(model, ...) before fully_shard (as activation checkpointing is applied before it), then "
            "fully_shard each block and the model; the first call re-plans for the shards"
        )
    lent_to = lending_device(model, args, kwargs, settings.device)
    if lent_to is None:
        check_devices(device_types(args, kwargs), "the example inputs")
        autocast = AutocastState.capture(device_types(args, kwargs))
    else:
        if plan is not None:
            raise UnsupportedModelError("a saved plan runs on a materialized model: call remat(..., plan=) after "
                                        "to_empty and initialization, or plan the model on meta here")
        request = replace(request, symbolic=None)  # (each shape of a model without weights is exported on meta)
        autocast = AutocastState.capture((lent_to.type,))
    chain, x0, shared, capture_seconds, specialized = captured_chain(
        model, args, kwargs, settings, autocast, started, request.symbolic, lent_to
    )
    symbolic = request.symbolic
    bindings = symbolic.bindings(args, kwargs) if symbolic is not None else None
    if plan is None:
        fitted = (ShapeFit.of(request.samples, bindings, chain_pattern([info.signature for info in chain.infos]),
                              reduced=request.steps_time) if bindings and specialized else None)
        profiled, plan, sample = _profiled_plan(model, chain, x0, shared, settings, started, fitted, budget_bytes,
                                                request, lent_to, capture_seconds, specialized)
        menus = profiled.menus
    else:
        fitted = profiled = sample = None
        menus = _saved_plan_menus(plan, chain, x0, shared, settings, autocast)
    shape = _runnable(chain, plan, menus, settings, x0)
    shape.sample, shape.saved = sample, profiled is None
    shape.node_sample = profiled.node_sample() if fitted is not None else None  # (else in ``sample``)
    if lent_to is not None:  # other forms (the fused head) were made while weights were lent: give them back
        bind_to_model(shape.graphs(), model)
        shape.lent = True
    shape.bindings = bindings
    shape.reduced_fit = fitted is not None and fitted.reduced
    if profiled is not None:
        _take_profile(shape, profiled)
    shape.skeleton = pytree.tree_map(
        lambda v: torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v, (args, kwargs)
    )
    return shape


def _profiled_plan(model: nn.Module, chain: ChainGraph, x0: torch.Tensor, shared: tuple, settings: PlanSettings,
                   started: float, fitted: ShapeFit | None, budget_bytes: int | None, request: ShapeRequest,
                   lent_to: torch.device | None, capture_seconds: float,
                   specialized: bool) -> tuple[ProfiledChain, ModelPlan, ShapeSample | None]:
    """Profile the chain (its weights lent on ``lent_to`` where the model is on meta) and solve its plan: the
    profiled chain, the plan, and the shape's sample (where measured; its memory alone where fitted and measured in
    full, for memory fits)."""
    signatures = [info.signature for info in chain.infos]
    programs = (request.programs_for(chain) if request.programs_for is not None and specialized and lent_to is None
                else None)
    with lent_weights(chain.stages, signatures, lent_to) if lent_to is not None else contextlib.nullcontext(0) as lent:
        profiled, chain_plan, compiled = profile_and_solve(
            chain, x0, shared, settings, started, fitted, budget_bytes, model if lent_to is not None else None,
            request.output_released, request.recost_seconds,
            chain.half_outputs_in_fp32_bytes if request.upcasts else 0, request.defer,
            one_run=request.steps_time and fitted is None, profiling=request.profiling, programs=programs,
        )
    sample = None
    if fitted is None:
        sample = profiled.sample()
    elif fitted.unfitted_memory is None and profiled.profile.memory_trace is not None:
        sample = profiled.sample(times_measured=False)
    plan = replace(profiled.model_plan(chain_plan, capture_seconds, compiled, specialized), lent_weight_bytes=lent)
    log.info(
        "planned %s: %d stages, predicted peak %s, step %.1f ms", type(model).__name__, len(plan.stages),
        format_bytes(plan.predicted_peak_bytes), plan.predicted_step_time * 1e3,
    )
    if log.isEnabledFor(logging.DEBUG):  # (a summary replays the plan: not on every new shape unasked)
        log.debug("%s", plan.summary())
    return profiled, plan, sample


def _check_saved_plan(plan: ModelPlan, autocast: AutocastState, signatures: list) -> None:
    """Raise where a saved plan does not fit this model, inputs and autocast; warn where another cost model made it."""
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
            f"the cost model {plan.cost_model}" if plan.cost_model else "a hierremat that did not record its cost model",
            cost_model_version(),
        )


def _saved_plan_menus(plan: ModelPlan, chain: ChainGraph, x0: torch.Tensor, shared: tuple, settings: PlanSettings,
                      autocast: AutocastState):
    """The block menus a saved plan runs, rebuilt from the menus it stored (compiled where it ran them compiled),
    or None where it runs no block option; the plan checked against the chain first."""
    signatures = [info.signature for info in chain.infos]
    _check_saved_plan(plan, autocast, signatures)
    if not (plan.menus or options_used(plan.chain.schedule)):  # (a fused head alone is an option with no menu stored)
        return None
    stored = {sig: m.menu if isinstance(m, PlanMenu) else StageMenu.from_dict(m)  # (one made here: its menu)
              for sig, m in plan.menus.items()}
    menus = build_menus(
        chain.stages, x0, shared, signatures, stored=stored, variants=settings.variants, residents=chain.residents,
        backward_autocast=plan.backward_autocast,
    )
    if not plan.compiled:
        return menus
    if computes_in_low_precision(chain.stages, x0.device, x0):  # its costs are those of compiled options: run so
        log.warning(
            "the saved plan runs its block options compiled by Inductor, and the model computes in bf16 or "
            "fp16 here: their gradients then differ from plain autograd's by an ulp or more (Inductor keeps "
            "fp32 between the operations it fuses); plan again with compile='auto' or False for eager block "
            "options, whose gradients are plain autograd's"
        )
    offer_compiled(menus)
    compile_options(menus, options_used(plan.chain.schedule), chain.stages, x0, shared, settings.inductor_cache(),
                    measure=False)
    compiled_forwards = {i for i, st in enumerate(plan.chain.costs.stages) if st.nograd_form == "compiled"}
    if compiled_forwards:
        compile_forwards(menus, chain.stages, x0, shared, settings.inductor_cache(), wanted=compiled_forwards,
                         measure=False)
    return menus


def _runnable(chain: ChainGraph, plan: ModelPlan, menus, settings: PlanSettings, x0: torch.Tensor) -> PlannedShape:
    """``plan`` made runnable on ``chain``: its runner set as the orchestrator's chain."""
    signatures = [info.signature for info in chain.infos]
    planned = PlannedChain(
        chain.stages, plan.chain, slots=settings.slots, strategy=settings.strategy, signatures=signatures, menus=menus,
        residents=chain.residents, offloading=settings.offloading(x0.device),
    )
    chain_module = ChainModule(chain.stages, planned)
    setattr(chain.orchestrator, CHAIN_ATTRIBUTE, chain_module)
    return PlannedShape(chain, plan, chain_module)


def _take_profile(shape: PlannedShape, profiled: ProfiledChain) -> None:
    """The figures of its profile a shape planned here keeps, that RematModule decides from."""
    shape.one_run = profiled.one_run
    shape.least_held = least_held_bytes(profiled.profile)
    shape.block_gain = profiled.block_gain
    shape.build_estimate = profiled.build_estimate
    shape.menus_from_cache = profiled.menus_from_cache


def sample_at(model: nn.Module, args: tuple, kwargs: dict, settings: PlanSettings, symbolic: SymbolicCapture,
              blocks: bool = True, timed: bool = True, cached_blocks: bool = False,
              one_run: bool = False) -> ShapeSample | None:
    """The costs measured in full at these inputs (times and memory, no plan solved), captured from
    ``symbolic`` (never exported on their own), bound to their sizes; None where the capture does not take
    them, or ``timed`` is False (memory alone, in single runs: a sample for memory fits) or ``one_run`` and the meter
    recorded no memory trace. blocks: False measures no block menu (their node times and speeds: none was built yet);
    ``cached_blocks``: only where this cache has them at these sizes (ProfiledChain.menus_cached). one_run: its memory,
    and its times from one timed run of each stage after the memory runs, no menu built (a short length measured for
    a family whose times the training steps give: the fit's shape between the lengths they time,
    hierremat.planning.shape_fit)."""
    bindings = symbolic.bindings(args, kwargs)
    if bindings is None:
        return None
    started = time.perf_counter()
    autocast = AutocastState.capture(device_types(args, kwargs))
    chain, x0, shared, _, _ = captured_chain(model, args, kwargs, settings, autocast, started, symbolic, export=False)
    deadline = settings.deadline(started)
    timed = timed or one_run
    profiled = ProfiledChain.of(chain, x0, shared, settings, deadline, blocks=blocks and not cached_blocks,
                                timed=timed, one_run=one_run, menus=not one_run)
    if blocks and cached_blocks and profiled.arguments is not None and profiled.menus_cached():  # (no menus: None)
        profiled = profiled.with_block_menus(deadline)
    if (not timed or one_run) and profiled.profile.memory_trace is None:
        return None
    return replace(profiled.sample(times_measured=timed), cut=True).bound(bindings)


def device_types(args: tuple, kwargs: dict) -> tuple[str, ...]:
    leaves = pytree.tree_leaves((args, kwargs))
    return tuple(dict.fromkeys(v.device.type for v in leaves if isinstance(v, torch.Tensor)))
