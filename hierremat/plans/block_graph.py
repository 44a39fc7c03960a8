"""One block's forward/backward operator graph as a plain value (no torch).

This is the interface between ``hierremat.blocks`` (which captures a stage's joint
forward+backward ATen graph and profiles it) and ``hierremat.ilp`` (which solves it).
It carries no tensors and no callables, only names, sizes (bytes) and times (seconds),
and round-trips through JSON.

The block maps its input x (the chain activation x_i) to its output y (x_{i+1}).
Parameters, buffers and values shared by all stages (attention masks) are not nodes:
reading them is free and they are not part of the budget (see DESIGN.md, "What a
budget counts"). Forward nodes may be kept, freed and recomputed; backward nodes run
exactly once each, in graph order, during the block's backward, reading forward
results, earlier backward results and the output gradient dy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

FORWARD = "forward"
BACKWARD = "backward"


@dataclass(frozen=True)
class GraphNode:
    """One operator of the joint graph.

    name: unique within the graph (the fx node name).
    op: operator name, e.g. ``"aten.mm.default"``.
    phase: ``"forward"`` or ``"backward"``.
    inputs: names of the nodes (or of the block input / output gradient) it reads;
        parameters and shared values are omitted.
    out_bytes: bytes of the result it allocates (0 for a view: it shares ``alias_of``).
    time: seconds to run it once on the profiled device.
    workspace_bytes: transient bytes it needs above its inputs and result.
    scratch_bytes: the part of ``workspace_bytes`` a CPU kernel allocates below the dispatcher (seen by the
        allocator meter, not by the live-tensor tracker: hierremat.runtime.node_profile).
    random: it draws random numbers (dropout), so it may only be recomputed with its
        RNG state replayed.
    alias_of: name of the node (or block input) whose storage the result shares, "" if none.
    in_place: the result is one of its inputs overwritten in place (hierremat.blocks.variants.in_place):
        it shares ``alias_of``'s storage although it reads other values too.
    """

    name: str
    op: str
    phase: str
    inputs: tuple[str, ...]
    out_bytes: int
    time: float
    workspace_bytes: int = 0
    random: bool = False
    alias_of: str = ""
    in_place: bool = False
    scratch_bytes: int = 0

    def __post_init__(self) -> None:
        if self.phase not in (FORWARD, BACKWARD):
            raise ValueError(f"node {self.name}: phase must be 'forward' or 'backward', got {self.phase!r}")
        if self.out_bytes < 0 or self.workspace_bytes < 0 or self.time < 0:
            raise ValueError(f"node {self.name}: negative size or time")
        if not 0 <= self.scratch_bytes <= self.workspace_bytes:
            raise ValueError(f"node {self.name}: scratch_bytes must be part of workspace_bytes")


@dataclass(frozen=True)
class BlockGraph:
    """A block's joint graph, nodes in a topological order (forward nodes first).

    input_name / input_bytes: the block input x (allocated by the caller; the chain
        DP accounts for it).
    output_name: the forward node whose result is the block output y.
    output_grad_name / output_grad_bytes: the gradient of y, given to the backward.
    input_grad_name: the backward node whose result is the gradient of x ("" when x
        needs no gradient).
    held_grad_names: other backward nodes whose results outlive the backward, as dx does
        (the gradient sums of residents the block reads: hierremat.blocks.joint).
    seed_readers: for each held gradient, in order, the backward node that adds the block's
        terms to the sum the resident's later readers made (hierremat.blocks.joint.seeded_add).
        That sum, the seed, is held outside the block (the chain DP counts it), so it is no
        input of the node here; :func:`concatenate` makes it one where the later reader is a
        block of the concatenation. Empty where unknown (graphs stored by older versions).
    """

    nodes: tuple[GraphNode, ...]
    input_name: str
    input_bytes: int
    output_name: str
    output_grad_name: str
    output_grad_bytes: int
    input_grad_name: str = ""
    held_grad_names: tuple[str, ...] = ()
    seed_readers: tuple[str, ...] = ()
    _index: dict = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index = {}
        seen_backward = False
        known = {self.input_name, self.output_grad_name}
        for i, node in enumerate(self.nodes):
            if node.name in index or node.name in (self.input_name, self.output_grad_name):
                raise ValueError(f"duplicate node name {node.name!r}")
            if node.phase == BACKWARD:
                seen_backward = True
            elif seen_backward:
                raise ValueError(f"forward node {node.name!r} comes after a backward node")
            for name in node.inputs:
                if name not in known:
                    raise ValueError(f"node {node.name!r} reads {name!r}, which is not defined before it")
                if node.phase == FORWARD and name == self.output_grad_name:
                    raise ValueError(f"forward node {node.name!r} reads the output gradient")
            index[node.name] = i
            known.add(node.name)
        if self.output_name not in index or self.nodes[index[self.output_name]].phase != FORWARD:
            raise ValueError(f"output_name {self.output_name!r} is not a forward node")
        if self.input_grad_name and (
            self.input_grad_name not in index or self.nodes[index[self.input_grad_name]].phase != BACKWARD
        ):
            raise ValueError(f"input_grad_name {self.input_grad_name!r} is not a backward node")
        for name in self.held_grad_names + self.seed_readers:
            if name not in index or self.nodes[index[name]].phase != BACKWARD:
                raise ValueError(f"held gradient or seed reader {name!r} is not a backward node")
        if self.seed_readers and len(self.seed_readers) != len(self.held_grad_names):
            raise ValueError("seed_readers needs one node per held gradient")
        object.__setattr__(self, "_index", index)

    def node(self, name: str) -> GraphNode:
        return self.nodes[self._index[name]]

    def index(self, name: str) -> int:
        return self._index[name]

    @property
    def forward_nodes(self) -> tuple[GraphNode, ...]:
        return tuple(n for n in self.nodes if n.phase == FORWARD)

    @property
    def backward_nodes(self) -> tuple[GraphNode, ...]:
        return tuple(n for n in self.nodes if n.phase == BACKWARD)

    def to_dict(self) -> dict:
        return {
            "nodes": [{**asdict(n), "inputs": list(n.inputs)} for n in self.nodes],
            "input_name": self.input_name,
            "input_bytes": self.input_bytes,
            "output_name": self.output_name,
            "output_grad_name": self.output_grad_name,
            "output_grad_bytes": self.output_grad_bytes,
            "input_grad_name": self.input_grad_name,
            "held_grad_names": list(self.held_grad_names),
            "seed_readers": list(self.seed_readers),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "BlockGraph":
        nodes = tuple(GraphNode(**{**n, "inputs": tuple(n["inputs"])}) for n in d["nodes"])
        return cls(
            nodes=nodes,
            input_name=d["input_name"],
            input_bytes=int(d["input_bytes"]),
            output_name=d["output_name"],
            output_grad_name=d["output_grad_name"],
            output_grad_bytes=int(d["output_grad_bytes"]),
            input_grad_name=d.get("input_grad_name", ""),
            held_grad_names=tuple(d.get("held_grad_names", ())),
            seed_readers=tuple(d.get("seed_readers", ())),
        )


def concatenate(graphs: "list[BlockGraph] | tuple[BlockGraph, ...]") -> BlockGraph:
    """One BlockGraph for blocks run one after the other (block i's output is block i+1's input).

    Node names get a ``b{i}.`` prefix. Block i+1 reads block i's output node where it read
    its input, and block i's backward reads block i+1's input-gradient node where it read
    its output gradient; forward nodes come in block order, backward nodes in reverse
    block order. Costs are the blocks' own, so the concatenation is the same cost model:
    its ILP is Checkmate's whole-graph problem over those blocks, the reference that the
    hierarchical plan (one ILP per block, composed by the chain DP) is measured against.

    Blocks that read residents (held gradients) must all read the same ones, in the same order:
    block i's seed reader then also reads block i+1's sum of the resident's gradient (its
    seed), which is thereby no longer held; the concatenation holds block 0's sums.
    """
    if not graphs:
        raise ValueError("concatenate needs at least one graph")
    held = {len(g.held_grad_names) for g in graphs}
    if len(held) > 1 or any(len(g.seed_readers) != len(g.held_grad_names) for g in graphs):
        raise ValueError("concatenate takes blocks that all read the same residents, with their seed readers known")
    for i, g in enumerate(graphs[1:], start=1):
        if not g.input_grad_name:
            raise ValueError(f"block {i} has no input gradient, so the blocks before it get no output gradient")
    renames = []
    for i, g in enumerate(graphs):
        names = {n.name: f"b{i}.{n.name}" for n in g.nodes}
        names[g.input_name] = f"b{i - 1}.{graphs[i - 1].output_name}" if i > 0 else f"b0.{g.input_name}"
        renames.append(names)
    for i, g in enumerate(graphs[:-1]):
        renames[i][g.output_grad_name] = renames[i + 1][graphs[i + 1].input_grad_name]
    last = len(graphs) - 1
    renames[last][graphs[last].output_grad_name] = f"b{last}.{graphs[last].output_grad_name}"

    seeds = {}  # renamed seed reader -> the renamed sum of the later block it also reads
    for i, g in enumerate(graphs[:-1]):
        for reader, later_sum in zip(g.seed_readers, graphs[i + 1].held_grad_names):
            seeds[renames[i][reader]] = renames[i + 1][later_sum]

    def renamed(i: int, node: GraphNode) -> GraphNode:
        r = renames[i]
        seed = (seeds[r[node.name]],) if r[node.name] in seeds else ()
        return GraphNode(
            name=r[node.name], op=node.op, phase=node.phase, inputs=(*seed, *(r[a] for a in node.inputs)),
            out_bytes=node.out_bytes, time=node.time, workspace_bytes=node.workspace_bytes, random=node.random,
            alias_of=r[node.alias_of] if node.alias_of else "", in_place=node.in_place, scratch_bytes=node.scratch_bytes,
        )

    forward = [renamed(i, n) for i, g in enumerate(graphs) for n in g.forward_nodes]
    backward = [renamed(i, n) for i in reversed(range(len(graphs))) for n in graphs[i].backward_nodes]
    first, end = graphs[0], graphs[last]
    return BlockGraph(
        nodes=tuple(forward + backward),
        input_name=renames[0][first.input_name],
        input_bytes=first.input_bytes,
        output_name=renames[last][end.output_name],
        output_grad_name=renames[last][end.output_grad_name],
        output_grad_bytes=end.output_grad_bytes,
        input_grad_name=renames[0][first.input_grad_name] if first.input_grad_name else "",
        held_grad_names=tuple(renames[0][name] for name in first.held_grad_names),
        seed_readers=tuple(renames[last][name] for name in end.seed_readers),
    )
