"""Cut a captured graph into a chain of stages.

1. Every compute node gets a *unit*: the outermost module in its ``nn_module_stack``
   that is a child of an ``nn.ModuleList``/``nn.Sequential`` (descending while that child
   is itself such a container), e.g. ``transformer.h.3`` in GPT-2 or ``layer2.0`` in a
   ResNet. Nodes outside any container (embeddings, final norm, head, loss) get none.
   Maximal runs of nodes with the same unit, in graph order, are the candidate stages.
2. Values that depend on no parameter (trainable or frozen) and no input that requires
   grad, are not random and do not mutate (attention masks, position ids, rotary tables,
   shifted labels) and are used by a later stage are *precomputed* once before the chain
   and passed to every stage as shared inputs.
3. Between two stages exactly one value may flow (the carried activation); where more
   flow, the two stages are merged. The last stage produces what the model returns.
4. Each stage becomes a GraphModule ``stage(x, *shared)``; an orchestrator GraphModule
   with the model's calling convention runs the precompute nodes, then the chain
   (one ``call_module``), then assembles the outputs.

Each stage has a structural signature (hash of ops, argument structure, shapes and
dtypes; not of parameter names), so identical blocks share one key.
"""

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass

import torch
from torch import fx, nn

from ..blocks_info import StageInfo
from .capture import CapturedModel, is_random, module_stack

CONTAINERS = (nn.ModuleList, nn.Sequential)
#: Name of the orchestrator's submodule that runs the chain.
CHAIN_ATTRIBUTE = "hierremat_chain"


@dataclass
class ChainGraph:
    """A model cut into a chain.

    stages: GraphModules called as ``stage(x, *shared)`` (the selected shared values).
    infos: one StageInfo per stage.
    orchestrator: GraphModule with the model's calling convention; it calls the chain
        through its submodule ``hierremat_chain`` as ``chain(x0, *shared)`` and expects
        a tuple of the last stage's outputs back.
    """

    stages: list[nn.Module]
    infos: list[StageInfo]
    orchestrator: fx.GraphModule


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
            path, _, leaf = target.rpartition(".")
            live = model.get_parameter(target)
            holder = self.graph_module.get_submodule(path)
            if getattr(holder, leaf) is not live:
                setattr(holder, leaf, live)


def block_unit(model: nn.Module, stack: list[str]) -> str | None:
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
    return None


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


def _target_name(target) -> str:
    """A target's name, the same in every process (a Python function's repr has its address)."""
    if callable(target) and not isinstance(target, torch._ops.OpOverload):
        return fx.node._get_qualified_name(target)
    return str(target)


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
        target = "attr" if node.op in ("get_attr", "placeholder") else _target_name(node.target)
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


def _merge_until_single_carry(stages: list[list[fx.Node]], output: fx.Node) -> list[list[fx.Node]]:
    """Merge neighbours until one value, used by the next stage, crosses each cut."""
    while True:
        stage_of = {n: k for k, nodes in enumerate(stages) for n in nodes}
        end = len(stages)
        crossing: list[list[fx.Node]] = [[] for _ in range(end - 1)]
        for k, nodes in enumerate(stages):
            for n in nodes:
                last = max((end if u is output else stage_of.get(u, k) for u in n.users), default=k)
                for b in range(k, min(last, end - 1)):
                    crossing[b].append(n)

        def valid(b: int) -> bool:
            if len(crossing[b]) != 1:
                return False
            carried = crossing[b][0]
            return isinstance(carried.meta.get("val"), torch.Tensor) and any(
                stage_of.get(u) == b + 1 for u in carried.users
            )

        bad = next((b for b in range(end - 1) if not valid(b)), None)
        if bad is None:
            return stages
        stages = stages[:bad] + [stages[bad] + stages[bad + 1]] + stages[bad + 2 :]


SEGMENTATIONS = ("blocks", "none")


def check_segmentation(segmentation: str) -> None:
    if segmentation not in SEGMENTATIONS:
        raise ValueError(
            f"segmentation must be 'blocks' (one stage per repeated block, the default) or 'none' (everything "
            f"before the output stage as one block: the whole-graph ILP), got {segmentation!r}"
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
    compute = [n for n in nodes if n.op == "call_function"]
    dependent = _parameter_dependent(gm)
    runs = _runs(model, compute)
    stage_of = {n: k for k, (_, run) in enumerate(runs) for n in run}
    pre = _precompute(compute, stage_of, dependent)
    pre_set = set(pre)
    named = [(unit, [n for n in run if n not in pre_set]) for unit, run in runs]
    named = [(unit, run) for unit, run in named if run]
    stages = _merge_until_single_carry([run for _, run in named], output)
    if segmentation == "none" and len(stages) > 2:
        stages = [[n for run in stages[:-1] for n in run], stages[-1]]
    unit_of = {run[0]: unit for unit, run in named}
    names = []
    for nodes_k in stages:
        units = list(dict.fromkeys(unit_of[n] or "(top)" for n in nodes_k if n in unit_of))
        names.append("+".join(units) if len(units) <= 2 else f"{units[0]}..{units[-1]}")

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
    carries = [None] + [next(a for a in external[k] if a not in pre_set and a.op != "placeholder") for k in range(1, len(stages))]
    first_inputs = [a for a in external[0] if isinstance(a.meta.get("val"), torch.Tensor)]
    if not first_inputs:
        raise ValueError("the first stage has no tensor input")
    carries[0] = first_inputs[0]
    shared_nodes = [n for n in placeholders + pre if any(n in external[k] and n is not carries[k] for k in range(len(stages)))]
    final_outputs = [n for n in stages[-1] if output in n.users]

    stage_modules, infos = [], []
    for k, nodes_k in enumerate(stages):
        outs = final_outputs if k == len(stages) - 1 else [next(n for n in nodes_k if any(u not in stage_set[k] for u in n.users))]
        shared_here = [s for s in shared_nodes if s in external[k] and s is not carries[k]]
        sub = _extract(gm, nodes_k, carries[k], shared_here, outs, tuple_output=k == len(stages) - 1 and len(outs) > 1)
        indices = tuple(shared_nodes.index(s) for s in shared_here)
        stage_modules.append(GraphStage(sub, indices, names[k]))
        infos.append(StageInfo(names[k], signature_of(sub, context), len(nodes_k)))

    orchestrator = _orchestrator(gm, placeholders, pre, carries[0], shared_nodes, final_outputs, output)
    return ChainGraph(stage_modules, infos, orchestrator)


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
