"""Cut a captured graph into a chain of stages.

1. Every compute node gets a *unit*: the outermost module in its ``nn_module_stack``
   that is a child of an ``nn.ModuleList``/``nn.Sequential`` (descending while that child
   is itself such a container), e.g. ``transformer.h.3`` in GPT-2 or ``layer2.0`` in a
   ResNet, or a block held beside others of its class outside any container (GoogLeNet's
   ``inception4a``, whose branches are containers). Nodes outside any container (embeddings, final norm, head, loss) get none.
   Maximal runs of nodes with the same unit, in graph order, are the candidate stages.
2. Values that depend on no parameter (trainable or frozen) and no input that requires
   grad, are not random and do not mutate (attention masks, position ids, rotary tables,
   shifted labels) and are used by a later stage are *precomputed* once before the chain
   and passed to every stage as shared inputs.
3. Between two stages one value flows forward as the carried activation. Other values may
   cross a cut as *residents* (segmentation 'blocks'): tensors made by one stage and read by
   later ones (an encoder's output read by every decoder layer, T5's position bias, a UNet's
   skip tensors), when exactly one value made by the stage before the cut is last read by
   the stage after it (that is the carry). Where no such value exists, the two stages are
   merged. The last stage produces what the model returns. A stage of more than
   MAX_STAGE_NODES nodes is split where one value alone crosses inside it (bounded block
   ILPs).
4. Each stage becomes a GraphModule ``stage(x, *shared, *residents)``; an orchestrator GraphModule
   with the model's calling convention runs the precompute nodes, then the chain
   (one ``call_module``), then assembles the outputs.

Each stage has a structural signature (hash of ops, argument structure, shapes and
dtypes; not of parameter names), so identical blocks share one key.
"""

from __future__ import annotations

import functools
import hashlib
import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ..plans.stage_info import ResidentLayout, StageInfo
from .boundary_writes import functionalize_boundary_writes
from .capture import CapturedModel
from .nodes import is_random, module_stack, target_name
from ..ops.max_pool import max_pool2d

CONTAINERS = (nn.ModuleList, nn.Sequential)
#: Name of the orchestrator's submodule that runs the chain.
CHAIN_ATTRIBUTE = "hierremat_chain"


@dataclass
class ChainGraph:
    """A model cut into a chain.

    stages: GraphModules called as ``stage(x, *shared)`` (the selected shared values, then residents).
    infos: one StageInfo per stage.
    orchestrator: GraphModule with the model's calling convention; it calls the chain
        through its submodule ``hierremat_chain`` as ``chain(x0, *shared)`` and expects
        a tuple of the last stage's outputs back, then the exported residents.
    residents: the values carried beside the activation (None: there are none). A stage
        producing residents returns ``(x_{i+1}, *its residents)``; a stage is called with
        ``shared`` followed by every resident (ResidentLayout).
    """

    stages: list[nn.Module]
    infos: list[StageInfo]
    orchestrator: fx.GraphModule
    residents: ResidentLayout | None = None

    @functools.cached_property
    def half_outputs_in_fp32_bytes(self) -> int:
        """Bytes of fp32 copies of the fp16 and bf16 tensors the model returns (the orchestrator's outputs, from
        their metadata), those inside tuples, lists and mappings (a ModelOutput), where accelerate's
        ``convert_to_fp32`` reaches (not a key/value cache object's): what a caller that converts its outputs
        to fp32 adds (hierremat.blocks.hf.upcasts_outputs). Read once (RematModule checks it at every call)."""
        output = next(n for n in self.orchestrator.graph.nodes if n.op == "output")
        leaves = pytree.tree_leaves(output.args)
        info = getattr(self.orchestrator.graph._codegen, "pytree_info", None)
        spec = info.out_spec if info is not None else None
        reached = _converted_leaves(spec) if spec is not None and spec.num_leaves == len(leaves) else [True] * len(leaves)
        values = [a.meta.get("val") for a, ok in zip(leaves, reached) if ok and isinstance(a, fx.Node)]
        return sum(4 * v.numel() for v in values
                   if isinstance(v, torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16))


def _converted_leaves(spec: pytree.TreeSpec, inside: bool = True) -> list[bool]:
    """Per leaf of ``spec``, whether it is reached through tuples, lists and mappings only (as accelerate's
    ``recursively_apply`` walks an output)."""
    if spec.is_leaf():
        return [inside]
    walked = inside and isinstance(spec.type, type) and issubclass(spec.type, (tuple, list, dict, Mapping))
    return [ok for child in spec.children() for ok in _converted_leaves(child, walked)]


class GraphStage(nn.Module):
    """One stage: a GraphModule fed with the carried activation and the shared values it uses."""

    def __init__(self, graph_module: fx.GraphModule, shared_indices: tuple[int, ...], name: str):
        super().__init__()
        self.graph_module = graph_module
        self.shared_indices = shared_indices
        self.stage_name = name
        self._parameter_targets: tuple[str, ...] | None = None

    def forward(self, x, *shared):
        return self.graph_module(x, *(shared[i] for i in self.shared_indices))

    def parameter_targets(self) -> tuple[str, ...]:
        """The parameters the stage reads, by their names in the captured model (the user's model's names)."""
        if self._parameter_targets is None:
            self._parameter_targets = tuple(
                node.target for node in self.graph_module.graph.find_nodes(op="get_attr")
                if isinstance(operator.attrgetter(node.target)(self.graph_module), nn.Parameter)
            )
        return self._parameter_targets

    def bind(self, model: nn.Module) -> None:
        """Read every parameter from ``model`` again (after ``fully_shard`` replaced them, or while
        FSDP2 holds them gathered): the graph then computes with the model's current parameters."""
        for target in self.parameter_targets():
            self.substitute(target, model.get_parameter(target))

    def parameter(self, target: str) -> nn.Parameter:
        """The parameter the graph reads as ``target`` now."""
        return self.graph_module.get_parameter(target)

    def substitute(self, target: str, param: nn.Parameter) -> None:
        """Compute with ``param`` where the graph reads the parameter ``target``."""
        substitute_tensor(self.graph_module, target, param)


def substitute_tensor(gm: nn.Module, target: str, value: torch.Tensor) -> None:
    """Make ``gm`` read ``value`` where it reads the parameter or buffer ``target`` (a dotted path)."""
    path, _, leaf = target.rpartition(".")
    holder = gm.get_submodule(path)
    if getattr(holder, leaf) is not value:
        setattr(holder, leaf, value)


def block_unit(model: nn.Module, stack: list[str]) -> str | None:
    """The unit of a node whose module stack (outermost first) is ``stack`` (module docstring, step 1)."""
    for path in stack:
        if not path:
            continue
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        try:
            parent_module = model.get_submodule(parent)
            module = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(parent_module, CONTAINERS) and len(parent_module) >= 2:
            if isinstance(module, CONTAINERS) and len(module) >= 2:
                continue
            return path
        if _repeated_block(parent_module, module):
            return path
    return None


def _repeated_block(parent: nn.Module, module: nn.Module) -> bool:
    """Whether ``module`` is a block held as an attribute beside others of its class (GoogLeNet's
    ``inception3a``, ``inception3b``, ... and its ``conv1``, ``conv2``, ``conv3``): not a container,
    with submodules, none of them an ``nn.ModuleList`` (a T5 encoder beside its decoder holds its
    layers in one: those are its units). Within such a block, the units of its branches would each
    carry their output beside the chain to the concatenation that ends the block."""
    if isinstance(module, CONTAINERS) or next(module.children(), None) is None:
        return False
    if not any(other is not module and type(other) is type(module) for other in parent.children()):
        return False
    return not any(isinstance(m, nn.ModuleList) for m in module.modules())


def _mutates(node: fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return target._schema.is_mutable


def _parameter_dependent(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes that depend on a parameter (trainable or frozen) or on an input that requires grad.

    Frozen parameters count: a frozen embedding's output is an activation of the chain, not
    a value to compute once before it and hold through the step like a mask."""
    dependent: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(gm)
            if isinstance(value, torch.nn.Parameter) or (isinstance(value, torch.Tensor) and value.requires_grad):
                dependent.add(node)
        elif node.op == "placeholder":
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and val.requires_grad:
                dependent.add(node)
        elif any(a in dependent for a in node.all_input_nodes):
            dependent.add(node)
    return dependent


def signature_of(gm: fx.GraphModule, context: str = "") -> str:
    """Hash of a stage graph's structure: ops, argument wiring, shapes, dtypes, constants,
    which parameters need gradients (a frozen block traces to another joint graph), and
    ``context`` (what else changes the traced graphs, e.g. the autocast setting)."""
    index = {node: i for i, node in enumerate(gm.graph.nodes)}
    parts = [context]
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        meta = (tuple(val.shape), str(val.dtype)) if isinstance(val, torch.Tensor) else None
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(gm)
            if isinstance(value, torch.Tensor):
                meta = (tuple(value.shape), str(value.dtype), value.requires_grad)
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{index[n]}")
        target = "attr" if node.op in ("get_attr", "placeholder") else target_name(node.target)
        parts.append(f"{node.op}|{target}|{args}|{meta}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _runs(model: nn.Module, compute: list[fx.Node]) -> list[tuple[str | None, list[fx.Node]]]:
    runs: list[tuple[str | None, list[fx.Node]]] = []
    for node in compute:
        unit = block_unit(model, module_stack(node))
        if runs and runs[-1][0] == unit:
            runs[-1][1].append(node)
        else:
            runs.append((unit, [node]))
    return runs


def _precompute(compute: list[fx.Node], stage_of: dict, dependent: set[fx.Node]) -> list[fx.Node]:
    """Free values used across stages, with their ancestors, in graph order."""

    def free(n: fx.Node) -> bool:
        return n not in dependent and not is_random(n) and not _mutates(n)

    chosen: set[fx.Node] = set()
    for node in compute:
        if not free(node) or node in chosen:
            continue
        if not any(stage_of.get(u, -1) != stage_of[node] for u in node.users if u.op != "output"):
            continue
        ancestors, stack, ok = set(), [node], True
        while stack:
            n = stack.pop()
            if n in ancestors or n.op != "call_function":
                continue
            if not free(n):
                ok = False
                break
            ancestors.add(n)
            stack.extend(n.all_input_nodes)
        if ok:
            chosen |= ancestors
    return [n for n in compute if n in chosen]


def _crossing(stages: list[list[fx.Node]], output: fx.Node):
    """(stage of each node, the values crossing each cut, each value's last reading stage: ``len(stages)``
    for the model's output)."""
    stage_of = {n: k for k, nodes in enumerate(stages) for n in nodes}
    end = len(stages)
    crossing: list[list[fx.Node]] = [[] for _ in range(end - 1)]
    last_reader: dict[fx.Node, int] = {}
    for k, nodes in enumerate(stages):
        for n in nodes:
            last = max((end if u is output else stage_of.get(u, k) for u in n.users), default=k)
            last_reader[n] = last
            for b in range(k, min(last, end - 1)):
                crossing[b].append(n)
    return stage_of, crossing, last_reader


def _carry(b: int, crossing: list[fx.Node], stage_of: dict, last_reader: dict, residents: bool,
           previous: fx.Node | None = None) -> fx.Node | None:
    """The activation carried across cut ``b`` (after stage b), or None where the cut is not valid.

    Without ``residents``: the one value crossing, a tensor read by stage b + 1. With them,
    several tensors may cross: the carry is the one made by stage b whose last reader is stage
    b + 1, and every other crossing tensor is a resident (hierremat.plans.stage_info.ResidentLayout).
    Where several qualify (a 2-layer T5 stack: its second layer is the last reader of both the
    first layer's output and the position bias it made), the carry is the one of the shape and
    dtype of ``previous``, the carry into stage b, if only one has them. Where stage b + 1
    reads nothing stage b made (a decoder's embedding after an encoder's last layer), the one
    tensor stage b made that crosses is carried to it unread, and is a resident too (stage b
    returns it twice)."""

    def tensor(n: fx.Node) -> bool:
        return isinstance(n.meta.get("val"), torch.Tensor)

    if len(crossing) == 1 and not residents:
        (only,) = crossing
        return only if tensor(only) and any(stage_of.get(u) == b + 1 for u in only.users) else None
    if not all(tensor(n) for n in crossing):
        return None
    candidates = [n for n in crossing if stage_of[n] == b and last_reader[n] == b + 1]
    if residents and not candidates:
        made = [n for n in crossing if stage_of[n] == b]
        if not any(stage_of.get(u) == b + 1 for n in made for u in n.users):
            candidates = made
    if residents and len(candidates) > 1 and previous is not None:
        like = previous.meta["val"]
        candidates = [n for n in candidates
                      if n.meta["val"].shape == like.shape and n.meta["val"].dtype == like.dtype]
    return candidates[0] if len(candidates) == 1 else None


def _cut_carries(stages: list[list[fx.Node]], output: fx.Node, residents: bool):
    """(the carry of each cut in order, None from the first invalid one on; stage_of, crossing,
    last_reader as :func:`_crossing` gives them)."""
    stage_of, crossing, last_reader = _crossing(stages, output)
    carries: list[fx.Node | None] = []
    previous = None
    for b in range(len(stages) - 1):
        previous = _carry(b, crossing[b], stage_of, last_reader, residents, previous)
        carries.append(previous)
        if previous is None:
            break
    return carries, stage_of, crossing, last_reader


def _merge_until_single_carry(stages: list[list[fx.Node]], output: fx.Node, residents: bool) -> list[list[fx.Node]]:
    """Merge neighbours until each cut has a carried activation (see :func:`_carry`)."""
    while True:
        carries = _cut_carries(stages, output, residents)[0]
        if not carries or carries[-1] is not None:
            return stages
        bad = len(carries) - 1
        stages = stages[:bad] + [stages[bad] + stages[bad + 1]] + stages[bad + 2 :]


def _carries_and_residents(stages: list[list[fx.Node]], output: fx.Node, residents: bool):
    """(the carry into each stage after the first, the residents in graph order, the stage of each node)."""
    carries, stage_of, crossing, last_reader = _cut_carries(stages, output, residents)
    if carries and carries[-1] is None:
        raise ValueError(f"no single activation crosses the cut after stage {len(carries) - 1}")
    carried_to = {c: b + 1 for b, c in enumerate(carries)}
    # a carry read past the stage it is carried to (unread there: see _carry) is also a resident
    residents = list(dict.fromkeys(n for cut in crossing for n in cut if last_reader[n] > carried_to.get(n, -1)))
    return carries, residents, stage_of


#: A stage of more compute nodes than this is split where one value alone crosses (its block
#: ILP would otherwise be slow to build and to solve); planning stays bounded in block size.
MAX_STAGE_NODES = 400


def _split_large(nodes: list[fx.Node], later: set, routed: set, max_nodes: int | None = None) -> list[list[fx.Node]]:
    """A stage's nodes cut into pieces of at most ``max_nodes`` (default MAX_STAGE_NODES) where
    such points exist: points where exactly one tensor computed in the stage crosses (the
    chain's single-carry condition). ``later``: the nodes after the stage (the output node
    included); ``routed``: the shared inputs, which reach every stage anyway. A stage without
    such points stays whole (its menu is then the coarser one if its ILP is too large)."""
    max_nodes = MAX_STAGE_NODES if max_nodes is None else max_nodes
    if len(nodes) <= max_nodes:
        return [nodes]
    own = set(nodes)
    last_use: dict[fx.Node, int] = {}  # position of the last reader (len(nodes): a later stage)
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            if a.op != "get_attr" and a not in routed:
                last_use[a] = i
        if any(u in later for u in n.users):
            last_use[n] = len(nodes)
    expire: dict[int, list[fx.Node]] = {}
    live = set()
    for a, last in last_use.items():
        if a not in own:  # the stage's carried input
            live.add(a)
            expire.setdefault(last + 1, []).append(a)
    cuts, start, candidate = [], 0, None
    for p in range(1, len(nodes)):  # live: the values crossing the point before nodes[p]
        n = nodes[p - 1]
        if last_use.get(n, -1) >= p:
            live.add(n)
            expire.setdefault(last_use[n] + 1, []).append(n)
        for a in expire.pop(p, ()):
            live.discard(a)
        if len(live) == 1:
            (only,) = live
            if only in own and isinstance(only.meta.get("val"), torch.Tensor):
                candidate = p
        if p - start >= max_nodes and candidate is not None and candidate > start:
            cuts.append(candidate)
            start = candidate
    bounds = [0, *cuts, len(nodes)]
    return [nodes[a:b] for a, b in zip(bounds, bounds[1:])]


SEGMENTATIONS = ("blocks", "none")


def check_segmentation(segmentation: str) -> None:
    if segmentation not in SEGMENTATIONS:
        raise ValueError(
            f"segmentation must be 'blocks' (one stage per repeated block, the default) or 'none' (everything "
            f"before the output stage as one block: the whole-graph ILP), got {segmentation!r}"
        )


def _cut(gm: fx.GraphModule, model: nn.Module, segmentation: str):
    """The captured graph's stages (their nodes, in order) and names, the nodes computed before the chain
    (``_precompute``), and the stages' carries, residents and which stage makes each node
    (``_carries_and_residents``)."""
    nodes = list(gm.graph.nodes)
    output = next(n for n in nodes if n.op == "output")
    compute = [n for n in nodes if n.op == "call_function"]
    dependent = _parameter_dependent(gm)
    runs = _runs(model, compute)
    stage_of = {n: k for k, (_, run) in enumerate(runs) for n in run}
    pre = _precompute(compute, stage_of, dependent)
    pre_set = set(pre)
    named = [(unit, [n for n in run if n not in pre_set]) for unit, run in runs]
    named = [(unit, run) for unit, run in named if run]
    with_residents = segmentation == "blocks"
    stages = _merge_until_single_carry([run for _, run in named], output, with_residents)
    if segmentation == "none" and len(stages) > 2:
        stages = [[n for run in stages[:-1] for n in run], stages[-1]]
    unit_of = {run[0]: unit for unit, run in named}
    named_stages = []
    routed = pre_set | {n for n in nodes if n.op == "placeholder"}
    routed |= set(_carries_and_residents(stages, output, with_residents)[1])
    for k, (nodes_k, name) in enumerate(zip(stages, _stage_names(stages, unit_of))):
        later = {n for s in stages[k + 1:] for n in s} | {output}
        pieces = [nodes_k] if segmentation == "none" else _split_large(nodes_k, later, routed)
        named_stages += [(piece, name if len(pieces) == 1 else f"{name}[{j + 1}/{len(pieces)}]")
                         for j, piece in enumerate(pieces)]
    try:
        inner_carries, residents, stage_of = _carries_and_residents(
            [piece for piece, _ in named_stages], output, with_residents
        )
    except ValueError:  # a split point's value is read past the next piece: keep the stages whole
        named_stages = list(zip(stages, _stage_names(stages, unit_of)))
        inner_carries, residents, stage_of = _carries_and_residents(stages, output, with_residents)
    stages = [piece for piece, _ in named_stages]
    names = [name for _, name in named_stages]
    stages, moved = _carry_before_several_results(stages, output, with_residents)
    stages, rewritten = functionalize_boundary_writes(gm.graph, stages)
    if moved or rewritten:  # other carries; later readers of an overwritten value read the stage's new result
        inner_carries, residents, stage_of = _carries_and_residents(stages, output, with_residents)
    return stages, names, pre, inner_carries, residents, stage_of


def _resident_layout(residents: list, stage_of: dict, exported: list, shared_count: int) -> ResidentLayout | None:
    """Which stage makes each resident, which later stages read it, which the model returns (None: none)."""
    if not residents:
        return None
    return ResidentLayout(
        producers=tuple(stage_of[r] for r in residents),
        readers=tuple(tuple(sorted({stage_of[u] for u in r.users if u in stage_of and stage_of[u] != stage_of[r]}))
                      for r in residents),
        exported=tuple(residents.index(r) for r in exported),
        shared_count=shared_count,
    )


def build_chain_graph(
    captured: CapturedModel, model: nn.Module, segmentation: str = "blocks", context: str = ""
) -> ChainGraph:
    """Cut the captured model into a chain of stages.

    context: what else the stages' traced graphs depend on (the autocast setting), hashed
    into every stage signature.

    segmentation: 'blocks' cuts at the boundaries of repeated child modules; 'none' keeps
    every stage before the last as ONE stage, so its block options come from one ILP over
    that whole graph (Checkmate on the full graph; the optimality reference of the
    hierarchical plan). The last stage (the head and loss, whose several outputs a
    BlockGraph does not model) stays a stage of its own, as in 'blocks'.
    """
    check_segmentation(segmentation)
    gm = captured.module
    nodes = list(gm.graph.nodes)
    output = next(n for n in nodes if n.op == "output")
    stages, names, pre, inner_carries, residents, stage_of = _cut(gm, model, segmentation)

    stage_set = [set(s) for s in stages]
    placeholders = [n for n in nodes if n.op == "placeholder"]
    external = []
    for k, nodes_k in enumerate(stages):
        ins = []
        for n in nodes_k:
            for a in n.all_input_nodes:
                if a not in stage_set[k] and a.op != "get_attr" and a not in ins:
                    ins.append(a)
        external.append(ins)
    first_inputs = [a for a in external[0] if isinstance(a.meta.get("val"), torch.Tensor)]
    if not first_inputs:
        raise ValueError("the first stage has no tensor input")
    carries = [first_inputs[0], *inner_carries]
    shared_nodes = [n for n in placeholders + pre if any(n in external[k] and n is not carries[k] for k in range(len(stages)))]
    final_outputs = [n for n in stages[-1] if output in n.users]
    exported = [r for r in residents if output in r.users]
    routed_values = shared_nodes + residents  # what a stage's ``shared`` tuple holds, in this order

    stage_modules, infos = [], []
    for k, nodes_k in enumerate(stages):
        made = [r for r in residents if stage_of[r] == k]
        if k == len(stages) - 1:
            outs = final_outputs
        else:
            outs = [inner_carries[k], *made]
        routed_here = [s for s in routed_values if s in external[k] and s is not carries[k]]
        sub = _extract(gm, nodes_k, carries[k], routed_here, outs, tuple_output=len(outs) > 1)
        indices = tuple(routed_values.index(s) for s in routed_here)
        stage_modules.append(GraphStage(sub, indices, names[k]))
        infos.append(StageInfo(names[k], signature_of(sub, context), len(nodes_k)))

    layout = _resident_layout(residents, stage_of, exported, len(shared_nodes))
    orchestrator = _orchestrator(gm, placeholders, pre, carries[0], shared_nodes, final_outputs + exported, output)
    return ChainGraph(stage_modules, infos, orchestrator, layout)


#: Operators of the captured graph that its joint trace makes one node of several results (the output beside the
#: statistics or indices its backward reads): a stage whose carry is one of them gets no block options
#: (hierremat.planning.menus), so :func:`_carry_before_several_results` moves it into the next stage.
#: (``layer_norm`` is one too; a post-norm transformer's layers keep theirs: their encoder output stays their own.)
SEVERAL_RESULTS = frozenset({
    torch.ops.aten.batch_norm.default, torch.ops.aten.group_norm.default, torch.ops.aten.instance_norm.default,
    torch.ops.aten.max_pool2d.default, torch.ops.aten.max_pool3d.default, max_pool2d,
})


def _tensor_bytes(node: fx.Node) -> int | float:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(val.numel(), int):
        return math.inf
    return val.numel() * val.element_size()


def _carry_before_several_results(stages: list[list[fx.Node]], output: fx.Node, residents: bool):
    """The stages with each carry made by an operator of SEVERAL_RESULTS (a block ending in BatchNorm) moved to the
    start of the next stage, where it is the last node of its stage, its only input that is not a parameter or
    buffer comes from its stage, holds no more bytes than it, and nothing else in its stage reads it: the carry is
    then that input, a value of its own. Returns (stages, how many moved); moves that would leave a cut without a
    carry are not made."""
    carries = _cut_carries(stages, output, residents)[0]
    new, moved = [list(nodes) for nodes in stages], 0
    for b, carry in enumerate(carries):
        stage = new[b]
        if carry is None or carry.target not in SEVERAL_RESULTS or len(stage) < 2 or stage[-1] is not carry:
            continue
        inputs = [a for a in carry.all_input_nodes if a.op != "get_attr"]
        if len(inputs) != 1 or inputs[0] not in stage or any(u in stage for u in carry.users):
            continue
        if _tensor_bytes(inputs[0]) > _tensor_bytes(carry):  # (a pool's larger input: a larger checkpoint)
            continue
        trial = new[:b] + [stage[:-1], [carry, *new[b + 1]]] + new[b + 2:]
        if None not in _cut_carries(trial, output, residents)[0]:
            new, moved = trial, moved + 1
    return new, moved


def _stage_names(stages: list[list[fx.Node]], unit_of: dict) -> list[str]:
    """Each stage's name: its units (``transformer.h.3``, ``(top)`` for nodes in none), or the first..last."""
    names = []
    for nodes_k in stages:
        units = list(dict.fromkeys(unit_of[n] or "(top)" for n in nodes_k if n in unit_of))
        names.append("+".join(units) if len(units) <= 2 else f"{units[0]}..{units[-1]}")
    return names


def _copy_meta(src: fx.Node, dst: fx.Node) -> fx.Node:
    dst.meta = dict(src.meta)
    return dst


def _copy_nodes(graph: fx.Graph, env: dict[fx.Node, fx.Node], nodes: list[fx.Node]):
    """Copy ``nodes`` into ``graph``; inputs come from ``env``, parameters and buffers as get_attr.

    Returns the lookup, for mapping further arguments the same way.
    """

    def lookup(a: fx.Node) -> fx.Node:
        if a not in env:
            if a.op != "get_attr":
                raise AssertionError(f"graph input {a.name} was not routed")
            env[a] = _copy_meta(a, graph.get_attr(a.target))
        return env[a]

    for n in nodes:
        env[n] = graph.node_copy(n, lookup)
    return lookup


def _extract(gm, nodes, carry, shared, outputs, tuple_output: bool) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {carry: _copy_meta(carry, graph.placeholder("x"))}
    for j, s in enumerate(shared):
        env[s] = _copy_meta(s, graph.placeholder(f"shared_{j}"))
    _copy_nodes(graph, env, nodes)
    graph.output(tuple(env[o] for o in outputs) if tuple_output else env[outputs[0]])
    return fx.GraphModule(gm, graph)


def _orchestrator(gm, placeholders, pre, carry0, shared_nodes, final_outputs, output) -> fx.GraphModule:
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen
    env: dict[fx.Node, fx.Node] = {p: graph.node_copy(p) for p in placeholders}
    lookup = _copy_nodes(graph, env, pre)
    chain = graph.call_module(CHAIN_ATTRIBUTE, (env[carry0], *(env[s] for s in shared_nodes)))
    for j, o in enumerate(final_outputs):
        env[o] = _copy_meta(o, graph.call_function(operator.getitem, (chain, j)))
    graph.output(fx.node.map_arg(output.args[0], lookup))
    setattr(gm, CHAIN_ATTRIBUTE, nn.Identity())  # stands in until the caller sets the real chain
    try:
        return fx.GraphModule(gm, graph)
    finally:
        delattr(gm, CHAIN_ATTRIBUTE)
