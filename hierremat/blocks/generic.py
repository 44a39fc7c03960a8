"""One graph for every input shape: a specialized graph made size-generic again, and the check that it is.

A graph specialized from the symbolic capture (hierremat.blocks.symbolic) has each size folded to an int
that remembers the size it stands for (SizeLiteral). :func:`size_generic` copies such a graph (a stage, the
orchestrator) with every SizeLiteral computed from the sizes of its own inputs at each call (``sym_size``
and integer arithmetic on them, as the symbolic program computes it), so that one copy runs at every shape
of the capture. :func:`same_but_sizes` checks that the graph specialized at another shape is the same
program: the same nodes, arguments and attributes, each SizeLiteral standing for the same size. Where it is,
that shape runs the generic copy and keeps no graph of its own (hierremat.api.shape_families.
ShapeFamilies.share_graphs); where it is not (a pass that decided by a size, a slice whole at one length only), the shape
keeps its own.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import Callable

import sympy
import torch
from torch import fx
from torch.utils._sympy.functions import CeilDiv, FloorDiv, Max, Min, Mod, PowByNatural, PythonMod

from .segment import CHAIN_ATTRIBUTE, ChainGraph, GraphStage
from .sources import forget_sources, recorded_sources
from .symbolic import SYMBOLIC_SHAPE, SizeLiteral


def _ceil_div(a, b):
    """``ceil(a / b)`` for ints (and the SymInts fx traces): torch's CeilDiv."""
    return -(-a // b)


#: the operations a size may be built with (sympy's, and those of torch's shape environment,
#: torch.utils._sympy.functions), as the operations on Python ints that compute them; each folds its
#: arguments pairwise, left to right (a sum, a product, a max of several terms). A power's exponent must be a
#: natural number (else the size is refused, as any other operation is: size_generic).
_OPERATORS = {
    sympy.Add: operator.add, sympy.Mul: operator.mul, FloorDiv: operator.floordiv,  # (CleanDiv is a FloorDiv)
    CeilDiv: _ceil_div, Mod: operator.mod, PythonMod: operator.mod, sympy.Mod: operator.mod,
    Max: torch.sym_max, sympy.Max: torch.sym_max, Min: torch.sym_min, sympy.Min: torch.sym_min,
    sympy.Pow: operator.pow, PowByNatural: operator.pow,
}


class NotGeneric(Exception):
    """A size that cannot be computed from a graph's inputs' sizes (a symbol no input has as a whole dimension, an
    operation outside _OPERATORS)."""


def fold_size(expr, symbol: Callable, apply: Callable, computed: dict | None = None):
    """``expr`` (a sympy size) computed from its symbols' values, operation by operation, left to right: ``symbol(s)``
    gives a symbol's value, ``apply(fn, a, b)`` the value of a binary operation of _OPERATORS on two values (ints,
    SymInts, or fx nodes that compute them); ``computed`` memoizes sub-expressions. Raises NotGeneric for an operation
    outside _OPERATORS or a power that is not a natural number's."""
    computed = computed if computed is not None else {}
    if expr in computed:
        return computed[expr]
    if isinstance(expr, sympy.Integer):
        return int(expr)
    if isinstance(expr, sympy.Symbol):
        value = symbol(expr)
    else:
        op = next((fn for kind, fn in _OPERATORS.items() if isinstance(expr, kind)), None)
        if op is None:
            raise NotGeneric(f"a size computed as {expr} ({type(expr).__name__})")
        if op is operator.pow and not (isinstance(expr.args[1], sympy.Integer) and expr.args[1] >= 0):
            raise NotGeneric(f"a size computed as {expr} (a power that is not a natural number's)")
        terms = [fold_size(a, symbol, apply, computed) for a in expr.args]
        value = terms[0]
        for term in terms[1:]:
            value = apply(op, value, term)
    computed[expr] = value
    return value


def size_generic(gm: fx.GraphModule) -> fx.GraphModule | None:
    """A copy of ``gm`` (its graph copied, its attributes shared) that computes each SizeLiteral in its nodes'
    arguments from its placeholders' sizes at every call (a copy alike where it has none); None where one cannot
    be computed so (NotGeneric)."""
    graph = copy.deepcopy(gm.graph)
    placeholders = list(graph.find_nodes(op="placeholder"))
    dims = {}  # symbol -> (placeholder, dim): where each symbol is a whole dimension of an input
    for p in placeholders:
        shape = p.meta.get(SYMBOLIC_SHAPE)
        if isinstance(shape, tuple):
            for d, size in enumerate(shape):
                if isinstance(size, sympy.Symbol):
                    dims.setdefault(size, (p, d))
    computed: dict = {}
    anchor = next(n for n in graph.nodes if n.op != "placeholder")  # (the output, at least)

    def symbol(s) -> fx.Node:
        if s not in dims:
            raise NotGeneric(f"no input of the graph has {s} as a dimension")
        return graph.call_function(torch.ops.aten.sym_size.int, dims[s])

    def build(expr) -> object:
        return fold_size(expr, symbol, lambda op, a, b: graph.call_function(op, (a, b)), computed)

    def generic(value):
        if isinstance(value, SizeLiteral):
            return build(value.expr)
        return value

    with graph.inserting_before(anchor):
        try:
            for node in [n for n in graph.nodes if n.op != "placeholder" and _has_literal((n.args, n.kwargs))]:
                node.args, node.kwargs = fx.node.map_aggregate((node.args, node.kwargs), generic)
        except NotGeneric:
            return None
    generic_gm = fx.GraphModule(gm, graph)
    generic_gm.meta.update(gm.meta)
    return generic_gm


def _has_literal(value) -> bool:
    found = []
    fx.node.map_aggregate(value, lambda v: found.append(v) if isinstance(v, SizeLiteral) else v)
    return bool(found)


def same_but_sizes(reference: fx.GraphModule, other: fx.GraphModule) -> bool:
    """Whether ``other`` is ``reference``'s program at another shape of one symbolic capture: node for node the
    same operations on the same arguments (nodes by position; each SizeLiteral for the same size, whatever its
    value here; any other value equal), the same attributes (the same objects, or tensors equal in dtype, shape and
    values), placeholders of the same symbolic sizes, the same output structure and calling convention."""
    ours, theirs = list(reference.graph.nodes), list(other.graph.nodes)
    codegens = reference.graph._codegen, other.graph._codegen  # (an orchestrator's: the model's calling convention)
    if (len(ours) != len(theirs) or type(codegens[0]) is not type(codegens[1])
            or getattr(codegens[0], "pytree_info", None) != getattr(codegens[1], "pytree_info", None)):
        return False
    position = {n: i for i, n in enumerate(ours)}
    position.update({n: i for i, n in enumerate(theirs)})
    for a, b in zip(ours, theirs):
        if a.op != b.op or a.target != b.target or not _same((a.args, a.kwargs), (b.args, b.kwargs), position):
            return False
        if a.op == "call_module" and a.target != CHAIN_ATTRIBUTE and (
                operator.attrgetter(a.target)(reference) is not operator.attrgetter(b.target)(other)):
            return False
        if a.op == "placeholder" and a.meta.get(SYMBOLIC_SHAPE) != b.meta.get(SYMBOLIC_SHAPE):
            return False
        if a.op == "get_attr" and not _same_attribute(
            operator.attrgetter(a.target)(reference), operator.attrgetter(b.target)(other)
        ):
            return False
    return True


def _same(a, b, position: dict) -> bool:
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return isinstance(a, fx.Node) and isinstance(b, fx.Node) and position[a] == position[b]
    if isinstance(a, SizeLiteral) or isinstance(b, SizeLiteral):
        return isinstance(a, SizeLiteral) and isinstance(b, SizeLiteral) and a.expr == b.expr
    if isinstance(a, slice) or isinstance(b, slice):
        return (isinstance(a, slice) and isinstance(b, slice)
                and all(_same(x, y, position) for x, y in ((a.start, b.start), (a.stop, b.stop), (a.step, b.step))))
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_same(x, y, position) for x, y in zip(a, b)))
    if isinstance(a, dict) or isinstance(b, dict):
        return (type(a) is type(b) and a.keys() == b.keys()
                and all(_same(a[k], b[k], position) for k in a))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return _same_attribute(a, b)
    if _has_literal(a) or _has_literal(b):  # (a size inside a value compared by equality: not known to be the same)
        return False
    return type(a) is type(b) and (a == b or (a != a and b != b))  # (NaN equal to NaN)


def _same_attribute(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
                and a.requires_grad == b.requires_grad and bool(torch.equal(a.detach(), b.detach())))
    return False


#: how many size-generic chains a family of input shapes keeps (RematModule: one per program its shapes are
#: specialized to, e.g. padded and unpadded masks where the model branches on them)
MAX_GENERIC_CHAINS = 4


@dataclass(frozen=True, eq=False)
class GenericChain:
    """A chain whose stages and orchestrator run at every shape of one symbolic capture, made from one shape's
    specialized chain (``reference``, what another shape's is checked against: :meth:`holds_for`).

    The orchestrator calls the chain through ``dispatch`` (hierremat.api.planned_shape.ChainDispatch), set to
    the called shape's chain runner before each call. ``sources``: the keys of fx's sources of its graphs
    (hierremat.blocks.sources), to forget when it is dropped."""

    reference: ChainGraph
    stages: tuple[GraphStage, ...]
    orchestrator: fx.GraphModule
    dispatch: torch.nn.Module
    sources: tuple[str, ...]

    @classmethod
    def of(cls, chain: ChainGraph, dispatch: torch.nn.Module) -> "GenericChain | None":
        """``chain``'s graphs made size-generic (:func:`size_generic`), its orchestrator calling the chain through
        ``dispatch``; None where a graph cannot be (the sources of those made forgotten)."""
        sources: list[str] = []
        try:
            with recorded_sources() as sources:
                orchestrator = size_generic(chain.orchestrator)
                modules = [size_generic(stage.graph_module) for stage in chain.stages] if orchestrator is not None \
                    else []
        except BaseException:
            forget_sources(sources)
            raise
        if orchestrator is None or any(m is None for m in modules):
            forget_sources(sources)
            return None
        setattr(orchestrator, CHAIN_ATTRIBUTE, dispatch)
        stages = tuple(GraphStage(m, stage.shared_indices, stage.stage_name) for m, stage in zip(modules, chain.stages))
        return cls(chain, stages, orchestrator, dispatch, tuple(sources))

    def holds_for(self, chain: ChainGraph) -> bool:
        """Whether ``chain`` (specialized from the same symbolic capture at another shape) is this one's program
        (:func:`same_but_sizes`, stage for stage), so that this one runs it."""
        ref = self.reference
        return (len(chain.stages) == len(ref.stages) and chain.residents == ref.residents
                and all(a.shared_indices == b.shared_indices for a, b in zip(chain.stages, ref.stages))
                and same_but_sizes(ref.orchestrator, chain.orchestrator)
                and all(same_but_sizes(a.graph_module, b.graph_module) for a, b in zip(ref.stages, chain.stages)))
