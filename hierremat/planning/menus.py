"""ILP option menus for the stages of a chain: the "Checkmate half" of the hybrid plan.

For every distinct stage signature (identical blocks share one), the stage's joint
forward+backward ATen graph is traced (hierremat.blocks.joint), its nodes are profiled
(hierremat.runtime.node_profile), and the per-block ILP's budget sweep
(hierremat.ilp.options.solve_menu) yields a Pareto menu of options. The menus are cached
on disk by signature, device and versions (hierremat.store.cache), so a second run solves
nothing. Each stage then offers the chain DP option 0 (the stage under autograd,
profiled as a whole) plus the menu's options k = 1.., which the runtime executes as
generated code (hierremat.runtime.block_exec); the menu's first options keep what
autograd keeps, so option 0's work also runs as generated code wherever that is faster.
The forward without grad (F_none / F_ck) runs as the generated forward of the stage's
joint graph (hierremat.ilp.options.forward_only) where that is faster than calling the
stage and peaks no higher (StageCosts.nograd_form), or where it peaks lower and the faster
form does not fit the budget (StageCosts.leaner_nograd).

Cost model: an option's times are sums of per-node times, measured one op at a time;
the whole-stage profile of option 0 is measured as one call, under autograd. To put both
on one scale, menu times are multiplied per signature by the measured time of one of its
options as the generated code really runs it (forward + backward, the least of a few runs)
over that option's node-time sum: the code's own overhead, and kernels that are slower
(or faster) in the decomposed graph than in eager autograd, are then priced in, so the
DP picks autograd's option 0 or the generated code by what each really costs. The
generated forward without grad is timed the same way.

Under autocast, joint graphs are traced with the forward under the caller's setting, so
every cast autocast makes (weights included) is an explicit node of the graph, and options
run with autocast off (hierremat.device.autocast).

Stages whose joint graph cannot be traced, that return several tensors (a model's output
stage), whose output is one result of a multi-output operator (a lone dropout), in
which autocast casts one parameter more than once, whose backward autocast would
change while the caller's recipe is not known (exact_under_autocast), or that run under
autocast on a device where a replayed graph is not known to be bitwise (CUDA:
AUTOCAST_EXACT_DEVICE_TYPES, refused before tracing) keep option 0 only; the reason is
logged. The last stage gets a menu like any other where it has no fused LM head
(hierremat.planning.output_stage) and the chain's output, and the gradient that arrives for
it, are the one tensor its graph returns (ChainMenus._output_fits_menu): in a chain of
identical blocks, the last block's menu is the others'.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ..plans import clock
from ..plans.block_graph import FORWARD, BlockGraph
from ..blocks.eager_masks import has_value_branch
from ..blocks.joint import JointGraph, to_block_graph, trace_joint
from ..runtime.node_profile import profile_nodes
from ..plans.costs import OptionCosts
from ..store.cache import CacheKey, OptionsCache, canonical_json, default_cache
from ..ilp.options import MENU_TIME_LIMIT, forward_only, recost_options, solve_menu
from ..plans.block_options import BlockOption, ForwardOnly
from ..ilp.solve import solve_count
from ..session import current_session
from .family_programs import FamilyPrograms
from .output_stage import fused_head_option, fused_head_stage
from .shape_fit import FIT_VERSION, ShapeFit
from ..device.autocast import AutocastState
from ..runtime.block_exec import ForwardExecutor, GeneratedForward, GeneratedOption, OptionExecutor
from ..runtime.option_codegen import StageBinding
from ..runtime.profile import ChainProfile, timed_seconds, no_side_effects, scratch_grads
from ..runtime.residents import keep_made, split_output, stage_shared
from ..runtime.stage_cost_cache import STAGE_COST_VERSION, ExecutorSpeeds, StageCostCache, device_name
from ..blocks.variants.dropout import pack_dropout_masks
from ..blocks.variants.in_place import run_in_place
from ..blocks.variants.relu_masks import pack_relu_masks

log = logging.getLogger(__name__)

#: Bump when node profiling or the time calibration changes (invalidates cached menus).
COST_MODEL_VERSION = "nodes-5"  # (CPU node times: the least of their runs)
#: Relative price added to executor options so that autograd wins ties (see ChainMenus.extend).
TIE_MARGIN = 1e-6
#: An option no leaner than autograd's (option 0) in any memory figure is taken only where it is faster by
#: more than this share of autograd's measured time (see _priced_within_noise).
NOISE_MARGIN = 0.03
#: Bump when the ILP formulation changes (invalidates cached menus).
FORMULATION_VERSION = "staged-6"
#: Device types where a block's graph traced under autocast, replayed, is known to give eager autocast's gradients
#: bitwise (tests/test_mixed_precision.py). Not CUDA yet: the 1e-4 gap of block options under bf16 autocast on an H200
#: was their compiled form's (compile="auto" compiled them; Inductor keeps fp32 between fused ops:
#: benchmarks/bits_by_op.py, where every eager op of the step gave plain's bits), and "auto" no longer compiles in
#: bf16 or fp16 (planning.chain_plan.resolve_compile); eager block options under autocast have not run on a GPU,
#: so there stages keep option 0 (recomputed whole, eagerly: test_cuda_bf16_autocast_within_budget passes so).
#: ``bits_by_op.py --replayed-under-autocast`` on a GPU says whether CUDA can join.
AUTOCAST_EXACT_DEVICE_TYPES = ("cpu",)


def cost_model_version() -> str:
    """The versions a plan's costs come from: block nodes' times and their calibration (COST_MODEL_VERSION), the
    stage costs (hierremat.runtime.stage_cost_cache.STAGE_COST_VERSION), the block ILP (FORMULATION_VERSION), the
    costs fitted at shapes not measured (hierremat.planning.shape_fit.FIT_VERSION) and torch's (ModelPlan.cost_model:
    a saved plan made under others is warned about where it is run)."""
    return f"{COST_MODEL_VERSION}/{STAGE_COST_VERSION}/{FORMULATION_VERSION}/{FIT_VERSION}/torch-{torch.__version__}"


@dataclass(frozen=True)
class StageMenu:
    """The solved menu of one stage signature: its block graph and options (node-time units).

    coarse: why the options are heuristic rather than the ILP sweep's ("" when they are the
    sweep's; see hierremat.plans.block_options.BlockOptions).
    recosted: True where the options were solved for this block at other sizes (another input
    shape) and re-costed on this graph (hierremat.ilp.options.recost_options), not solved for it."""

    graph: BlockGraph
    options: tuple[BlockOption, ...]
    solve_seconds: float
    coarse: str = ""
    recosted: bool = False

    def to_dict(self) -> dict:
        return {key: entry(self) for key, entry in _MENU_ENTRIES.items()}

    @classmethod
    def from_dict(cls, d: dict) -> "StageMenu":
        return cls(
            graph=BlockGraph.from_dict(d["graph"]),
            options=tuple(BlockOption.from_dict(o) for o in d["options"]),
            solve_seconds=float(d.get("solve_seconds", 0.0)),
            coarse=str(d.get("coarse", "")),
            recosted=bool(d.get("recosted", False)),
        )


#: StageMenu.to_dict's entries, each as computed from the menu
_MENU_ENTRIES = {
    "graph": lambda menu: menu.graph.to_dict(),
    "options": lambda menu: [o.to_dict() for o in menu.options],
    "solve_seconds": lambda menu: menu.solve_seconds,
    "coarse": lambda menu: menu.coarse,
    "recosted": lambda menu: menu.recosted,
}


class PlanMenu(Mapping):
    """A StageMenu as a plan holds it (ModelPlan.menus): its :meth:`StageMenu.to_dict`, each entry made when read and
    not kept, so that a plan holds its menu once, as the objects its executors run (the block graph's nodes as dicts
    were a third of what a plan whose block options were re-costed at its shape held)."""

    __slots__ = ("menu",)

    def __init__(self, menu: StageMenu):
        self.menu = menu

    def __getitem__(self, key: str):
        return _MENU_ENTRIES[key](self.menu)

    def __iter__(self):
        return iter(_MENU_ENTRIES)

    def __len__(self) -> int:
        return len(_MENU_ENTRIES)

    def __repr__(self) -> str:
        return f"PlanMenu({len(self.menu.options)} options{', re-costed' if self.menu.recosted else ''})"


@dataclass
class ChainMenus:
    """Menus of a chain's stages and the executors that run them.

    menus: signature -> StageMenu; executors[i][k]: runs option k of stage i (index 0 is
    None: option 0 is the stage under autograd); solves: ILP solves done (0 on a cache hit).
    forwards: signature -> the generated no-grad forward (F_none / F_ck) of its stages;
    forward_executors[i]: runs it on stage i (None for a stage without a menu).
    output_option: the last stage's other form (hierremat.planning.output_stage: the fused LM head) as
    (its OptionCosts, the output gradient mask they were measured with), or None; its
    executor is executors[-1][1].
    compiled_forwards: signature -> (its no-grad forward compiled,
    hierremat.runtime.compiled_option.CompiledForward; its measured (seconds, peak bytes) or
    None when loaded for a saved plan); filled by hierremat.planning.compiled.
    compiled: (signature, option name) -> (its hierremat.runtime.compiled_option.CompiledProgram,
    its CompiledCosts or None when loaded for a saved plan); filled by hierremat.planning.compiled.
    compile: whether each stage also offers every menu option compiled (hierremat.planning.compiled):
    then options 1..n of a stage with an n-option menu run as generated eager code, and
    options n+1..2n are the same options compiled.
    recipe_dependent: signatures left without a menu because autocast changes their backward and the
    caller's recipe was not known (exact_under_autocast): a plan made once it is known can give them one.
    """

    menus: dict[str, StageMenu]
    executors: list[list]
    signatures: tuple[str, ...]
    solves: int = 0
    seconds: float = 0.0
    #: signature -> measured speeds of its generated code (hierremat.runtime.stage_cost_cache.ExecutorSpeeds)
    speeds: dict = field(default_factory=dict)
    forwards: dict = field(default_factory=dict)
    forward_executors: list = field(default_factory=list)
    compiled_forwards: dict = field(default_factory=dict)
    output_option: tuple | None = None
    compiled: dict = field(default_factory=dict)
    #: (signature, option name) that Inductor failed to compile: their compiled forms run eagerly
    compile_failed: set = field(default_factory=set)
    compile_seconds: float = 0.0
    compile: bool = False
    #: the chain's ResidentLayout (hierremat.plans.stage_info), or None
    residents: object = None
    recipe_dependent: tuple[str, ...] = ()
    #: under autocast, the caller's recipe the stages were traced for (None: not known, or no autocast)
    backward_autocast: bool | None = None
    #: signatures whose joint graph and programs are their family's, traced once for every shape
    #: (hierremat.planning.family_programs): none of this shape's own
    shared_code: frozenset[str] = frozenset()
    #: whether the last stage's fused head (``output_option``) is its family's, made once for every shape
    output_shared: bool = False
    #: signatures whose node costs were modelled from FLOPs and bytes, not measured, and whose executors were timed
    #: from one run: the planning deadline had passed (build_menus; neither is cached)
    modelled: tuple[str, ...] = ()
    timed_once: tuple[str, ...] = ()

    @property
    def runs_code_of_its_own(self) -> bool:
        """Whether any stage runs code generated from a graph traced at this shape (a block option, a no-grad
        forward, a compiled form, the fused head), not the programs and the fused head its family shares
        (:attr:`shared_code`, :attr:`output_shared`)."""
        own = [i for i, sig in enumerate(self.signatures) if sig not in self.shared_code
               and not (self.output_shared and i == len(self.executors) - 1)]
        return (any(e is not None for i in own for e in self.executors[i])
                or any(self.forward_executors[i] is not None for i in own if i < len(self.forward_executors))
                or bool(self.compiled or self.compiled_forwards))

    def use_stages(self, stages: Sequence) -> None:
        """Bind every stage's block options to ``stages``, the same programs as the stages traced (hierremat.blocks.
        generic's copies), so that the traced stages, graphs of one shape, are no longer held: an executor's joint
        graph keeps its stage for the parameters and buffers it reads, which ``stages`` hold under the same names. The
        joint graphs and the code generated from them stay (traced at the shape: a plan that runs them still holds
        graphs of its own, PlannedShape.holds_graphs)."""
        for stage, executors in zip(stages, self.executors):
            for executor in executors:
                joint = getattr(executor, "joint", None)
                if isinstance(joint, JointGraph):
                    joint.stage = stage

    def menu_size(self, stage: int) -> int:
        """n: the number of options of stage ``stage``'s menu (0 without one)."""
        menu = self.menus.get(self.signatures[stage])
        fused_head = stage == len(self.executors) - 1 and self.output_option is not None
        return len(menu.options) if menu is not None and len(self.executors[stage]) > 1 and not fused_head else 0

    def option(self, stage: int, k: int) -> BlockOption:
        """The menu option that option k >= 1 of stage ``stage`` runs (eager or compiled)."""
        n = self.menu_size(stage)
        return self.menus[self.signatures[stage]].options[(k - 1) % n]

    def compilable(self, stage: int) -> bool:
        """Whether stage ``stage``'s menu options may be offered compiled: not where they add to
        residents' gradient sums (hierremat.blocks.joint.seeded_add branches on a missing sum)."""
        executors = self.executors[stage]
        return self.menu_size(stage) > 0 and not executors[1].joint.resident_seeds

    def is_compiled_index(self, stage: int, k: int) -> bool:
        """Whether option k of stage ``stage`` is a menu option's compiled form (never where the
        stage has no menu: the fused head, the output stage's option 1, is not one)."""
        n = self.menu_size(stage)
        return n > 0 and k > n

    def option_key(self, stage: int, k: int) -> tuple[str, str]:
        """(signature, option name): what ``compiled`` and ``compile_failed`` are keyed by."""
        return self.signatures[stage], self.option(stage, k).name

    def compiled_scale(self, signature: str) -> float | None:
        """Measured seconds of the signature's compiled options per second of their node-time sums
        (the largest ratio of those measured), or None when none is compiled."""
        ratios = [
            (costs.fwd_time + costs.bwd_time) / program.option.total_time
            for (sig, _), (program, costs) in self.compiled.items()
            if sig == signature and costs is not None and program.option.total_time > 0
        ]
        return max(ratios) if ratios else None

    def forward_executor(self, stage: int, form: str):
        """What runs F_none / F_ck of ``stage`` in ``form`` (StageCosts.nograd_form): a
        ForwardExecutor for "generated", None (the stage itself) for "autograd"."""
        if form == "autograd":
            return None
        executor = self.forward_executors[stage] if stage < len(self.forward_executors) else None
        compiled = self.compiled_forwards.get(self.signatures[stage]) if executor is not None else None
        if form == "generated" and executor is not None:
            return executor
        if form == "compiled" and compiled is not None:
            from ..runtime.compiled_option import CompiledForwardExecutor  # loaded with compiling

            return CompiledForwardExecutor(compiled[0], executor.binding)
        raise ValueError(f"stage {stage} has no {form!r} forward without grad: plan it again")

    def _output_fits_menu(self, stage: int, costs) -> bool:
        """Whether the chain sees stage ``stage``'s output as its menu does: always but for the
        last stage, whose output is the chain's (ChainCosts.activation_bytes[-1], which holds
        what it exports beside it) and whose gradient may be partial (output_grad_bytes); its
        menu options apply where both are the one tensor its graph returns (the output's
        storage: an in-place result's is its argument's)."""
        if stage < len(self.executors) - 1 or self.menu_size(stage) == 0:
            return True
        graph = self.menus[self.signatures[stage]].graph
        owner = graph.node(graph.output_name)
        names = {n.name for n in graph.nodes}
        while owner.alias_of:
            if owner.alias_of not in names:
                return False  # the output shares the stage input's storage
            owner = graph.node(owner.alias_of)
        grad_bytes = costs.activation_bytes[-1] if costs.output_grad_bytes is None else costs.output_grad_bytes
        return costs.activation_bytes[-1] == owner.out_bytes and grad_bytes == graph.output_grad_bytes

    def extend(self, profile: ChainProfile) -> ChainProfile:
        """The profile with each stage's menu options appended after option 0, times calibrated;
        with ``compile``, followed by the same options compiled. A stage whose generated
        no-grad forward is faster than autograd's, and peaks no higher, runs F_none / F_ck so;
        one that peaks lower but is slower is kept as the stage's leaner form (plans use it
        where the faster one does not fit: hierremat.planning.chain_plan.plan_from_profile).

        A compiled option has the costs measured on its compiled form; one not compiled yet is
        priced at the ILP's memory and the speed its signature's compiled options showed
        (hierremat.planning.compiled compiles it if the plan then picks it, and plans again)."""
        stages = []
        for i, (stage_costs, signature) in enumerate(zip(profile.costs.stages, self.signatures)):
            n = self.menu_size(i) if self._output_fits_menu(i, profile.costs) else 0
            if n == 0:  # no menu, or none runnable here (the last stage: its other form, if any)
                output = self.output_option if i == len(self.executors) - 1 else None
                if output is not None and output[1] == profile.output_grad_mask:
                    stage_costs = replace(stage_costs, options=(stage_costs.options[0], output[0]))
                stages.append(stage_costs)
                continue
            menu = self.menus[signature]
            base = stage_costs.options[0]
            node_total = sum(nd.time for nd in menu.graph.nodes)
            speeds = self.speeds.get(signature)
            # measured speeds price the generated code as it runs: faster or slower than autograd
            # (option 0). Unmeasured, it is priced as autograd and a hair slower, so that an
            # option that keeps what autograd keeps never wins a tie against option 0.
            as_autograd = (base.fwd_time + base.bwd_time) / node_total if node_total > 0 else 1.0
            scale = speeds.scale if speeds is not None else as_autograd * (1 + TIE_MARGIN)
            extra = [_scaled(o.to_option_costs(), scale) for o in menu.options]
            compiled_scale = self.compiled_scale(signature)
            if self.compile and compiled_scale is not None and self.compilable(i):
                for o in menu.options:
                    entry = self.compiled.get((signature, o.name))
                    if entry is not None and entry[1] is not None:
                        extra.append(entry[1].to_option_costs(o))
                    elif (signature, o.name) in self.compile_failed:
                        extra.append(_scaled(o.to_option_costs(), scale))
                    else:
                        extra.append(replace(_scaled(o.to_option_costs(), compiled_scale), name=f"{o.name}+compiled?"))
            stage_costs = replace(stage_costs, options=(base, *(_priced_within_noise(o, base) for o in extra)))
            out_bytes = profile.costs.activation_bytes[i + 1]
            forms = {}
            forward = self.forwards.get(signature)
            if forward is not None and speeds is not None:
                forms["generated"] = (speeds.forward_seconds, max(forward.peak_bytes, out_bytes))
            compiled_forward = self.compiled_forwards.get(signature)
            if self.compile and compiled_forward is not None and compiled_forward[1] is not None:
                seconds, peak = compiled_forward[1]
                forms["compiled"] = (seconds, max(peak, out_bytes))
            stages.append(_with_forward_forms(stage_costs, forms))
        return replace(profile, costs=replace(profile.costs, stages=tuple(stages)))


def _with_forward_forms(costs, forms: dict):
    """``costs`` (StageCosts, measured with the stage called without grad) running F_none / F_ck
    in the fastest of ``forms`` (form -> (seconds, peak bytes)) that peaks no higher than the
    stage called without grad, so that a faster form never raises a plan's memory; and with the
    leanest form as ``leaner_nograd`` where it peaks lower than that but runs slower. Which form
    is fastest is measured, so it may change between profiles; the leanest form is not, so the
    smallest feasible budget (planned with the leaner forms) does not move with times."""
    if costs.nograd_form != "autograd":
        return costs
    autograd = (costs.nograd_fwd_time, costs.nograd_fwd_overhead_bytes)
    fitting = [(seconds, peak, form) for form, (seconds, peak) in forms.items() if peak <= autograd[1]]
    fastest = min(fitting, default=None)
    if fastest is not None and fastest[0] < autograd[0]:
        seconds, peak, form = fastest
        costs = replace(
            costs, nograd_fwd_time=seconds, nograd_fwd_overhead_bytes=peak, nograd_form=form, autograd_nograd=autograd
        )
    leanest = min(fitting, key=lambda f: (f[1], f[0]), default=None)
    if leanest is not None and leanest[1] < costs.nograd_fwd_overhead_bytes:
        seconds, peak, form = leanest
        costs = replace(costs, leaner_nograd=(form, seconds, peak))
    return costs


def _scaled(option: OptionCosts, scale: float) -> OptionCosts:
    return replace(option, fwd_time=option.fwd_time * scale, bwd_time=option.bwd_time * scale)


def _priced_within_noise(option: OptionCosts, base: OptionCosts) -> OptionCosts:
    """``option``, priced as autograd's ``base`` and a hair more where it saves no memory over it (no figure
    lower, no pin fewer) and is faster by less than NOISE_MARGIN: the two then differ by less than the
    timing noise, and which one a plan took would change from one profile to the next (the same model
    planned twice, on meta and materialized, would run different code for no measurable gain). Autograd
    wins there; where the option saves memory it keeps its measured time."""
    no_leaner = (
        option.kept_bytes >= base.kept_bytes and option.fwd_overhead_bytes >= base.fwd_overhead_bytes
        and option.bwd_overhead_bytes >= base.bwd_overhead_bytes
        and option.pins_input >= base.pins_input and option.pins_output >= base.pins_output
    )
    time, autograd = option.fwd_time + option.bwd_time, base.fwd_time + base.bwd_time
    if not no_leaner or time <= 0 or time <= autograd * (1 - NOISE_MARGIN):
        return option
    return _scaled(option, max(1.0, autograd * (1 + TIE_MARGIN) / time))


def rebind(joint: JointGraph, stage: torch.nn.Module) -> JointGraph:
    """The joint graph of one stage, bound to another stage of the same signature.

    Parameters and buffers are matched by position (same structure, same shapes).
    """
    if stage is joint.stage:
        return joint

    def mapping(named_a, named_b, what: str) -> dict[str, str]:
        a, b = list(named_a), list(named_b)
        if len(a) != len(b) or any(x.shape != y.shape for (_, x), (_, y) in zip(a, b)):
            raise ValueError(f"stages with one signature differ in their {what}")
        return {na: nb for (na, _), (nb, _) in zip(a, b)}

    params = mapping(joint.stage.named_parameters(remove_duplicate=False), stage.named_parameters(remove_duplicate=False), "parameters")
    buffers = mapping(joint.stage.named_buffers(remove_duplicate=False), stage.named_buffers(remove_duplicate=False), "buffers")
    return replace(
        joint,
        stage=stage,
        param_inputs={k: params[v] for k, v in joint.param_inputs.items()},
        buffer_inputs={k: buffers[v] for k, v in joint.buffer_inputs.items()},
        param_grad_names={params[k]: v for k, v in joint.param_grad_names.items()},
        mutations=tuple((n, buffers[t]) for n, t in joint.mutations),
    )


class BackwardRecipeUnknown(ValueError):
    """A stage whose backward autocast changes, planned before the caller's recipe is known."""


def exact_under_autocast(
    joint: JointGraph, stage, x: torch.Tensor, shared: tuple, input_grad: bool, autocast: AutocastState,
    resident_grads: tuple[int, ...] = (), backward_autocast: bool | None = None,
) -> None:
    """Raise ValueError where ``joint``, traced under autocast for the caller's recipe ``backward_autocast``,
    cannot reproduce eager autocast bitwise.

    * A parameter cast more than once: eager autocast casts it once per context and sums its
      low-precision gradients before casting them back; the traced graph casts per use.
    * A backward that autocast changes: eager runs the backward under autocast when one
      context spans forward and backward, and without it when the context closed after the
      forward (the recipe of torch's AMP docs). Tracing it the first way can give another graph
      (on CPU, attention with dropout runs SDPA's math path, whose fp32 matmuls autocast casts in
      the backward): then the stage's gradients depend on the recipe. ``backward_autocast`` True
      or False: the caller's backward runs under autocast or outside it, and ``joint`` was traced
      so; None: not known yet (``joint`` traced the second way), BackwardRecipeUnknown where the
      two graphs differ (the runtime sees the recipe at the first backward: hierremat.runtime.executor).
    """
    recast = params_cast_more_than_once(joint)
    if recast:
        raise ValueError(f"autocast casts parameter(s) {', '.join(recast)} more than once")
    if backward_autocast is not None:
        return
    under = trace_joint(stage, x, shared, input_requires_grad=input_grad, autocast=autocast,
                        backward_under_autocast=True, resident_grads=resident_grads)
    if under.module.code != joint.module.code:
        raise BackwardRecipeUnknown(
            "autocast would change its backward when one context spans forward and backward, and the caller's recipe "
            "is not known yet (seen at the first backward)"
        )


def params_cast_more_than_once(joint: JointGraph) -> list[str]:
    """Parameters that more than one forward ``_to_copy`` node of the joint graph reads."""
    casts: dict[str, int] = {}
    for node in joint.module.graph.find_nodes(op="call_function", target=torch.ops.aten._to_copy.default):
        source = node.args[0]
        if joint.phase.get(node.name) == FORWARD and isinstance(source, torch.fx.Node):
            target = joint.param_inputs.get(source.name)
            if target is not None:
                casts[target] = casts.get(target, 0) + 1
    return sorted(name for name, count in casts.items() if count > 1)


def stage_inputs(stages: Sequence, x0: torch.Tensor, shared: tuple, residents=None) -> list[torch.Tensor]:
    """x_0 .. x_{L-1}: each stage's input, by running the chain without grad (RNG and buffers restored).
    residents: the chain's ResidentLayout (hierremat.plans.stage_info), or None."""
    return stage_arguments(stages, x0, shared, residents)[0]


def stage_arguments(stages: Sequence, x0: torch.Tensor, shared: tuple, residents=None,
                    signatures: Sequence[str] | None = None) -> tuple[list[torch.Tensor], list[tuple]]:
    """(x_0 .. x_{L-1}, what each stage is called with after x: the shared values, then the
    residents made before it, None for the others), as :func:`stage_inputs` runs the chain.
    signatures: where given, a stage whose signature ran before and that makes no residents is not run
    again: the first one's output stands for its (the same shape: what menus are built from)."""
    xs = [x0.detach()]
    values: dict[int, torch.Tensor] = {}
    shareds = []
    outputs_of: dict[str, object] = {}
    autocast = AutocastState.capture((x0.device.type,))
    with no_side_effects(stages, x0), torch.no_grad():
        for i, stage in enumerate(stages):
            shareds.append(stage_shared(shared, values, residents))
            if i == len(stages) - 1:
                break
            makes = residents is not None and residents.produced_by(i)
            if signatures is not None and not makes and signatures[i] in outputs_of:
                xs.append(outputs_of[signatures[i]])
                continue
            with autocast.stage_scope():
                out = stage(xs[-1], *shareds[-1])
            if signatures is not None and not makes:
                outputs_of[signatures[i]] = out
            y, made = split_output(out, residents, i)
            keep_made(values, residents, i, made)
            xs.append(y)
    return xs, shareds


def resident_positions(residents, stage: int, shared: tuple) -> tuple[int, ...]:
    """Positions in ``shared`` (from :func:`stage_arguments`) of the floating residents stage
    ``stage`` reads: the inputs its joint graph takes with a gradient."""
    if residents is None:
        return ()
    positions = (residents.shared_count + r for r in residents.read_by(stage))
    return tuple(j for j in positions if isinstance(shared[j], torch.Tensor) and shared[j].is_floating_point())


def module_signature(stage, x: torch.Tensor) -> str:
    """A structural key for a stage of a plain chain (no captured graph to hash): per module
    in it, its class and the code of its forward, its plain attributes (sizes, flags,
    probabilities, lists of such: what a forward may branch on beyond its parameters), its
    printed configuration, its parameter and buffer shapes and dtypes, its mode; the input's
    shape and dtype, and the autocast setting. Equal keys trace to equal joint graphs, so
    stages with equal keys share one traced graph, menu and generated code."""
    autocast = AutocastState.capture((x.device.type,)).key()
    parts = [type(stage).__qualname__, repr(stage), str(tuple(x.shape)), str(x.dtype), autocast]
    if isinstance(stage, torch.nn.Module):
        parts.append(str(stage.training))
        parts += [f"{n}:{tuple(t.shape)}:{t.dtype}:{t.requires_grad}" for n, t in stage.named_parameters()]
        parts += [f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in stage.named_buffers()]
        for name, module in stage.named_modules():
            cls = type(module)
            parts.append(f"{name}:{cls.__module__}.{cls.__qualname__}:{_code_digest(cls.forward)}")
            parts += [f"{name}.{k}={v!r}" for k, v in sorted(vars(module).items())
                      if not k.startswith("_") and _plain(v)]
    else:
        parts.append(_code_digest(stage))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _plain(value) -> bool:
    """Numbers, strings, flags, None, and tuples/lists/dicts of them: values whose repr is their content."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def _code_digest(function) -> str:
    """A digest of a function's bytecode and constants (nested code objects included), the same in
    every process; '' for callables without Python code."""
    code = getattr(function, "__code__", None) or getattr(getattr(function, "__call__", None), "__code__", None)
    digest = hashlib.sha256()

    def add(c) -> None:
        digest.update(c.co_code)
        digest.update(repr(c.co_names).encode())
        for const in c.co_consts:
            if hasattr(const, "co_code"):
                add(const)
            else:
                digest.update(repr(const).encode())

    if code is None:
        return ""
    add(code)
    return digest.hexdigest()[:16]


def build_menus(
    stages: Sequence[torch.nn.Module],
    x0: torch.Tensor,
    shared: tuple,
    signatures: Sequence[str] | None,
    *,
    cache: OptionsCache | None = None,
    stored: dict[str, StageMenu] | None = None,
    time_limit: float = MENU_TIME_LIMIT,
    deadline: float | None = None,
    variants: bool = True,
    residents=None,
    recompute_across_dropouts: bool = True,
    fitted: "ShapeFit | None" = None,
    blocks: bool = True,
    backward_autocast: bool | None = None,
    arguments: tuple | None = None,
    programs: FamilyPrograms | None = None,
) -> ChainMenus:
    """Trace, profile and solve (or load) the menu of every distinct stage signature.

    signatures: one structural key per stage (None: :func:`module_signature` of each).
    stored: menus to use as they are (from a saved plan), by signature.
    cache: where solved menus are looked up and stored (default: hierremat's default cache).
    time_limit: seconds per ILP solve; deadline: a ``time.perf_counter()`` value no solve
    runs past (menus then hold what was found in time: hierremat.ilp.options.solve_menu).
    variants: rewrite the traced graphs with hierremat's operator variants
    (hierremat.blocks.variants: packed dropout and ReLU masks, recomputable dropout outputs, in-place
    pointwise operators).
    residents: the chain's ResidentLayout (hierremat.plans.stage_info), or None. A stage that reads
    residents traces them as inputs with a gradient (hierremat.blocks.joint: its options add
    their terms to the gradient sums); a stage that makes residents gets no menu (option 0
    only), nor does the output stage its fused head when it touches residents.
    recompute_across_dropouts: False where a stage is a whole model (``segmentation="none"``):
    its ILP's recomputation stops at dropouts (hierremat.ilp.formulation.structure).
    fitted: at an input shape whose times are fitted from shapes measured before
    (hierremat.planning.shape_fit): node times and executor speeds come from it, not measured
    (on CPU, where node workspace is not seen anyway), where it has them for a stage.
    blocks: False builds the output stage's fused head alone (no stage traced: where block options
    cannot pay, hierremat.api.shape_planning.profile_and_solve).
    backward_autocast: under autocast, whether the caller runs the backward under it too (None: not known;
    stages whose backward it changes then get no menu, ChainMenus.recipe_dependent: exact_under_autocast).
    arguments: the stages' arguments as stage_arguments gives them for ``signatures``, where computed already.
    programs: the stages' family's joint graphs traced with symbolic sizes and their programs
    (hierremat.planning.family_programs), where the stages run a size-generic chain: a stage whose family has one
    costs its options on it and runs its programs (traced nowhere here); one whose family has none traces its own
    here, and gives the family one where it gets a menu.
    """
    request = _MenuRequest(cache if cache is not None else default_cache(), stored, time_limit, deadline, variants,
                           residents, recompute_across_dropouts, fitted, backward_autocast, programs)
    return _ChainMenuBuild(request, stages, x0, shared, signatures, arguments).run(blocks)


@dataclass(frozen=True)
class _MenuRequest:
    """What :func:`build_menus` was asked, beside the stages and their inputs (its docstring says what each means)."""

    cache: OptionsCache
    stored: dict[str, StageMenu] | None
    time_limit: float
    deadline: float | None
    variants: bool
    residents: object
    recompute_across_dropouts: bool
    fitted: "ShapeFit | None"
    backward_autocast: bool | None
    programs: FamilyPrograms | None


class _ChainMenuBuild:
    """One :func:`build_menus` call: the chain's stages, and the menus, graphs and executors made for them so far."""

    def __init__(self, request: _MenuRequest, stages, x0: torch.Tensor, shared: tuple, signatures, arguments):
        self.started = time.perf_counter()
        self.request, self.stages, self.x0, self.shared = request, stages, x0, shared
        self.cost_cache = StageCostCache(request.cache)
        self.xs, self.shareds = arguments or stage_arguments(stages, x0, shared, request.residents, signatures)
        if signatures is None:
            signatures = [module_signature(stage, x) for stage, x in zip(stages, self.xs)]
        if not x0.requires_grad:  # the first stage's graph has no input gradient: a menu of its own
            signatures = [f"{signatures[0]}-no-input-grad", *signatures[1:]]
        self.signatures = list(signatures)
        self.menus: dict[str, StageMenu] = {}
        self.joints: dict[str, JointGraph | None] = {}
        self.graph_keys: dict[str, str] = {}
        self.executors: list[list] = [[None] for _ in stages]
        self.generated: dict[str, list[GeneratedOption]] = {}  # one program per (signature, option), made when first run
        self.forwards: dict[str, ForwardOnly] = {}  # one no-grad forward per signature
        self.generated_forwards: dict[str, GeneratedForward] = {}  # its program, made when first run
        self.family_keys: dict[str, tuple] = {}  # signature -> its stage's key in ``programs``
        self.shared_code: set[str] = set()  # signatures whose joint graph and programs are their family's
        self.forward_executors: list = [None] * len(stages)
        self.speeds: dict[str, ExecutorSpeeds] = {}
        self.recipe_dependent: list[str] = []
        self.modelled: list[str] = []  # signatures whose node costs were modelled: the deadline had passed
        self.timed_once: list[str] = []  # signatures whose executors were timed from one run: the same
        self.autocast = AutocastState.capture((x0.device.type,))
        # (a device's alone: its stages are refused before they are traced)
        self.replay_inexact = self.autocast.enabled and x0.device.type not in AUTOCAST_EXACT_DEVICE_TYPES
        self.output_option = None
        self.output_shared = False  # (the fused head is the family's: made once from its generic last stage)

    def run(self, blocks: bool) -> ChainMenus:
        """Every stage's menu and executors (the fused head's alone where ``blocks`` is False)."""
        solves_before = solve_count()
        self._fused_head()
        # the last stage gets a menu too where it returns one tensor and has no fused head (a
        # chain of identical blocks: the last block's menu is the others')
        menu_stages = (self.stages if self.output_option is None else self.stages[:-1]) if blocks else []
        for i, (stage, signature) in enumerate(zip(menu_stages, self.signatures)):
            self._stage(i, stage, signature)
        request = self.request
        return ChainMenus(
            self.menus, self.executors, tuple(self.signatures), solve_count() - solves_before,
            time.perf_counter() - self.started, self.speeds,
            forwards=self.forwards, forward_executors=self.forward_executors,
            output_option=self.output_option, residents=request.residents,
            recipe_dependent=tuple(self.recipe_dependent),
            backward_autocast=request.backward_autocast if self.autocast.enabled else None,
            shared_code=frozenset(self.shared_code), output_shared=self.output_shared,
            modelled=tuple(self.modelled), timed_once=tuple(self.timed_once),
        )

    def _fused_head(self) -> None:
        """The output stage's fused head, where the variants are on and it touches no residents."""
        request, last = self.request, len(self.stages) - 1
        if not request.variants or (request.residents is not None and request.residents.touches(last)):
            return
        programs = request.programs
        make = fused_head_stage if programs is None else lambda _: programs.fused_head()
        fused = fused_head_option(self.stages, self.xs[-1], self.shared, self.signatures[-1], self.cost_cache, make)
        if fused is not None:
            self.output_option, self.executors[-1] = fused[:2], [None, fused[2]]
            self.output_shared = programs is not None

    def _stage(self, i: int, stage, signature: str) -> None:
        """Stage ``i``'s menu (traced and solved once per signature), its executors and their speeds."""
        residents = self.request.residents
        if residents is not None and residents.produced_by(i):
            log.info("stage %d (%s): no block options: it makes values carried beside the chain", i, signature)
            return
        if isinstance(getattr(stage, "graph_module", None), fx.GraphModule) and has_value_branch(stage.graph_module):
            log.info("stage %d (%s): no block options: it branches on tensor values (an attention mask)", i, signature)
            return
        if signature not in self.joints and _returns_several_tensors(stage):  # (known without tracing it)
            log.info("stage %d (%s): no block options: the stage returns several tensors", i, signature)
            self.joints[signature] = None
            return
        if signature not in self.joints:
            self._solve(i, stage, signature)
        joint, menu = self.joints.get(signature), self.menus.get(signature)
        if joint is not None and menu is not None:
            self._bind(i, stage, signature, joint, menu)
            self._time_executors(i, stage, signature)

    def _trace(self, i: int, stage, signature: str, trace_options: dict) -> tuple[JointGraph, BlockGraph]:
        """Stage ``i``'s joint graph (its family's where it has one) and block graph; raises where it has none."""
        if not isinstance(stage, torch.nn.Module):
            raise TypeError("it is a plain callable, not an nn.Module")
        if self.replay_inexact:
            raise ValueError(f"under autocast on {self.x0.device.type}, a replayed graph is not known to give eager "
                             "autocast's gradients bitwise (AUTOCAST_EXACT_DEVICE_TYPES)")
        request, x, shared = self.request, self.xs[i], self.shareds[i]
        programs = request.programs
        joint = programs.joint_at(self.family_keys[signature], x, shared) if programs is not None else None
        if joint is None:
            joint = trace_joint(stage, x, shared, **trace_options)
            if self.autocast.enabled:
                exact_under_autocast(joint, stage, x, shared, trace_options["input_requires_grad"], self.autocast,
                                     trace_options["resident_grads"], request.backward_autocast)
            if request.variants:
                joint = _with_variants(joint)
        else:
            self.shared_code.add(signature)
        if len(joint.output_names) != 1 or len(joint.tangent_names) != 1:
            raise ValueError("the stage returns several tensors")
        graph = to_block_graph(joint)
        output = graph.node(joint.output_names[0])
        if output.op == "getitem" and output.alias_of:
            # the output shares one value with the op's other results (a lone dropout's
            # mask): the chain's model of a stage output as a value of its own breaks
            raise ValueError("the stage's output is one result of a multi-output operator")
        return joint, graph

    def _solve(self, i: int, stage, signature: str) -> None:
        """Trace stage ``i`` and solve (or load) its menu; a stage that cannot be traced keeps option 0."""
        request, x, shared = self.request, self.xs[i], self.shareds[i]
        input_grad = i > 0 or self.x0.requires_grad
        reads = resident_positions(request.residents, i, shared)
        trace_options = dict(input_requires_grad=input_grad, autocast=self.autocast, resident_grads=reads,
                             backward_under_autocast=bool(request.backward_autocast))
        self.family_keys[signature] = (i, input_grad, reads, self.autocast.describe(), request.backward_autocast,
                                       request.variants)
        try:
            joint, graph = self._trace(i, stage, signature, trace_options)
        except Exception as err:  # tracing failures leave the stage with option 0
            if isinstance(err, BackwardRecipeUnknown):
                self.recipe_dependent.append(signature)
            log.info("stage %d (%s): no block options: %s", i, signature, err)
            self.joints[signature] = None
            return
        self.joints[signature] = joint
        self.graph_keys[signature] = key = _graph_key(signature, graph)  # menus and speeds of the traced graph
        menu_key = key if request.recompute_across_dropouts else f"{key}+cut-at-dropouts"
        name = getattr(stage, "stage_name", type(stage).__name__)
        fitted = request.fitted
        node_costs = fitted.node_costs(i, joint) if fitted is not None and self.x0.device.type == "cpu" else None
        measured = not clock.passed(request.deadline)  # (past it: node costs modelled, the heuristic menu)
        menu = _menu(joint, x, shared, signature, menu_key, request.cache, request.stored, request.time_limit,
                     request.deadline, name, request.recompute_across_dropouts, node_costs, measured)
        if menu is not None and not measured:
            self.modelled.append(signature)
        if menu is None:
            return
        self.menus[signature] = menu
        if request.programs is not None and signature not in self.shared_code:  # (the family's graph for every shape)
            request.programs.adopt(self.family_keys[signature], joint, x, shared,
                                   _with_variants if request.variants else lambda j: j, graph_structure,
                                   **trace_options)

    def _bind(self, i: int, stage, signature: str, joint: JointGraph, menu: StageMenu) -> None:
        """Stage ``i``'s option executors and no-grad forward, over programs made once per signature."""
        family_code = signature in self.shared_code
        programs = self.request.programs
        bound = rebind(joint, programs.stages[i] if family_code else stage)  # (the family's: the same parameters)
        if signature not in self.generated:
            mutations = frozenset(node for node, _ in joint.mutations)
            self.forwards[signature] = forward_only(menu.graph, also=mutations)
            if family_code:
                key = self.family_keys[signature]
                self.generated[signature] = [programs.option(key, joint, option) for option in menu.options]
                self.generated_forwards[signature] = programs.forward(key, joint, self.forwards[signature])
            else:
                self.generated[signature] = [GeneratedOption(joint, option) for option in menu.options]
                self.generated_forwards[signature] = GeneratedForward(joint, self.forwards[signature])
        binding = StageBinding(bound)
        self.executors[i] = [None] + [
            OptionExecutor(bound, option, program, binding)
            for option, program in zip(menu.options, self.generated[signature])
        ]
        self.forward_executors[i] = ForwardExecutor(self.generated_forwards[signature], binding)

    def _time_executors(self, i: int, stage, signature: str) -> None:
        """The speeds of stage ``i``'s executors, once per signature: fitted, cached, or measured."""
        if signature not in self.speeds and self.request.fitted is not None:
            fitted_speeds = self.request.fitted.speeds(i)
            if fitted_speeds is not None:
                self.speeds[signature] = fitted_speeds
        if signature in self.speeds:
            return
        key, x = self.graph_keys[signature], self.xs[i]
        speeds = self.cost_cache.get_speeds(key, x)
        if speeds is None:
            rushed = clock.passed(self.request.deadline)  # (past it: one timed run, not cached)
            speeds = _executor_speeds(self.executors[i][1:], self.forward_executors[i], stage, self.stages, x,
                                      self.x0, self.shareds[i], repeats=1 if rushed else 3)
            if rushed:
                self.timed_once.append(signature)
            else:
                self.cost_cache.put_speeds(key, x, speeds)
        self.speeds[signature] = speeds


def _with_variants(joint: JointGraph) -> JointGraph:
    """``joint`` rewritten with hierremat's operator variants (hierremat.blocks.variants)."""
    return run_in_place(pack_relu_masks(pack_dropout_masks(joint)))


def _returns_several_tensors(stage) -> bool:
    """Whether a stage's graph returns more than one tensor (an output stage's loss and logits): a block
    graph has one output, so such a stage gets no menu, and tracing its joint graph would be wasted."""
    gm = getattr(stage, "graph_module", None)
    if not isinstance(gm, fx.GraphModule):
        return False
    (output,) = gm.graph.find_nodes(op="output")
    values = {a for a in pytree.tree_leaves(output.args) if isinstance(a, fx.Node)}
    return sum(isinstance(v.meta.get("val"), torch.Tensor) for v in values) > 1


def _warn_solver_failure(signature: str, err: Exception) -> None:
    """One warning per planner session for a failing ILP solver; later failures are logged at INFO."""
    what, failures = f"{type(err).__name__}: {err}", current_session().solver_failures
    (log.info if failures else log.warning)(
        "the block ILP for stage signature %s failed (%s): that block runs autograd's option only%s", signature,
        what, "" if failures else " (further failures of this planner session are logged at INFO)",
    )
    failures.append(what)


def _executor_speeds(executors, forward, stage, stages, x, x0, shared, repeats: int = 3) -> ExecutorSpeeds:
    """Measured speeds of a stage's generated code: the menu's fastest option (forward + backward)
    per second of its node-time sum, and the no-grad forward's seconds (the least of its runs after one
    warm-up; RNG, buffers and ``.grad`` left as they were)."""
    executor = min(executors, key=lambda e: e.option.total_time)
    y_meta = None

    def run():
        nonlocal y_meta
        y, tape = executor.forward(x, shared)
        y_meta = y_meta if y_meta is not None else torch.ones_like(y)
        executor.backward(tape, y_meta, shared)

    with no_side_effects(stages, x0), scratch_grads(stage):
        forward(x, shared)  # warm-up
        forward_seconds = timed_seconds(lambda: forward(x, shared), repeats, x.device)
        if executor.option.total_time <= 0:
            return ExecutorSpeeds(1.0, forward_seconds)
        run()  # warm-up
        seconds = timed_seconds(run, repeats, x.device)
    return ExecutorSpeeds(seconds / executor.option.total_time, forward_seconds)


@contextlib.contextmanager
def _progress_bar(description: str):
    """A tqdm bar (when tqdm is installed and stderr is a terminal) advanced once per ILP solve."""
    try:
        from tqdm import tqdm
    except ImportError:
        yield lambda text: log.debug("%s: %s", description, text)
        return
    with tqdm(desc=description, unit="solve", disable=None, leave=False) as bar:
        def advance(text: str) -> None:
            bar.update(1)
            bar.set_postfix_str(text, refresh=False)
            log.debug("%s: %s", description, text)

        yield advance


def graph_structure(graph: BlockGraph, sizes: bool = True) -> tuple:
    """Everything of a BlockGraph but its measured costs: equal structures, interchangeable menus.
    sizes=False leaves the bytes out too: equal then for one block at two input shapes, whose
    menus are re-costed from each other (:func:`_recosted_menu`)."""
    return tuple(
        (n.name, n.op, n.phase, n.inputs, n.out_bytes if sizes else None, n.alias_of, n.random, n.in_place)
        for n in graph.nodes
    ) + (graph.input_name, graph.output_name, graph.output_grad_name, graph.input_grad_name, graph.held_grad_names)


def _graph_key(signature: str, graph: BlockGraph) -> str:
    """The cache key of a stage's traced graph (menus, executor speeds): its signature and a
    digest of the graph's structure as the variants left it, so that graphs rewritten
    differently (variants on or off, another torch) never share or overwrite an entry."""
    digest = hashlib.sha256(repr(graph_structure(graph)).encode()).hexdigest()[:16]
    return f"{signature}/{digest}"


def _family_key(graph: BlockGraph, recompute_across_dropouts: bool) -> str:
    """The cache signature of a block's menus at every size: a digest of its structure without bytes
    (:func:`graph_structure`); the entry names the key of the menu solved last, at whatever sizes."""
    digest = hashlib.sha256(repr(graph_structure(graph, sizes=False)).encode()).hexdigest()[:16]
    return f"any-shape/{digest}" + ("" if recompute_across_dropouts else "+cut-at-dropouts")


def _solved_at_other_sizes(cache: OptionsCache, family: CacheKey) -> dict | None:
    """The menu solved last for this block structure at any sizes (a StageMenu dict), or None: the one
    the cache's any-shape entry names (None where that menu was since evicted or is damaged), or
    without a cache the one the planner session solved (PlannerSession.solved_menus)."""
    if not cache.enabled:
        solved = current_session().solved_menus.get(family.digest())
        return solved.to_dict() if solved is not None else None
    pointer = cache.get(family)
    try:
        return cache.get(CacheKey.from_dict(pointer["menu_key"])) if pointer is not None else None
    except (KeyError, TypeError, ValueError):
        return None


def _parsed_menu(payload: dict) -> StageMenu:
    """``StageMenu.from_dict(payload)``, the same object for the same payload while it is among the last
    hierremat.session.PARSED_MENUS parsed: every shape whose block options are re-costed from it then shares its
    options' op lists (recost_options replaces their costs alone), where each parsed its own (2 MiB a shape for a
    4-layer GPT-2)."""
    text, parsed = canonical_json(payload), current_session().parsed_menus
    menu = parsed.get(text)
    if menu is None:
        menu = StageMenu.from_dict(payload)
        parsed.put(text, menu)
    return menu


def _recosted_menu(graph: BlockGraph, payload: dict | None, signature: str) -> StageMenu | None:
    """The menu solved for this block at other sizes (``payload``, a cached StageMenu), its options
    re-costed on ``graph`` (hierremat.ilp.options.recost_options); None where there is none or it
    does not fit this graph (then the menu is solved)."""
    if payload is None:
        return None
    try:
        solved = _parsed_menu(payload)
        if graph_structure(solved.graph, sizes=False) != graph_structure(graph, sizes=False):
            return None
        options = recost_options(graph, solved.options)
    except (KeyError, TypeError, ValueError) as err:
        log.info("stage signature %s: the menu solved at other sizes does not re-cost here (%s); solving", signature, err)
        return None
    log.info("stage signature %s: %d options re-costed from the menu solved at other sizes", signature, len(options))
    return StageMenu(graph, tuple(options), 0.0, solved.coarse, recosted=True)


def _menu(
    joint, x, shared, signature, key_signature, cache, stored, time_limit, deadline, name, recompute_across_dropouts,
    node_costs: dict | None = None, measured: bool = True,
) -> StageMenu | None:
    """The stage's menu: from a saved plan, else from the cache, else re-costed from the menu solved
    at other sizes, else solved (and cached, unless the planning deadline cut it short); None when
    solving fails (the stage then offers autograd's option only, with a warning). name: the
    stage's, for the progress bar. node_costs: fitted node costs (name -> (seconds, workspace
    bytes)) to re-cost with instead of measuring; a menu re-costed with them is not cached. measured: False
    models node costs from FLOPs and bytes (hierremat.runtime.node_profile's "flops": the planning deadline has
    passed); a menu costed so is not cached.

    A saved or cached menu is used only if its block graph has the structure of the one
    traced now (op lists name nodes of that graph)."""
    unprofiled = to_block_graph(joint)
    structure = graph_structure(unprofiled)
    if stored is not None and signature in stored:
        menu = stored[signature]
        if graph_structure(menu.graph) == structure:
            return menu
        raise ValueError(f"the saved plan's options for stage signature {signature} do not match the traced graph")
    key = CacheKey(
        signature=key_signature,
        device_type=x.device.type,
        device_name=device_name(x.device),
        dtype=str(x.dtype) if x.is_floating_point() else "int",
        cost_model_version=f"{COST_MODEL_VERSION}/torch-{torch.__version__}",
        formulation_version=FORMULATION_VERSION,
    )
    # the menu last solved for this block at any sizes: options re-costed from it where no menu was solved at these
    family = replace(key, signature=_family_key(unprofiled, recompute_across_dropouts))
    payload = cache.get(key)
    if payload is not None:
        try:
            menu = StageMenu.from_dict(payload)
            if graph_structure(menu.graph) == structure:
                return menu
            log.warning("cached options for %s do not match the traced graph; solving again", signature)
        except (KeyError, TypeError, ValueError) as err:
            log.warning("cached options for %s are unreadable (%s); solving again", signature, err)
    solved_before = _solved_at_other_sizes(cache, family)
    if solved_before is not None and node_costs is not None:
        recosted = _recosted_menu(to_block_graph(joint, node_costs), solved_before, signature)
        if recosted is not None:
            return recosted
    graph = to_block_graph(joint, profile_nodes(joint, x, shared, method="measure" if measured else "flops"))
    recosted = _recosted_menu(graph, solved_before, signature)
    if recosted is not None:
        if measured:
            cache.put(key, recosted.to_dict())  # a later plan at these sizes measures nothing again
        return recosted
    try:
        with _progress_bar(f"hierremat: block {name} ({signature})") as advance:
            solved = solve_menu(graph, time_limit=time_limit, progress=advance, label=signature, deadline=deadline,
                                recompute_across_dropouts=recompute_across_dropouts)
    except Exception as err:  # a solver that errors (HiGHS failing, a broken install): plan without the menu
        _warn_solver_failure(signature, err)
        return None
    menu = StageMenu(graph, tuple(solved.options), solved.solve_seconds, solved.coarse)
    if measured and not solved.cut_by_deadline:
        cache.put(key, menu.to_dict())
        cache.put(family, {"menu_key": key.to_dict()})
        if not cache.enabled:
            current_session().solved_menus.put(family.digest(), menu)
    log.info("stage signature %s: %d options from %d ILP solves in %.2f s", signature, len(menu.options), solved.n_solves, solved.solve_seconds)
    return menu
