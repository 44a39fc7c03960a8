"""``hierremat.remat``: a whole model under a memory budget, at every input shape it is called with.

``RematModule`` wraps the model: at each new input shape it plans (hierremat.api.shape_planning.plan_shape:
capture, or specialize the symbolic capture, cut into a chain, profile, menus, the chain DP) and keeps the plan
(hierremat.api.planned_shape), least recently used dropped beyond ``max_shapes``. What it keeps beside its plans is
in rooms of their own: per family of input shapes (hierremat.api.shape_families), the training steps' times and the
plans solved again from them (hierremat.api.step_retiming), shorter lengths measured to fit from
(hierremat.api.length_sampling), when block options are built (hierremat.api.block_building), and what it learns
from how it is called (hierremat.api.caller_recipe). It presents the model's forward signature, state_dict keys and
attributes to training loops (Trainer, accelerate).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections import OrderedDict
from dataclasses import replace

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ..blocks.capture import uncompiled
from ..blocks.eager_masks import has_value_branch, padding_key
from ..blocks.hf import call_kwargs, upcasts_outputs
from ..blocks.sources import clear_fake_tensor_cache, forget_sources, recorded_sources
from ..budget import parse_budget
from ..device.autocast import AutocastState
from ..device.memory import profiler_active
from ..errors import UnsupportedModelError
from ..planning.shape_fit import add_sample
from ..plans.model_plan import ModelPlan
from ..runtime.fsdp import is_fsdp_module, is_sharded, without_weights
from ..runtime.lent_weights import has_abstract_weights, lent_inputs
from .block_building import BlockBuilding
from .caller_recipe import copies_to_count, planned_for_another_recipe, with_backward_recipe
from .collector import collector_paused
from .length_sampling import LengthSampler
from .planned_shape import PlannedShape
from .ranks import UNBOUNDED_BYTES, ranks_plan
from .sequential import check_devices
from .settings import DEFAULT_MAX_SHAPES, Settings, settings_from
from .shape_families import ShapeFamilies, family_key
from .shape_planning import PlanSettings, ShapeRequest, device_types, lending_device, plan_shape
from .step_retiming import SAMPLED_STEPS, StepRetimer

log = logging.getLogger(__name__)


#: Of those, with the default, how many may hold graphs of their own (PlannedShape.holds_graphs: exported on their
#: own, of a program not shared, or running block options' generated code traced at their shape) or block options
#: costed at their shape (PlannedShape.holds_menus: 0.2-0.35 MiB for a 4-12-layer GPT-2), least recently used dropped
#: first (a max_shapes given bounds them all, as before).
MAX_SHAPES_WITH_GRAPHS = 64


def _input_key(model: nn.Module, args: tuple, kwargs: dict, padding: bool) -> tuple:
    """What a plan for ``model(*args, **kwargs)`` is specific to: the inputs' structure, shapes, dtypes,
    devices, the autocast setting, and with ``padding``, which padding masks are all ones
    (hierremat.blocks.eager_masks)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    autocast = AutocastState.capture(device_types(args, kwargs)).key()
    return (str(spec), autocast, padding_key(model, args, kwargs) if padding else ()) + tuple(
        (tuple(v.shape), v.dtype, v.device, v.requires_grad) if isinstance(v, torch.Tensor) else repr(v) for v in leaves
    )


def _keep_bounded(plans: OrderedDict, key: tuple, planned: PlannedShape, max_shapes: int, max_with_graphs: int) -> None:
    """Keep ``planned`` under ``key`` as the plan used last; drop the least recently used beyond ``max_shapes``, and
    those holding graphs or block options of their own beyond ``max_with_graphs``, forgetting their sources."""
    plans[key] = planned
    plans.move_to_end(key)  # (a shape planned again: the one used last, never the one dropped)
    while len(plans) > max_shapes:
        _, dropped = plans.popitem(last=False)
        forget_sources(dropped.sources)
    with_graphs = [k for k, c in plans.items() if c.holds_graphs or c.holds_menus]
    for k in with_graphs[:max(0, len(with_graphs) - max_with_graphs)]:
        forget_sources(plans.pop(k).sources)


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
        self.settings = settings
        self.max_shapes = max_shapes
        #: of those, how many may hold graphs of their own: MAX_SHAPES_WITH_GRAPHS, or all where max_shapes was set
        self._max_with_graphs = MAX_SHAPES_WITH_GRAPHS if max_shapes == DEFAULT_MAX_SHAPES else max_shapes
        self._planned: OrderedDict[tuple, PlannedShape] = OrderedDict()  # least recently used first
        self._per_padding = False  # plans kept per all-ones padding state (a captured graph branches on it)
        self._families = ShapeFamilies(self.model, dynamic, on_new_shape)
        self._building = BlockBuilding()
        self._retimer = StepRetimer(self._families, self._planned)
        self._sampler = LengthSampler(self.model, self._building, self._retimer)
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
        kwargs = call_kwargs(self.model, kwargs)
        lending = settings.device or has_abstract_weights(self.model)
        lent_to = lending_device(self.model, args, kwargs, settings.device) if lending else None
        if lent_to is not None:  # planned for inputs on the device it trains on
            args, kwargs = lent_inputs((args, kwargs), lent_to)
        check_devices(device_types(args, kwargs), "the inputs" if self._planned else "the example inputs")
        symbolic = (self._families.symbolic_capture(args, kwargs, self._planned.values(), is_sharded(self.model))
                    if plan is None and lent_to is None else None)
        family = family_key(args, kwargs)
        first = not any(c.family == family for c in self._planned.values())
        samples = self._families.samples.setdefault(family, [])
        from_steps = self._retimer.times_from_steps(family, args, kwargs, self._building.deferring(settings),
                                                    shards or plan is not None or lent_to is not None)
        if symbolic is not None:
            self._sampler.sample_shorter_lengths(symbolic, args, kwargs, samples, self.settings, from_steps)
        matched: list[tuple] = []  # (programs_for's (chain, generic chain or None), for share_graphs: checked once)
        # (a new shape planned from its family's symbolic capture: the collector paused, its cycles freed young; not a
        # plan made again to build block options, which may solve and trace for seconds: api.collector)
        pause = not first and defer_blocks and symbolic is not None and symbolic.bindings(args, kwargs) is not None
        sources: list[str] = []
        try:
            with recorded_sources() as sources, collector_paused() if pause else contextlib.nullcontext():
                request = ShapeRequest(
                    symbolic, (*samples, *self._retimer.step_samples_of(family),
                               *self._families.node_samples.get(family, ())), shards,
                    output_released=self._released_output(family), upcasts=upcasts_outputs(self),
                    recost_seconds=self._building.recost_seconds if defer_blocks else None,
                    defer=defer_blocks and self._building.deferring(settings), steps_time=from_steps,
                    profiling=profiler_active(),
                    programs_for=lambda chain: self._families.programs_for(family, chain, matched))
                planned = plan_shape(self.model, args, kwargs,
                                     budget_bytes if budget_bytes is not None else self.budget_bytes, plan, settings,
                                     request)
        except BaseException:  # (an infeasible budget, an unsupported model: nothing of it is kept)
            forget_sources(sources)
            raise
        family_sources = self._families.program_sources()
        planned.sources = [key for key in sources if key not in family_sources]  # (the family's: forgotten with it)
        planned.family, planned.family_timed = family, self._retimer.timed_count(family)
        if from_steps:
            self._time_steps(planned, _input_key(self.model, args, kwargs, self._per_padding), carry_steps)
        self._building.record(planned)
        self._keep(planned, args, kwargs, first and from_steps, symbolic, shards, matched)
        return planned

    def _time_steps(self, planned: PlannedShape, key: tuple, carry_steps: bool) -> None:
        """Have ``planned``'s training steps timed (its first SAMPLED_STEPS), going on with those its plan before
        timed (the same chain) unless ``carry_steps`` is False, and solve it again from them where due."""
        before = self._planned.get(key)
        earlier = before.chain_module.planned.step_times if before is not None and carry_steps else None
        planned.chain_module.planned.time_steps(SAMPLED_STEPS, earlier)
        self._retimer.retime(planned)

    def _keep(self, planned: PlannedShape, args: tuple, kwargs: dict, sample_ahead: bool, symbolic, shards: bool,
              matched: list[tuple]) -> None:
        """Keep ``planned``, the plan of these inputs: its sample added to its family's, its graphs shared with its
        family's (hierremat.api.shape_families), the plans beyond the bounds dropped, and their families with them."""
        family = planned.family
        if self._planned:  # a new shape: what torch cached for this one's traces is not needed again
            clear_fake_tensor_cache()
        samples = self._families.samples.setdefault(family, [])
        if planned.sample is not None and planned.bindings:
            add_sample(samples, planned.sample.bound(planned.bindings))
            if sample_ahead:  # (captured at its first shape: sizes said to vary; memory_sizes_ahead: that alone)
                self._sampler.sample_memory_ahead(symbolic, args, kwargs, samples, self.settings)
        if planned.node_sample is not None and planned.bindings:
            add_sample(self._families.node_samples.setdefault(family, []), planned.node_sample.bound(planned.bindings))
        if not self._per_padding and any(has_value_branch(s.graph_module) for s in planned.chain.stages):
            self._per_padding = True
            self._drop_plans()  # (keyed without the padding state; planned again when called)
        if planned.bindings is not None and planned.plan.capture_kind == "specialized" and not shards:
            self._families.share_graphs(family, planned, matched[-1] if matched else None)
        key = _input_key(self.model, args, kwargs, self._per_padding)
        _keep_bounded(self._planned, key, planned, self.max_shapes, self._max_with_graphs)
        families = {c.family for c in self._planned.values()}
        for family_left in self._families.kept() - families:  # (its last plan dropped)
            self._families.forget(family_left)

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
        """``planned``, the plan of ``key``, or the plan made again in its place: for the caller's autocast recipe,
        now known, or with its block options built or re-costed once grad steps without them have lost what that
        takes (hierremat.api.block_building), or for fp32 copies of the outputs the caller now makes or no longer
        makes (accelerate's mixed precision wraps the forward after remat planned it)."""
        if planned_for_another_recipe(planned, self.settings.backward_autocast):  # (its steps ran the other recipe)
            return self._plan_again(key, args, kwargs, carry_steps=False)
        grad = torch.is_grad_enabled()
        if grad and planned.reduced_fit and planned.family_timed < self._retimer.timed_count(planned.family):
            log.info("%s planned again at this shape: its times were fitted from fewer shapes than a fit needs, and "
                     "the training steps have timed more since", type(self.model).__name__)
            return self._plan_again(key, args, kwargs)
        if grad:
            self._retimer.retime(planned)
        if copies_to_count(planned, upcasts_outputs(self), type(self.model).__name__) is not None:
            return self._plan_again(key, args, kwargs)
        if grad and self._building.due(planned):
            return self._plan_again(key, args, kwargs, defer_blocks=False)
        return planned

    def _released_output(self, family: tuple) -> tuple[bool, ...] | None:
        """PlannedShape.released_output of the last shape of these inputs (``family``) run with a backward since it
        was planned: a new shape is planned for the output's use seen there."""
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

    def _drop_plans(self, keep_lent: bool = False) -> None:
        """Forget every plan (``keep_lent``: but those made on meta, not yet bound to the model's tensors)."""
        for key, planned in list(self._planned.items()):
            if not (keep_lent and planned.lent):
                forget_sources(planned.sources)
                del self._planned[key]

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
            self.settings = with_backward_recipe(self.settings, self._planned.values(), type(self.model).__name__)
            if planned is not None:
                planned = self._refreshed(key, planned, args, kwargs)
        variant = planned is None and any(k[:1] + k[3:] == key[:1] + key[3:] for k in self._planned)
        refuses = planned is None and not variant and self.on_new_shape == "error"
        others_plan = self._agree_across_ranks(key, planned, refuses) if sharded else False
        if refuses and not sharded:
            _refuse(here=True)
        if planned is None or not planned.sharded or others_plan:  # has fully_shard been applied since the plan?
            if is_fsdp_module(self):
                raise UnsupportedModelError(
                    "fully_shard was applied to the module hierremat.remat returned: apply it to the model passed to "
                    "remat (each block, then the model itself)"
                )
            if planned is not None and sharded:
                planned.shard(self.model, self.budget_bytes)
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

    def _agree_across_ranks(self, key: tuple, planned: PlannedShape | None, refuses: bool) -> bool:
        """Under FSDP2, whether any rank plans in this call (every rank then agrees on one schedule), raising where
        any refuses to (ranks whose plans differ, as their padding states may, would otherwise leave one raising
        while the others wait in a collective); the key compared across ranks is this one without its padding
        state. Where every rank runs a sharded plan and rank 0's is due to be solved again from its steps' times,
        every rank solves again together, rank 0's plan on every rank; a wrapper that copies the outputs to fp32
        since the plan has them counted and every rank re-sharded."""
        retimes = planned is not None and planned.sharded and torch.is_grad_enabled()
        due = self._retimer.times_due(planned) if retimes else None
        copies = (copies_to_count(planned, upcasts_outputs(self), type(self.model).__name__)
                  if planned is not None else None)
        if copies is not None:
            planned.count_copies(copies)
        others_plan, others_refuse, rank0_retimes = ranks_plan(
            key[:2] + key[3:], planned is None or copies is not None, refuses, due is not None if retimes else None,
        )
        if others_refuse:
            _refuse(here=refuses)
        if rank0_retimes and planned is not None and planned.sharded and not others_plan:
            self._retimer.retime(planned, due or [st.option_0_times for st in planned.plan.chain.costs.stages])
        return others_plan

    def _apply(self, fn, recurse=True):
        # captured graphs hold the old tensors: re-plan after .to()/.cuda(), but for plans made on meta
        # (to_empty materializes the model they were made for: they bind to its tensors when next called)
        self._drop_plans(keep_lent=True)
        self._families.clear()
        self._building.reset()  # (another device's)
        return super()._apply(fn, recurse)


def _refuse(here: bool) -> None:
    """Raise for inputs unlike the planned ones where new shapes are not planned (``here``: on this rank)."""
    raise ValueError(
        "inputs differ (shape, dtype, device or non-tensor values) from the planned ones"
        + ("" if here else " on another rank")
        + "; call hierremat.remat(..., settings=hr.Settings(on_new_shape='replan')) to plan per shape"
    )


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
