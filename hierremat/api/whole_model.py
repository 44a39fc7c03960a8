"""``hierremat.remat``: a whole model under a memory budget, at every input shape it is called with.

``RematModule`` wraps the model: at each new input shape it plans (hierremat.api.shape_planning.plan_shape:
capture, or specialize the symbolic capture, cut into a chain, profile, menus, the chain DP) and keeps the plan
(hierremat.api.planned_shape), least recently used dropped beyond ``max_shapes``. Shapes of one family (the same
inputs, other sizes) share one symbolic capture (hierremat.blocks.symbolic), one set of size-generic graphs that
runs each of them where it is their program (hierremat.blocks.generic: such a shape's plan holds no graph of its own) and the samples their costs are
fitted from (hierremat.planning.shape_fit: shapes profiled, shapes measured only to fit from, and the times the
training steps record); it presents the model's forward signature, state_dict keys and attributes to training loops
(Trainer, accelerate).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
import weakref
from collections import OrderedDict
from dataclasses import replace
from typing import Sequence

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ..blocks.capture import uncompiled
from ..blocks.eager_masks import has_value_branch, padding_key
from ..blocks.hf import call_kwargs, upcasts_outputs
from ..blocks.generic import MAX_GENERIC_CHAINS, GenericChain
from ..blocks.segment import CHAIN_ATTRIBUTE
from ..blocks.sources import clear_fake_tensor_cache, forget_sources, recorded_sources, source_keys
from ..blocks.symbolic import SymbolicCapture, capture_symbolic, every_dim, marked_dims, padded_dims, varying_dims
from ..budget import parse_budget
from ..errors import UnsupportedModelError
from ..plans.model_plan import ModelPlan
from ..device.memory import profiler_active
from ..device.autocast import AutocastState
from ..runtime.fsdp import is_fsdp_module, is_sharded, without_weights
from ..runtime.lent_weights import has_abstract_weights, lent_inputs
from ..runtime.profile import PROFILE_REPEATS
from ..planning.family_programs import FamilyPrograms
from .sequential import check_devices
from ..planning.shape_fit import (
    ShapeSample, add_sample, chain_pattern, memory_sizes_ahead, memory_sizes_to_sample, sizes_to_sample,
)
from .collector import collector_paused
from .planned_shape import ChainDispatch, PlannedShape
from .ranks import UNBOUNDED_BYTES, ranks_plan
from .settings import DEFAULT_MAX_SHAPES, Settings, settings_from
from .shape_planning import PlanSettings, plan_shape, device_types, lending_device, sample_at

log = logging.getLogger(__name__)


#: Of those, with the default, how many may hold graphs of their own (PlannedShape.holds_graphs: exported on their
#: own, of a program not shared, or running block options' generated code traced at their shape) or block options
#: costed at their shape (PlannedShape.holds_menus: 0.2-0.35 MiB for a 4-12-layer GPT-2), least recently used dropped
#: first (a max_shapes given bounds them all, as before).
MAX_SHAPES_WITH_GRAPHS = 64


#: Steps per shape whose stage times its plan is first solved again from (RematModule._retime), for a family whose
#: times are fitted from its training steps (RematModule._times_from_steps): the medians of a shape's first three steps.
TIMED_STEPS = 3
#: Steps per shape whose stage times are recorded (hierremat.runtime.step_times): the shape's sample, that later
#: shapes' times are fitted from, follows the medians of its steps up to this many (a length seen again is timed
#: again), and its plan is solved again from them once they are all recorded. Fits from the medians of 7 interleaved
#: steps per length were within 10% of each length's own step at 9 of 11 lengths of the 4-layer GPT-2's loop and
#: 5 of 5 of the 12-layer's, those from its first 3 steps in a row at 7 of 11 and 2 of 5, from up to 6 (this) at
#: 8-9 of 11 and 5 of 5 (benchmarks/bench_shapes.py --accuracy; docs/results.md).
SAMPLED_STEPS = 9


#: Shapes timed in the training steps kept per family to fit from (spread over the sizes: add_sample).
STEP_SAMPLES = 12


def _shapes(inputs: tuple) -> tuple:
    """The shapes of the tensors among ``inputs`` (``(args, kwargs)``, tensors or meta skeletons)."""
    return tuple(tuple(v.shape) for v in pytree.tree_leaves(inputs) if isinstance(v, torch.Tensor))


def _family_key(args: tuple, kwargs: dict) -> tuple:
    """What one symbolic capture serves (hierremat.blocks.symbolic): the inputs' structure, dtypes,
    devices, ranks and non-tensor values, and the autocast setting; not their sizes."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    autocast = AutocastState.capture(device_types(args, kwargs)).key()
    return (str(spec), autocast) + tuple(
        (v.dim(), v.dtype, v.device, v.requires_grad) if isinstance(v, torch.Tensor) else repr(v) for v in leaves
    )


def _input_key(model: nn.Module, args: tuple, kwargs: dict, padding: bool) -> tuple:
    """What a plan for ``model(*args, **kwargs)`` is specific to: the inputs' structure, shapes, dtypes,
    devices, the autocast setting, and with ``padding``, which padding masks are all ones
    (hierremat.blocks.eager_masks)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    autocast = AutocastState.capture(device_types(args, kwargs)).key()
    return (str(spec), autocast, padding_key(model, args, kwargs) if padding else ()) + tuple(
        (tuple(v.shape), v.dtype, v.device, v.requires_grad) if isinstance(v, torch.Tensor) else repr(v) for v in leaves
    )


class RematModule(nn.Module):
    """The model, called exactly like it, whose training step fits the budget.

    Plans are cached per input shapes and autocast setting; a call with new shapes re-plans
    (``on_new_shape="replan"``) or raises (``"error"``). A call under an autocast setting
    not planned for yet plans for it (logged once per setting): call ``remat`` inside the
    autocast context you train with to plan once. For a model whose attention bias eager mode
    masks otherwise in batches without padding (hierremat.blocks.eager_masks), so does a first
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
        self.model = uncompiled(model)
        self.budget_bytes = budget_bytes
        self.on_new_shape = on_new_shape
        self.dynamic = dynamic
        self.settings = settings
        self.max_shapes = max_shapes
        #: of those, how many may hold graphs of their own: MAX_SHAPES_WITH_GRAPHS, or all where max_shapes was set
        self._max_with_graphs = MAX_SHAPES_WITH_GRAPHS if max_shapes == DEFAULT_MAX_SHAPES else max_shapes
        self._planned: OrderedDict[tuple, PlannedShape] = OrderedDict()  # least recently used first
        self._symbolic: dict[tuple, SymbolicCapture | None] = {}  # per _family_key; None: export each shape
        self._symbolic_dims: dict[tuple, frozenset] = {}  # per _family_key: the dimensions its capture made symbolic
        #: per _family_key: the size-generic graphs its shapes specialized from its symbolic capture run (_share_graphs;
        #: one per program among them); None: its graphs could not be made size-generic
        self._generic: dict[tuple, list[GenericChain] | None] = {}
        #: per size-generic chain: its stages' joint graphs traced once with symbolic sizes and the block options'
        #: programs generated from them (hierremat.planning.family_programs), dropped with it
        self._programs: weakref.WeakKeyDictionary[GenericChain, FamilyPrograms] = weakref.WeakKeyDictionary()
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
        return [c.plan for c in self._planned.values()]

    def _add(self, args: tuple, kwargs: dict, plan: ModelPlan | None = None, settings: PlanSettings | None = None,
             budget_bytes: int | None = None, shards: bool = False, defer_blocks: bool = True,
             carry_steps: bool = True) -> PlannedShape:
        """Plan the model for these inputs (``settings`` and ``budget_bytes``: this module's, unless given; ``shards``:
        as plan_shape takes it; ``defer_blocks`` False: block options re-costed at a fitted shape wherever they could
        pay, and built at a measured shape, none built yet, whatever ``settings.defer_block_options`` says; a shape
        planned again goes on with the steps its plan before timed unless ``carry_steps`` is False) and keep the
        plan."""
        settings = settings or self.settings
        budget_bytes = budget_bytes if budget_bytes is not None else self.budget_bytes
        kwargs = call_kwargs(self.model, kwargs)
        lending = settings.device or has_abstract_weights(self.model)
        lent_to = lending_device(self.model, args, kwargs, settings.device) if lending else None
        if lent_to is not None:  # planned for inputs on the device it trains on
            args, kwargs = lent_inputs((args, kwargs), lent_to)
        check_devices(device_types(args, kwargs), "the inputs" if self._planned else "the example inputs")
        symbolic = self._symbolic_capture(args, kwargs) if plan is None and lent_to is None else None
        family = _family_key(args, kwargs)
        first = not any(c.family == family for c in self._planned.values())
        samples = self._samples.setdefault(family, [])
        from_steps = self._times_from_steps(family, args, kwargs, settings, shards or plan is not None
                                            or lent_to is not None)
        if symbolic is not None:
            self._sample_shorter_length(symbolic, args, kwargs, samples, from_steps)
        key = _input_key(self.model, args, kwargs, self._per_padding)
        sources: list[str] = []
        matched: list[tuple] = []  # (_programs_for's (chain, generic chain or None), for _share_graphs: checked once)
        # (a new shape planned from its family's symbolic capture: the collector paused, its cycles freed young; not a
        # plan made again to build block options, which may solve and trace for seconds: api.collector)
        pause_collector = (not first and defer_blocks and symbolic is not None
                           and symbolic.bindings(args, kwargs) is not None)
        try:
            with recorded_sources() as sources, collector_paused() if pause_collector else contextlib.nullcontext():
                planned = plan_shape(self.model, args, kwargs, budget_bytes, plan, settings, symbolic,
                                         [*samples, *self._step_samples_of(family)], shards,
                                         self._released_output(family), self._recost_seconds if defer_blocks else None,
                                         upcasts_outputs(self), defer_blocks and self._deferring(settings),
                                         steps_time=from_steps, profiling=profiler_active(),
                                         programs_for=lambda chain: self._programs_for(family, chain, matched))
        except BaseException:  # (an infeasible budget, an unsupported model: nothing of it is kept)
            forget_sources(sources)
            raise
        family_sources = {key for programs in self._programs.values() for key in source_keys(programs.graph_modules())}
        planned.sources = [key for key in sources if key not in family_sources]  # (the family's: forgotten with it)
        planned.family_timed = self._timed_count(family)
        if from_steps:  # (a shape planned again goes on with the steps timed before)
            before = self._planned.get(key)
            earlier = before.chain_module.planned.step_times if before is not None and carry_steps else None
            planned.chain_module.planned.time_steps(SAMPLED_STEPS, earlier)  # (the plan before's go on, same chain)
            self._retime(planned)
        recosted = any(m.get("recosted") for m in planned.plan.menus.values())
        if recosted and not planned.plan.times.startswith("measured"):
            self._recost_seconds = planned.plan.options_seconds  # (block options re-costed at a fitted shape)
        elif planned.build_estimate is not None and self._recost_seconds is None:
            self._recost_seconds = planned.build_estimate  # (none built yet: what building them is taken to cost)
        elif planned.plan.menus and not self._blocks_built:  # built (solved): the next fitted shape re-costs at once,
            self._recost_seconds = None  # as after a first shape planned with them, and learns what re-costing takes
        self._blocks_built |= bool(planned.plan.menus)
        self._blocks_pay |= bool(planned.plan.menus) and not planned.menus_from_cache
        if self._planned:  # a new shape: what torch cached for this one's traces is not needed again
            clear_fake_tensor_cache()
        if planned.sample is not None and planned.bindings:
            add_sample(samples, planned.sample.bound(planned.bindings))
            if first and from_steps:  # (captured at its first shape: sizes said to vary; memory_sizes_ahead: that alone)
                self._sample_memory_ahead(symbolic, args, kwargs, samples)
        if not self._per_padding and any(has_value_branch(s.graph_module) for s in planned.chain.stages):
            self._per_padding = True
            self._drop_plans()  # (keyed without the padding state; planned again when called)
        planned.family = family
        if planned.bindings is not None and planned.plan.capture_kind == "specialized" and not shards:
            self._share_graphs(family, planned, matched[-1] if matched else None)
        key = _input_key(self.model, args, kwargs, self._per_padding)
        self._planned[key] = planned
        self._planned.move_to_end(key)  # (a shape planned again: the one used last, never the one dropped)
        while len(self._planned) > self.max_shapes:
            _, dropped = self._planned.popitem(last=False)
            forget_sources(dropped.sources)
        with_graphs = [k for k, c in self._planned.items() if c.holds_graphs or c.holds_menus]
        for k in with_graphs[:max(0, len(with_graphs) - self._max_with_graphs)]:
            forget_sources(self._planned.pop(k).sources)
        families = {c.family for c in self._planned.values()}
        for family_left in self._families_kept() - families:  # (its last plan dropped)
            self._forget_family(family_left)
        return planned

    def _per_family(self) -> tuple[dict, ...]:
        """What is kept per family of input shapes (_family_key) beside its plans, and forgotten with its last plan
        (not which first-shape captures failed: a few dimensions each, so that a failed export is not tried again)."""
        return self._symbolic, self._symbolic_dims, self._generic, self._samples, self._step_samples

    def _families_kept(self) -> set[tuple]:
        """The families of input shapes something is kept for beside their plans."""
        return {family for kept in self._per_family() for family in kept}

    def _forget_family(self, family: tuple) -> None:
        """Forget what a family of input shapes kept beside its plans (its last one dropped): its symbolic capture,
        its size-generic graphs (and their sources), the shapes measured to fit from. Called again, its first shape
        is a first shape again (where its capture there failed before, it is not tried again)."""
        self._drop_generic(family)
        for kept in self._per_family():
            kept.pop(family, None)

    def _programs_for(self, family: tuple, chain, matched: list | None = None) -> FamilyPrograms | None:
        """The joint graphs and programs (hierremat.planning.family_programs) of the family's size-generic chain that
        ``chain`` (specialized from its symbolic capture) runs; None where it runs none yet (_share_graphs makes it).
        matched: where given, (chain, the generic chain it runs or None) is appended to it, for _share_graphs."""
        try:
            generic = next((g for g in self._generic.get(family) or () if g.holds_for(chain)), None)
        except Exception as err:  # (a graph the check cannot read: as _share_graphs, the shape keeps its own)
            log.info("%s's graphs not shared at this shape: %s", type(self.model).__name__, err)
            return None
        if matched is not None:
            matched.append((chain, generic))
        if generic is None:
            return None
        if generic not in self._programs:
            self._programs[generic] = FamilyPrograms(generic.stages)
        return self._programs[generic]

    def _drop_generic(self, family: tuple) -> None:
        """Drop the family's size-generic graphs (hierremat.blocks.generic) and their block options' programs
        (hierremat.planning.family_programs), forgetting their sources."""
        for generic in self._generic.pop(family, None) or ():
            forget_sources(list(generic.sources))
            programs = self._programs.pop(generic, None)
            if programs is not None:  # (plans that still run them run on: only tracebacks read the sources)
                forget_sources(source_keys(programs.graph_modules()))

    def _share_graphs(self, family: tuple, planned: PlannedShape, matched: tuple | None = None) -> None:
        """Run ``compiled``, a shape specialized from its family's symbolic capture, from the family's size-generic
        graphs where they are its program (hierremat.blocks.generic.GenericChain.holds_for), made from its own where
        none is (up to MAX_GENERIC_CHAINS): its own graphs are then dropped, and their sources with them (a shape's
        plan then holds its schedule, costs and runner state alone, and where its block options run code traced at its
        shape, not its family's (hierremat.planning.family_programs), that code, bound to the generic stages:
        ChainMenus.use_stages). matched: (a chain, the generic one it runs or None) as _programs_for found them while
        it was planned, used where that chain is ``compiled``'s and the generic one still its family's."""
        generics = self._generic.setdefault(family, [])
        if generics is None:
            return
        made = False  # (whether this shape's graphs are made the generic ones of a program of its own)
        try:
            if matched is not None and matched[0] is planned.chain and (matched[1] is None or matched[1] in generics):
                generic = matched[1]  # (found while it was planned: nothing joined generics since)
            else:
                generic = next((g for g in generics if g.holds_for(planned.chain)), None)
            made = generic is None and len(generics) < MAX_GENERIC_CHAINS
            if made:
                generic = GenericChain.of(planned.chain, ChainDispatch())
        except Exception as err:  # (a graph the check or the copy cannot read: the shape keeps its own graphs)
            log.info("%s's graphs not shared at this shape: %s", type(self.model).__name__, err)
            return
        if generic is None:
            if made:
                log.info("%s's graphs compute a size hierremat cannot compute from their inputs' sizes: shapes of "
                         "this program keep graphs of their own", type(self.model).__name__)
                if not generics:
                    self._generic[family] = None
            return
        if made:
            setattr(planned.chain.orchestrator, CHAIN_ATTRIBUTE, nn.Identity())  # (the reference keeps no plan)
            generics.append(generic)
            log.info("%s's graphs made size-generic: every shape specialized from its symbolic capture to this program "
                     "runs them (%d programs)", type(self.model).__name__, len(generics))
        own = source_keys([planned.chain.orchestrator,
                           *(getattr(stage, "graph_module", stage) for stage in planned.chain.stages)])
        planned.run_generic(generic)
        menus = planned.chain_module.planned.menus
        generated = menus is not None and menus.runs_code_of_its_own  # (the code generated for block options stays)
        dropped = set(own if generated else planned.sources)
        forget_sources(list(dropped))
        planned.sources = [key for key in planned.sources if key not in dropped]

    def _times_from_steps(self, family: tuple, args: tuple, kwargs: dict, settings: PlanSettings,
                          elsewhere: bool) -> bool:
        """Whether the family's stage times are taken from its training steps (hierremat.runtime.step_times) rather
        than profiled apart for them: for inputs on CPU (where a step's ops are timed as they run) while block options
        are still to be built once they pay, decided at the family's first shape and confirmed at its second (where
        block options were built by then, from the cache or because the budget needs them, its shapes are profiled
        for times as before: those samples carry the node times that re-cost block options at the shapes fitted).
        ``elsewhere``: this shape is planned elsewhere (FSDP2's shards, a saved plan, a model without weights): no.

        Every shape of such a family records its first SAMPLED_STEPS steps (its sample follows them); a shape measured
        is timed from one run each (ProfiledChain.of's ``one_run``) and solved again from its steps' times once they
        are recorded; a shape fitted is fitted from the shapes timed so far, the shorter lengths measured for memory
        fits among them (timed from one run each: _sample_at_length's ``one_run``), and where those are too few
        however few (ShapeFit.of's ``reduced``: a length's times scaled by the tokens from one) and planned again
        whenever more are timed (``_refreshed``); every shape is solved again from its own steps' times once they are
        recorded (_retime); no shape is profiled for times alone (sizes_to_sample)."""
        shapes = {_shapes(c.skeleton) for c in self._planned.values() if c.family == family}
        steps = self._step_samples.get(family)
        if steps is None:
            if shapes or elsewhere or device_types(args, kwargs) != ("cpu",) or not self._deferring(settings):
                return False
            self._step_samples[family] = []
            return True
        if len(shapes) == 1 and _shapes((args, kwargs)) not in shapes and not self._deferring(settings):
            del self._step_samples[family]  # (its second shape, block options built since)
            self._untime_shorter_lengths(family)
            return False
        return not elsewhere

    def _untime_shorter_lengths(self, family: tuple) -> None:
        """Where a family's times are profiled again (block options built since its first shape: _times_from_steps),
        the shorter lengths measured at its first shape to fit from with its steps' times (_sample_memory_ahead: one
        timed run each, no block menu) count for memory alone: its shapes are then fitted from shapes profiled with
        their times and block menus (sizes_to_sample measures those; node times and generated code's speeds are
        fitted over them, ShapeFit.profiled)."""
        samples = self._samples.get(family, [])
        samples[:] = [replace(s, times_measured=False) if s.cut and s.profile is not None
                      and s.profile.repeats < PROFILE_REPEATS else s for s in samples]

    def _step_samples_of(self, family: tuple) -> list[ShapeSample]:
        """The family's shapes timed in its training steps (none where its times are not fitted from them), with
        the steps recorded since the last call added: each shape's stage times, bound by the family's symbolic
        capture (what its steps did not time taken from its plan's times: _observed_times)."""
        samples = self._step_samples.get(family)
        symbolic = self._symbolic.get(family)
        if samples is None or symbolic is None:
            return []
        profiled = frozenset(s.bindings for s in self._samples.get(family, ()) if s.times_measured)  # (kept beside
        # their profiles: ShapeFit.step_ratios)
        for planned in self._planned.values():
            step_times = planned.chain_module.planned.step_times
            if planned.family != family or step_times is None or step_times.steps <= planned.steps_sampled:
                continue
            planned.steps_sampled = step_times.steps
            bindings = symbolic.bindings(*planned.skeleton)
            times = self._observed_times(planned)
            if bindings and times is not None:
                pattern = chain_pattern([info.signature for info in planned.chain.infos])
                add_sample(samples, ShapeSample.from_step_times(bindings, pattern, times), STEP_SAMPLES, profiled)
        return samples

    @staticmethod
    def _observed_times(planned: PlannedShape) -> tuple | None:
        """The stage times observed in ``compiled``'s training steps (StepTimes.stage_times: what a stage's steps did
        not time taken from its plan's times), or None where none were."""
        step_times = planned.chain_module.planned.step_times
        if step_times is None:
            return None
        return step_times.stage_times([st.option_0_times for st in planned.plan.chain.costs.stages])

    def _times_due(self, planned: PlannedShape) -> tuple | None:
        """The stage times ``compiled``'s plan is to be solved again from now (its training steps': _retime), or None
        where it is not due."""
        step_times = planned.chain_module.planned.step_times
        if step_times is None:
            return None
        early = planned.one_run and not planned.retimed_steps  # (after its first step)
        first = step_times.steps >= TIMED_STEPS > planned.retimed_steps  # (its first TIMED_STEPS, or a plan made
        # again since)
        if step_times.steps == planned.retimed_steps or (step_times.recording and not early and not first):
            return None
        return self._observed_times(planned)

    def _retime(self, planned: PlannedShape, times: Sequence[tuple[float, float, float]] | None = None) -> None:
        """Solve a shape's plan again (the chain DP alone) from its training steps' times once its TIMED_STEPS steps
        are recorded (their medians: _times_from_steps) and again once all its SAMPLED_STEPS are, and, where it was
        measured from one timed run each, after its first step too: the times it runs with are then what its own
        steps took, whatever it was planned from (a fit from other lengths' single steps, one of them a noisy step,
        had predicted a 268-token step at 2.8x the measured).

        ``times``: under FSDP2, where rank 0's shape is due (every rank solves again then, a collective: rank 0's
        plan on every rank), this rank's own shape's times to solve from (its steps' where due, else its plan's)."""
        times = times or self._times_due(planned)
        if times is None:
            return
        step_times = planned.chain_module.planned.step_times
        steps = step_times.steps if step_times is not None else 0
        before, note = planned.plan.predicted_step_time, planned.times_note
        planned.retime(times)
        planned.retimed_steps = steps
        planned.relabel_times(note, planned.times_note)
        if before > 0:  # (a heuristic: what block options could save, a share of the step, kept as that share)
            planned.block_gain *= planned.plan.predicted_step_time / before
        log.info("%s solved again at this shape from the times of its first %d training steps: predicted step %.1f ms "
                 "(%.1f ms before)", type(self.model).__name__, steps, planned.plan.predicted_step_time * 1e3,
                 before * 1e3)

    def _deferring(self, settings: PlanSettings) -> bool:
        """Whether block options are still to be built once they pay (``defer_block_options``, none built yet)."""
        return settings.defer_block_options and not self._blocks_built

    def _plan_again(self, key: tuple, args: tuple, kwargs: dict, defer_blocks: bool = True,
                    carry_steps: bool = True) -> PlannedShape:
        """The plan of ``key`` (these inputs') made again (the same shape: whatever on_new_shape says), in its place;
        the old one kept until then (what the caller did with the output is read from it; on error it stays)."""
        old = self._planned[key]
        planned = self._add(args, kwargs, defer_blocks=defer_blocks, carry_steps=carry_steps)
        if self._planned.get(key) is not old:  # (replaced, or dropped with the others: a padding state now keyed)
            forget_sources(old.sources)
        return planned

    def _refreshed(self, key: tuple, planned: PlannedShape, args: tuple, kwargs: dict) -> PlannedShape:
        """``compiled``, the plan of ``key``, or the plan made again in its place: for the caller's autocast recipe,
        now known (_planned_for_another_recipe), or with its block options re-costed once a grad step without them
        has lost what re-costing takes (rent or buy: profile_and_solve; none built yet: built once the grad steps of
        every shape have lost what building them is taken to cost), or for fp32 copies of the outputs the
        caller now makes or no longer makes (accelerate's mixed precision wraps the forward after remat planned it)."""
        if self._planned_for_another_recipe(planned):  # (the steps timed before ran the other recipe)
            return self._plan_again(key, args, kwargs, carry_steps=False)
        if planned.reduced_fit and torch.is_grad_enabled() and planned.family_timed < self._timed_count(
                planned.family):
            log.info("%s planned again at this shape: its times were fitted from fewer shapes than a fit needs, and "
                     "the training steps have timed more since", type(self.model).__name__)
            return self._plan_again(key, args, kwargs)
        if torch.is_grad_enabled():
            self._retime(planned)
        if self._copies_to_count(planned) is not None:
            return self._plan_again(key, args, kwargs)
        if not planned.block_gain or not torch.is_grad_enabled():
            return planned
        if profiler_active():  # (building or re-costing them measures the CPU allocator with one: after it)
            if not self._profiler_logged:
                self._profiler_logged = True
                log.info("a torch.profiler session runs: block options are not built or re-costed until it ends")
            return planned
        if not self._blocks_built:  # building them serves every shape: the steps of all count
            self._lost_without_blocks += planned.block_gain
            if self._lost_without_blocks < self._recost_seconds:
                planned.steps_without += 1
                return planned
            log.info("block options built at this shape after steps without them lost up to %.2f s (building them "
                     "was taken to cost %.2f s)", self._lost_without_blocks, self._recost_seconds)
            return self._plan_again(key, args, kwargs, defer_blocks=False)
        if self._recost_seconds is not None and planned.steps_without * planned.block_gain < self._recost_seconds:
            planned.steps_without += 1  # (None: built since this shape was planned, what re-costing takes not known)
            return planned
        log.info("block options re-costed at this shape after %d steps without them (each up to %.1f ms slower)",
                 planned.steps_without, planned.block_gain * 1e3)
        return self._plan_again(key, args, kwargs, defer_blocks=False)

    def _copies_to_count(self, planned: PlannedShape) -> int | None:
        """The bytes of the fp32 copies the caller makes of the outputs (accelerate's mixed precision wraps the
        forward, also after remat planned it or fully_shard sharded the model) where ``compiled`` was planned with
        others, to plan it again with; None where they are the same, or ``compiled`` is a saved plan (warned once)."""
        copies = planned.chain.half_outputs_in_fp32_bytes if upcasts_outputs(self) else 0
        if copies == planned.plan.output_copies_bytes:
            return None
        if planned.saved:
            if copies and not planned.copies_warned:
                planned.copies_warned = True
                log.warning("the caller copies the model's fp16/bf16 outputs to fp32 (accelerate's mixed precision), "
                            "and the saved plan does not count the copies (%d B): its peak may exceed its budget by "
                            "that much; plan with hierremat.remat under the same wrapper instead", copies)
            return None
        log.info("%s's outputs are %s copied to fp32 by the caller (accelerate's mixed precision): planned again",
                 type(self.model).__name__, "now" if copies else "no longer")
        return copies

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

    def _planned_for_another_recipe(self, planned: PlannedShape) -> bool:
        """Whether ``compiled`` is to be planned again for the caller's autocast recipe, now known
        (_learn_backward_recipe): planned before, with stages left without block options for it, or for the other
        recipe. A saved plan for the other recipe is warned about once, not planned again."""
        menus = planned.chain_module.planned.menus
        recipe = self.settings.backward_autocast
        if menus is None or recipe is None:
            return False
        other = menus.backward_autocast is not None and menus.backward_autocast != recipe
        if planned.saved:
            if other and not planned.recipe_warned:
                planned.recipe_warned = True
                log.warning("the saved plan's block options were traced for the backward %s autocast, and it runs %s "
                            "it: their gradients may differ from plain autocast's in the last bits; plan again with "
                            "backward_autocast=%s", "under" if menus.backward_autocast else "outside",
                            "under" if recipe else "outside", recipe)
            return False
        return bool(menus.recipe_dependent) or other

    def _observed_backward_autocast(self) -> bool | None:
        """Whether the last backward under autocast of this module's plans (most recently used first) ran under it."""
        for planned in reversed(self._planned.values()):
            seen = planned.chain_module.planned.runner.observed_backward_autocast
            if seen is not None and planned.plan.chain.autocast != "off":
                return seen
        return None

    def _released_output(self, family: tuple) -> tuple[bool, ...] | None:
        """PlannedShape.released_output of the last shape of these inputs (``family``: _family_key) run with a
        backward since it was planned: a new shape is planned for the output's use seen there."""
        for planned in reversed(self._planned.values()):
            if planned.family == family and planned.chain_module.planned.runner.observed_output_use is not None:
                return planned.released_output()
        return None

    def _add_sharded(self, args: tuple, kwargs: dict) -> PlannedShape:
        """A new input shape after ``fully_shard`` (every rank called with it: ranks_plan): planned
        as a model built on meta is (its parameters' whole shapes, weights lent on the device its shards are on:
        hierremat.runtime.fsdp.without_weights), without block options (FSDP2 runs option 0) and without a budget
        (the whole model's gradients would be counted, not the shards'), then re-planned for the shards within the
        budget, every rank on rank 0's plan or raising rank 0's InfeasibleBudgetError."""
        device = str(next(iter(self.model.parameters())).device)  # (a DTensor's: where its local shard is)
        settings = replace(self.settings, device=device, block_options="autograd", compile=False)
        with without_weights(self.model):
            planned = self._add(args, kwargs, settings=settings, budget_bytes=UNBOUNDED_BYTES, shards=True)
        log.info("%s is sharded: a new input shape planned without its weights, then for the shards",
                 type(self.model).__name__)
        planned.shard(self.model, self.budget_bytes)
        return planned

    def _sample_shorter_length(self, symbolic: SymbolicCapture, args: tuple, kwargs: dict,
                               samples: list[ShapeSample], from_steps: bool = False) -> None:
        """At a family's second shape (while its measured shapes cannot fit a new one's times), measure the
        model also at shorter lengths cut from these inputs (hierremat.planning.shape_fit.sizes_to_sample),
        so that this shape or the shapes after it are fitted rather than each measured (``from_steps``: not, the
        training steps time the shapes: _times_from_steps); then, while the shapes whose memory was measured are
        too few to check a memory fit, its memory alone at shorter lengths still (memory_sizes_to_sample; where the
        training steps time the shapes, with one timed run each: _sample_at_length's ``one_run``). A length the model
        cannot take is skipped (logged)."""
        bindings = symbolic.bindings(args, kwargs)
        if not bindings:
            return
        self._sample_at_lengths(symbolic, args, kwargs, samples,
                                sizes_to_sample(samples, bindings) if not from_steps else None, timed=True)
        family = _family_key(args, kwargs)
        wanted = memory_sizes_to_sample(samples, bindings, self._step_samples_of(family) if from_steps else None)
        self._sample_at_lengths(symbolic, args, kwargs, samples, wanted, timed=False, one_run=from_steps)

    def _sample_memory_ahead(self, symbolic: SymbolicCapture, args: tuple, kwargs: dict,
                             samples: list[ShapeSample]) -> None:
        """At a family's first shape, captured symbolically because its sizes were said to vary: measure its
        memory at shorter lengths cut from these inputs now (hierremat.planning.shape_fit.memory_sizes_ahead),
        so that the shapes after it are planned from fits alone, none measured (the cost of a second shape, paid
        at the first where the caller said shapes will vary; each timed from one run: the family's times are fitted
        from its training steps, _times_from_steps)."""
        wanted = memory_sizes_ahead(samples, symbolic.bindings(args, kwargs) or {})
        self._sample_at_lengths(symbolic, args, kwargs, samples, wanted, timed=False, one_run=True)

    def _sample_at_lengths(self, symbolic: SymbolicCapture, args: tuple, kwargs: dict, samples: list[ShapeSample],
                           wanted: tuple[tuple[str, ...], tuple[int, ...]] | None, timed: bool,
                           one_run: bool = False) -> None:
        """_sample_at_length at each of ``wanted``'s values (its sizes, its values: planning.shape_fit's
        sizes_to_sample and kin; None: none)."""
        for value in wanted[1] if wanted is not None else ():
            self._sample_at_length(symbolic, args, kwargs, samples, wanted[0], value, timed=timed, one_run=one_run)

    def _sample_at_length(self, symbolic: SymbolicCapture, args: tuple, kwargs: dict, samples: list[ShapeSample],
                          names: tuple[str, ...], value: int, timed: bool, one_run: bool = False) -> None:
        """Measure the model at the inputs cut to ``value`` along ``names`` (``timed`` False: its memory alone;
        ``one_run``: and its times from one timed run each, no block menu: a family whose times the training steps
        give, which time its longer lengths, fitted with the short ones so measured, planning.shape_fit) and
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
                sample = sample_at(self.model, *narrowed, self.settings, symbolic, timed=timed, one_run=one_run,
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
                 time.perf_counter() - started,
                 "times and memory" if timed else "memory, and times from one run" if one_run else "memory alone")

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
        for key, planned in list(self._planned.items()):
            if not (keep_lent and planned.lent):
                forget_sources(planned.sources)
                del self._planned[key]

    def _symbolic_capture(self, args: tuple, kwargs: dict) -> SymbolicCapture | None:
        """The symbolic capture for calls like this one (hierremat.blocks.symbolic), made when a second
        shape of them comes (a model called at one shape never pays for it), with the sizes that differ between
        the shapes seen symbolic (blocks.symbolic.varying_dims); at the first shape already where its inputs say
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
        shapes = [c.skeleton for c in self._planned.values() if c.family == family]
        if not shapes and family not in self._symbolic:  # the family's first shape: symbolic at once where sizes
            # are said to vary (a family whose plans were all dropped is forgotten with them: _forget_family)
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
        self._drop_generic(family)  # (its sizes are the new capture's symbols)
        for c in self._planned.values():  # the shapes measured before: samples to fit later shapes' times from
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
        if family in self._first_capture_failed:  # (not tried again, also where its plans were all dropped since)
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
        (blocks.symbolic.every_dim); else those its inputs mark dynamic (marked_dims: ``torch._dynamo.mark_dynamic``)
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
        and the keyword arguments to call it with (hierremat.blocks.hf.call_kwargs).

        Outside what ``torch.compile`` traces: planning runs eagerly, and the returned
        orchestrator is traced (and guarded on) by Dynamo like any module it is handed."""
        kwargs = call_kwargs(self.model, kwargs)
        key = _input_key(self.model, args, kwargs, self._per_padding)
        planned = self._planned.get(key)
        if planned is not None:
            self._planned.move_to_end(key)
        sharded = is_sharded(self.model)
        if not sharded:  # (FSDP2 runs option 0 of every stage: nothing to re-cost)
            self._learn_backward_recipe()
            if planned is not None:
                planned = self._refreshed(key, planned, args, kwargs)
        variant = planned is None and any(k[:1] + k[3:] == key[:1] + key[3:] for k in self._planned)
        refuses = planned is None and not variant and self.on_new_shape == "error"
        # under FSDP2, whether any rank plans in this call (every rank then agrees on one schedule) and whether any
        # refuses to (every rank then raises: ranks whose plans differ, as their padding states may, would otherwise
        # leave one raising while the others wait in a collective); the key compared across ranks is this one without
        # its padding state (_input_key's third part)
        # (and, where every rank runs a sharded plan, whether rank 0's is due to be solved again from its steps' times)
        retimes = planned is not None and planned.sharded and torch.is_grad_enabled()
        due = self._times_due(planned) if retimes else None
        # (sharded, a wrapper that copies the outputs to fp32 since the plan: re-sharded with them counted, as a plan
        # made here re-shards every rank's)
        copies = self._copies_to_count(planned) if sharded and planned is not None else None
        if copies is not None:
            planned.count_copies(copies)
        others_plan, others_refuse, rank0_retimes = ranks_plan(
            key[:2] + key[3:], planned is None or copies is not None, refuses, due is not None if retimes else None,
        ) if sharded else (False, refuses, False)
        if others_refuse:
            raise ValueError(
                "inputs differ (shape, dtype, device or non-tensor values) from the planned ones"
                + ("" if refuses else " on another rank")
                + "; call hierremat.remat(..., settings=hr.Settings(on_new_shape='replan')) to plan per shape"
            )
        if planned is None or not planned.sharded or others_plan:  # has fully_shard been applied since the plan?
            if is_fsdp_module(self):
                raise UnsupportedModelError(
                    "fully_shard was applied to the module hierremat.remat returned: apply it to the model passed to "
                    "remat (each block, then the model itself)"
                )
            if planned is not None and sharded:
                planned.shard(self.model, self.budget_bytes)
        elif rank0_retimes:  # (a shape planned before fully_shard from one run each: solved again from its sharded
            # steps' times, every rank together, rank 0's plan on every rank)
            self._retime(planned, due or [st.option_0_times for st in planned.plan.chain.costs.stages])
        if planned is None:
            if variant:  # all but autocast and padding
                log.info(
                    "%s called under autocast %r%s for the first time: planning for it",
                    type(self.model).__name__, AutocastState.capture(device_types(args, kwargs)).describe(),
                    f" with padding masks all ones {dict(key[2])}" if self._per_padding else "",
                )
            planned = self._add_sharded(args, kwargs) if sharded else self._add(args, kwargs)
        if planned.lent:  # planned on meta: the model's own weights from now on
            planned.bind_to(self.model)
        return planned.orchestrator(), kwargs

    def _apply(self, fn, recurse=True):
        # captured graphs hold the old tensors: re-plan after .to()/.cuda(), but for plans made on meta
        # (to_empty materializes the model they were made for: they bind to its tensors when next called)
        self._drop_plans(keep_lent=True)
        for family in self._families_kept():
            self._forget_family(family)
        self._first_capture_failed.clear()
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


def remat(
    model: nn.Module,
    example_args,
    example_kwargs: dict | None = None,
    *,
    budget=None,
    plan: ModelPlan | None = None,
    outputs: str | tuple[str, ...] | None = None,
    device: str | torch.device | None = None,
    settings: Settings | None = None,
) -> RematModule:
    """Return a module called like ``model`` whose training step fits ``budget`` (or ``plan``'s).

    plan: a plan from hierremat.plan or hierremat.explore to run (its budget, outputs, segmentation, variants,
    compile and offload unless given). outputs, device: as for hierremat.plan; a module planned on meta computes
    with the model's own weights from its first call after ``to_empty`` and initialization (a call before
    raises). settings: every other option (hr.Settings; its remat-only fields say how new input shapes are
    planned and when block options are built).
    """
    if budget is None and plan is None:
        raise TypeError("remat needs budget= (bytes or '3GiB') or plan= (from hierremat.plan)")
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    budget_bytes = parse_budget(budget) if budget is not None else plan.budget_bytes
    settings = settings_from(settings)
    module = RematModule(model, budget_bytes, settings.on_new_shape, settings.planning(outputs, device, plan, defer=True),
                         settings.max_shapes, settings.dynamic)
    module._add(args, example_kwargs or {}, plan)
    return module
