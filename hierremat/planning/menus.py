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
form does not fit the budget (StageCosts.leaner_nograd). The menus' values and their pricing are
hierremat.planning.chain_menus; one stage's menu, cached or solved, hierremat.planning.menu_store; the stages'
arguments and signatures, hierremat.planning.stage_calls.

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

import logging
import time
from typing import Sequence

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ..plans import clock
from ..plans.block_graph import BlockGraph
from ..blocks.eager_masks import has_value_branch
from ..blocks.joint import JointGraph, to_block_graph, trace_joint
from ..store.cache import OptionsCache, default_cache
from ..ilp.options import MENU_TIME_LIMIT, forward_only
from ..plans.block_options import ForwardOnly
from ..ilp.solve import solve_count
from .autocast_exactness import AUTOCAST_EXACT_DEVICE_TYPES, BackwardRecipeUnknown, exact_under_autocast
from .chain_menus import ChainMenus, StageMenu
from .family_programs import FamilyPrograms
from .menu_store import MenuRequest, graph_key, graph_structure, stage_menu
from .output_stage import fused_head_option, fused_head_stage
from .shape_fit import ShapeFit
from .stage_calls import module_signature, rebind, resident_positions, stage_arguments
from ..device.autocast import AutocastState
from ..runtime.block_exec import ForwardExecutor, GeneratedForward, GeneratedOption, OptionExecutor
from ..runtime.option_codegen import StageBinding
from ..runtime.profile import timed_seconds, no_side_effects, scratch_grads
from ..runtime.stage_cost_cache import ExecutorSpeeds, StageCostCache
from ..blocks.variants.dropout import pack_dropout_masks
from ..blocks.variants.in_place import run_in_place
from ..blocks.variants.relu_masks import pack_relu_masks

log = logging.getLogger(__name__)


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
    request = MenuRequest(cache if cache is not None else default_cache(), stored, time_limit, deadline, variants,
                           residents, recompute_across_dropouts, fitted, backward_autocast, programs)
    return _ChainMenuBuild(request, stages, x0, shared, signatures, arguments).run(blocks)


class _ChainMenuBuild:
    """One :func:`build_menus` call: the chain's stages, and the menus, graphs and executors made for them so far."""

    def __init__(self, request: MenuRequest, stages, x0: torch.Tensor, shared: tuple, signatures, arguments):
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
        self.fitted_speeds: list[str] = []  # signatures whose executors' speeds were fitted from other shapes
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
            fitted_speeds=tuple(self.fitted_speeds),
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
        self.graph_keys[signature] = key = graph_key(signature, graph)  # menus and speeds of the traced graph
        menu_key = key if request.recompute_across_dropouts else f"{key}+cut-at-dropouts"
        name = getattr(stage, "stage_name", type(stage).__name__)
        fitted = request.fitted
        node_costs = fitted.node_costs(i, joint) if fitted is not None and self.x0.device.type == "cpu" else None
        measured = not clock.passed(request.deadline)  # (past it: node costs modelled, the heuristic menu)
        menu = stage_menu(request, joint, x, shared, signature, menu_key, name, node_costs, measured)
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
                self.fitted_speeds.append(signature)
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
