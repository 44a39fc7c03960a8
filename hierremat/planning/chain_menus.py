"""The menus a chain's stages offer the chain DP, and how their options are priced.

ChainMenus holds, per stage, option 0 (the stage under autograd, profiled as a whole) and its menu's options
k = 1.. (generated code, hierremat.runtime.block_exec), optionally followed by the same options compiled
(hierremat.planning.compiled); ``ChainMenus.extend`` appends them to a profile for the DP.

Cost model: an option's times are sums of per-node times, measured one op at a time;
the whole-stage profile of option 0 is measured as one call, under autograd. To put both
on one scale, menu times are multiplied per signature by the measured time of one of its
options as the generated code really runs it (forward + backward, the least of a few runs)
over that option's node-time sum: the code's own overhead, and kernels that are slower
(or faster) in the decomposed graph than in eager autograd, are then priced in, so the
DP picks autograd's option 0 or the generated code by what each really costs. The
generated forward without grad is timed the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Sequence

from ..plans.block_graph import BlockGraph
from ..plans.block_options import BlockOption
from ..plans.costs import OptionCosts
from ..blocks.joint import JointGraph
from ..runtime.profile import ChainProfile

#: Relative price added to executor options so that autograd wins ties (see ChainMenus.extend).
TIE_MARGIN = 1e-6
#: An option no leaner than autograd's (option 0) in any memory figure is taken only where it is faster by
#: more than this share of autograd's measured time (see _priced_within_noise).
NOISE_MARGIN = 0.03


@dataclass(frozen=True)
class StageMenu:
    """The solved menu of one stage signature: its block graph and options (node-time units).

    coarse: why the options are heuristic rather than the ILP sweep's ("" when they are the
    sweep's; see hierremat.plans.block_options.BlockOptions).
    recosted: True where the options were solved for this block at other sizes (another input
    shape) and re-costed on this graph (hierremat.ilp.options.recost_options), not solved for it.
    fitted: True where its graph's node costs were fitted from other shapes (hierremat.planning.shape_fit), not
    measured here (such a menu is never cached)."""

    graph: BlockGraph
    options: tuple[BlockOption, ...]
    solve_seconds: float
    coarse: str = ""
    recosted: bool = False
    fitted: bool = False

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
    #: signatures whose generated code's speeds were fitted from other shapes (hierremat.planning.shape_fit)
    fitted_speeds: tuple[str, ...] = ()

    def measured_here(self, signature: str) -> bool:
        """Whether the signature's menu has node costs and generated-code speeds measured in full at this shape:
        neither fitted from other shapes nor cut short by the planning deadline."""
        menu = self.menus.get(signature)
        return (menu is not None and not menu.fitted and signature in self.speeds
                and signature not in (*self.modelled, *self.timed_once, *self.fitted_speeds))

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
