"""One joint graph for every input shape of a stage: the joint traced once with symbolic sizes.

A size-generic stage (hierremat.blocks.generic) computes its sizes from its inputs' at each call. Traced by
:func:`hierremat.blocks.joint.trace_joint` from fake inputs whose sizes are symbols of one ShapeEnv (the symbols
its placeholders' ``SYMBOLIC_SHAPE`` names, made symbols of the trace), it gives a joint graph whose tensors have
symbolic shapes and whose sizes are nodes of their own (``aten.sym_size.int`` and integer arithmetic on them:
hierremat.blocks.joint.is_size_node). That graph is every shape's:

* its BlockGraph at a shape is :func:`hierremat.blocks.joint.to_block_graph` of the joint with its ``sizes`` set
  (:meth:`SymbolicJoint.at_sizes`): each storage's bytes are its symbolic size evaluated there; size nodes are no nodes of
  the BlockGraph (ints, no storage), so its nodes are those of a joint traced at that shape, by name;
* code generated from it (hierremat.runtime.option_codegen) computes each size in each phase from the inputs that
  phase has (:func:`size_sources`), so one program runs at every shape.

The trace holds for the sizes its guards accept (a decomposition that chose by a size), and for inputs laid out as
its fake inputs were: SymbolicJoint.at_sizes says None elsewhere, and that shape is traced on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import sympy
import torch
from torch import fx
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from .generic import NotGeneric, fold_size
from .joint import JointGraph, evaluate_size, size_expr, trace_joint
from .symbolic import SYMBOLIC_SHAPE
from .variants.in_place import in_place_overload, out_overload


@dataclass(frozen=True)
class SymbolicJoint:
    """A stage's joint graph traced with symbolic sizes, and what says where it holds.

    joint: the graph (``sizes`` None: :meth:`at_sizes` gives it at a shape). env: the ShapeEnv it was traced in,
    whose guards (the conditions on its symbols the trace, and the rewrites after it, relied on) must hold at a
    shape it is used at."""

    joint: JointGraph
    env: ShapeEnv

    @property
    def guards(self) -> list:
        """The trace's guards as sympy booleans, in the symbols its tensors' shapes name (a symbol the trace found
        equal to another replaced by it)."""
        return [guard.expr.xreplace(self.env.replacements) for guard in self.env.guards]

    def at_sizes(self, x: torch.Tensor, shared: tuple) -> JointGraph | None:
        """The joint graph costed at the sizes of ``x`` and ``shared`` (JointGraph.sizes: symbol -> int); None where
        their shapes are not the trace's (another rank, a dimension the trace fixed, one symbol of two values), their
        layouts not its (strides, a storage of their own), or a guard fails there."""
        sizes: dict = {}
        placeholders = {n.name: n for n in self.joint.placeholders()}
        values = [(name, value) for name, value in [(self.joint.input_name, x), *zip(self.joint.shared_names, shared)]
                  if placeholders[name].users]  # (a shared value the stage does not read: traced at one shape)
        for name, value in values:  # each symbol's value: where it is a whole dimension of an input
            fake = placeholders[name].meta.get("val")
            if not (isinstance(fake, torch.Tensor) and isinstance(value, torch.Tensor)):
                continue
            if fake.dim() != value.dim():
                return None
            for size, actual in zip(fake.shape, value.shape):
                expr = size_expr(size)
                if isinstance(expr, sympy.Symbol) and sizes.setdefault(expr, int(actual)) != int(actual):
                    return None
        for name, value in values:  # then each size, stride and storage as the trace took them
            fake = placeholders[name].meta.get("val")
            if not (isinstance(fake, torch.Tensor) and isinstance(value, torch.Tensor)):
                continue
            if any(size_expr(size).free_symbols - sizes.keys() for size in fake.shape):
                return None
            # the sizes, and the layout the trace took (strides, a storage of its own): where the graph's views hold
            if ([evaluate_size(size, sizes) for size in fake.shape] != list(value.shape)
                    or any(evaluate_size(st, sizes) != actual for st, actual, n in zip(fake.stride(), value.stride(),
                                                                                         value.shape) if n != 1)
                    or value.storage_offset() != 0
                    or evaluate_size(fake.untyped_storage().nbytes(), sizes) != value.untyped_storage().nbytes()):
                return None
        values = {s: sympy.Integer(v) for s, v in sizes.items()}
        for guard in self.guards:
            held = guard.xreplace(values)
            if held.free_symbols or not bool(held):  # (a guard on a symbol no input binds: not known to hold)
                return None
        return replace(self.joint, sizes=sizes)


def trace_symbolic_joint(stage: torch.nn.Module, x: torch.Tensor, shared: tuple, **trace_options) -> SymbolicJoint:
    """:func:`hierremat.blocks.joint.trace_joint` of ``stage``, a size-generic GraphStage (hierremat.blocks.generic),
    from fake inputs with ``x``'s and ``shared``'s dtypes and devices whose sizes are symbols where its placeholders'
    SYMBOLIC_SHAPE has them (their values at ``x`` and ``shared`` the trace's hints). Raises NotGeneric where the
    stage's placeholders carry no symbolic shapes or a size cannot be made from its symbols."""
    placeholders = list(stage.graph_module.graph.find_nodes(op="placeholder"))
    indices = tuple(getattr(stage, "shared_indices", ()))
    if len(placeholders) != 1 + len(indices):
        raise NotGeneric("the stage's graph does not read x and its shared values as placeholders")
    env = ShapeEnv(duck_shape=False, specialize_zero_one=False)
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    symbols: dict = {}  # the capture's symbol -> the trace's SymInt

    def symint(s: sympy.Symbol, hint: int):
        if s not in symbols:
            made = env.create_symbol(hint, ConstantSource(f"hierremat_{s}"), dynamic_dim=DimDynamic.DYNAMIC)
            symbols[s] = env.create_symintnode(made, hint=hint)
        return symbols[s]

    def fake(value: torch.Tensor, placeholder: fx.Node):
        shape = placeholder.meta.get(SYMBOLIC_SHAPE)
        if not isinstance(shape, tuple) or len(shape) != value.dim():
            raise NotGeneric(f"placeholder {placeholder.name} has no symbolic shape of its rank")
        for size, actual in zip(shape, value.shape):  # (every bare symbol first: an expression folds from them)
            if isinstance(size, sympy.Symbol):
                symint(size, int(actual))
        sizes = [fold_size(size, lambda s: symbols[s] if s in symbols else _unbound(s), lambda op, a, b: op(a, b))
                 if isinstance(size, sympy.Expr) else int(size) for size in shape]
        with mode:
            return torch.empty_strided(sizes, _strides_like(value, sizes), dtype=value.dtype, device=value.device)

    fake_x = fake(x, placeholders[0])
    # (a shared value the stage does not read: of its one shape, where the trace would make symbols of its sizes)
    fake_shared = [mode.from_tensor(v, static_shapes=True) if isinstance(v, torch.Tensor) else v for v in shared]
    for placeholder, index in zip(placeholders[1:], indices):
        if isinstance(shared[index], torch.Tensor):
            fake_shared[index] = fake(shared[index], placeholder)
    joint = trace_joint(stage, fake_x, tuple(fake_shared), **trace_options)
    return SymbolicJoint(joint, env)


def _unbound(symbol):
    raise NotGeneric(f"a size of {symbol}, which no input has as a whole dimension")


def _strides_like(value: torch.Tensor, sizes: list) -> list:
    """Strides for ``sizes`` laid out as ``value`` is: its dimensions in the order of its strides, each dense over
    the ones inside it, an expanded one (stride 0) expanded (SymbolicJoint.at_sizes checks a shape's inputs are)."""
    strides = [0] * len(sizes)
    stride = 1
    for d in sorted(range(value.dim()), key=lambda d: (value.stride(d), -d)):
        if value.stride(d) == 0 and value.shape[d] != 1:
            continue
        strides[d] = stride
        stride = stride * sizes[d]
    return strides


def size_sources(joint: JointGraph) -> dict:
    """Each symbol of a symbolic joint graph -> the (placeholder name, dim) of every input dimension that is it
    (x's, the shared values', the output gradient's): where code generated from the graph reads it."""
    sources: dict = {}
    names = {joint.input_name, *joint.shared_names, *joint.tangent_names.values()}
    for node in joint.placeholders():
        value = node.meta.get("val")
        if node.name in names and isinstance(value, torch.Tensor):
            for d, size in enumerate(value.shape):
                expr = size_expr(size)
                if isinstance(expr, sympy.Symbol):
                    sources.setdefault(expr, []).append((node.name, d))
    return {s: tuple(v) for s, v in sources.items()}


def as_traced(symbolic: JointGraph, static: JointGraph) -> JointGraph | None:
    """``symbolic`` with each tensor node named as the node at its position in ``static`` (the same stage traced at
    one shape, rewritten with the operator variants: a menu solved on such a graph names its nodes, and so do node
    times measured on it), its size nodes named apart (``hr_size_<k>``), and each call that ``static`` runs in place
    (hierremat.blocks.variants.in_place) run so too: whether an argument's storage is whole in the result's layout is
    not always known for symbolic strides, and that program's layout is the same at every size. None where the two
    do not have the same placeholders and the same operators in the same order. (The two traces name nodes
    differently: a symbolic trace's size arithmetic takes names too.)"""
    ours, theirs = symbolic.tensor_nodes(), static.tensor_nodes()
    if ([p.name for p in symbolic.placeholders()] != [p.name for p in static.placeholders()]
            or len(ours) != len(theirs) or any(not _same_call(a.target, b.target) for a, b in zip(ours, theirs))):
        return None
    like = dict(zip(ours, theirs))
    old = symbolic.module.graph
    graph = fx.Graph()
    graph._codegen = old._codegen
    env: dict[fx.Node, fx.Node] = {}
    made_as: dict[str, fx.Node] = {}  # the static graph's name -> the node made
    for k, node in enumerate(old.nodes):
        theirs_node = like.get(node)
        name = theirs_node.name if theirs_node is not None else node.name if node.op != "call_function" \
            else f"hr_size_{k}"
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
        target = node.target
        if theirs_node is not None and theirs_node.target != node.target:  # (run in place as the static graph is)
            target = theirs_node.target
            out = out_overload(node.target)
            if out is not None and out[0] == target:
                kwargs = {**kwargs, out[1]: made_as[theirs_node.kwargs[out[1]].name]}
        made = graph.create_node(node.op, target, args, kwargs, name=name, type_expr=node.type)
        made.meta = dict(node.meta)
        env[node] = made
        made_as[made.name] = made
    if any(env[a].name != b.name for a, b in like.items()):
        return None  # (a name fx would not give)
    names = {node.name: made.name for node, made in env.items()}
    module = fx.GraphModule(symbolic.module, graph)

    def rename(name: str) -> str:
        return names.get(name, name)

    return replace(
        symbolic,
        module=module,
        output_names=tuple(rename(n) for n in symbolic.output_names),
        input_grad_name=rename(symbolic.input_grad_name),
        param_grad_names={t: rename(n) for t, n in symbolic.param_grad_names.items()},
        mutations=tuple((rename(n), t) for n, t in symbolic.mutations),
        phase={rename(n): p for n, p in symbolic.phase.items()},
        resident_grads={j: rename(n) for j, n in symbolic.resident_grads.items()},
    )


def _same_call(ours, theirs) -> bool:
    """Whether a call of ``ours`` is one of ``theirs``: the same operator, or ``theirs`` its in-place or ``out=``
    form."""
    out = out_overload(ours)
    return ours == theirs or theirs == in_place_overload(ours) or (out is not None and theirs == out[0])
