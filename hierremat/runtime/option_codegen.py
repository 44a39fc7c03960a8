"""Generated code for block options: an option's op lists as straight-line Python functions.

A :class:`hierremat.plans.block_options.BlockOption` says, for a stage's joint ATen graph
(hierremat.blocks.joint), which nodes the forward and the backward compute, in which
order, and when each value is freed. :func:`generate_option` turns each phase into a new
fx graph whose nodes are those computations in that order (a node the backward
recomputes is a node of the backward graph), and lets fx generate its Python source:
one line per ATen call, no interpreter loop, no environment dict. A value is dropped
(``name = None``) right after its last use in the phase, which is never later than the
option frees it (the ILP cannot read a value after freeing it without recomputing it,
and a recomputation is a node of its own), so the memory in use is at most what the
ILP modelled, and equal when the ILP frees at last use, as an optimal schedule does.

Functions take their inputs boxed (fx's ``_BoxedCodeGen``: one list, cleared once
unpacked), so that an input, the option's kept values included, is freed at its last
use too rather than held by the caller until the call returns.

What the generated code does besides the graph's ATen calls, as the ILP models it:

* a multi-output op (``native_layer_norm``, ``native_dropout``, ...) is unpacked into its
  read elements at once, so an element no ``getitem`` reads dies with the op's call
  (its workspace) and every other lives as long as its readers;
* the forward copies buffer updates (BatchNorm running statistics) into the stage's
  buffers when computed, never the backward's recomputations;
* the backward hands each parameter gradient to ``accumulate`` as soon as it is computed
  (so it is freed then, and gradient hooks fire as in plain training), and returns the
  input gradient, then the new gradient sum of each resident the stage reads (its seed, the
  sum so far, is an input: hierremat.blocks.joint.seeded_add).

Without ``accumulate`` the graphs are pure, for a compiler (hierremat.runtime.compiled_option):
positional inputs, buffer updates returned after the kept values, parameter gradients
returned after the input gradient and the residents' sums.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import torch
from torch import fx
from torch.fx.graph import _BoxedCodeGen

from ..blocks.generic import fold_size
from ..blocks.joint import JointGraph, is_size_node, size_expr
from ..blocks.symbolic_joint import size_sources
from ..plans.block_options import COMPUTE
from ..plans.block_options import BlockOption

#: Where a generated function's input comes from: ("param", placeholder), ("buffer",
#: placeholder), ("x", ""), ("shared", index), ("dy", ""), ("y", ""), ("kept", slot index) or
#: ("seed", shared index): the gradient sum so far of a resident read with a gradient.
#: Parameters and buffers are named by their placeholder in the joint graph, so that one
#: program runs on every stage of a signature (StageBinding resolves them per stage).
InputSource = tuple[str, object]


@dataclass(frozen=True)
class OptionProgram:
    """The generated forward and backward of one option on one joint graph.

    forward(args) returns ``(y, *kept)``: args as ``forward_inputs`` lists them; kept in
        the order of ``kept_slots``. Pure: ``forward(*args)`` returns ``(y, *kept, *updates)``,
        the new value of each buffer of ``buffer_updates``.
    backward(args) returns ``(dx, *sums)`` (dx None when the graph has none) after
        accumulating every parameter gradient: args as ``backward_inputs`` lists them; sums:
        the new gradient sum of each resident of ``resident_grads``. Pure: ``backward(*args)``
        returns ``(dx, *sums, *grads)``, grads the gradient of each parameter of ``param_grads``.
    kept_slots: (node name, element index or None) of each kept value: an element index
        for an element of a multi-output op kept whole.
    forward_module, backward_module: the fx GraphModules whose code they are.
    """

    forward: Callable
    backward: Callable
    forward_inputs: tuple[InputSource, ...]
    backward_inputs: tuple[InputSource, ...]
    kept_slots: tuple[tuple[str, int | None], ...]
    forward_module: fx.GraphModule
    backward_module: fx.GraphModule
    #: placeholders of the buffers the pure forward returns new values of, in order
    buffer_updates: tuple[str, ...] = ()
    #: placeholders of the parameters the pure backward returns gradients of, in order
    param_grads: tuple[str, ...] = ()
    #: shared positions of the residents whose gradient sums the backward returns, in order
    resident_grads: tuple[int, ...] = ()


class StageBinding:
    """One stage's parameters and buffers by joint-graph placeholder: builds a program's inputs.

    Parameters and buffers are read from their modules at each call, so a stand-in the runner puts
    in their place for one call is what the program gets (hierremat.runtime.tied), and so are the
    model's own once a model planned on meta is materialized (hierremat.runtime.lent_weights)."""

    def __init__(self, joint: JointGraph):
        self._param_slots = {name: self._slot(joint, target) for name, target in joint.param_inputs.items()}
        self._buffer_slots = {name: self._slot(joint, target) for name, target in joint.buffer_inputs.items()}

    @staticmethod
    def _slot(joint: JointGraph, target: str) -> tuple[torch.nn.Module, str]:
        path, _, leaf = target.rpartition(".")
        return joint.stage.get_submodule(path), leaf

    def param(self, name: str) -> torch.nn.Parameter:
        """The parameter the stage computes with now for the placeholder ``name``."""
        holder, leaf = self._param_slots[name]
        return getattr(holder, leaf)

    def buffer(self, name: str) -> torch.Tensor:
        """The buffer the stage computes with now for the placeholder ``name``."""
        holder, leaf = self._buffer_slots[name]
        return getattr(holder, leaf)

    def args(self, sources: tuple[InputSource, ...], x, shared: tuple, dy=None, tape=None, seeds=None) -> list:
        """The input list for ``sources``; tape: the forward's (kept values, x and y if pinned);
        seeds: shared position -> a resident's gradient sum so far (absent: None)."""
        args = []
        for kind, key in sources:
            if kind == "param":
                args.append(self.param(key))  # (programs run without grad)
            elif kind == "buffer":
                args.append(self.buffer(key))
            elif kind == "x":
                args.append(x)
            elif kind == "shared":
                args.append(shared[key])
            elif kind == "dy":
                args.append(dy)
            elif kind == "y":
                args.append(tape.y)
            elif kind == "seed":
                args.append((seeds or {}).get(key))
            else:  # "kept"
                args.append(tape.kept[key])
        return args


class _Elements:
    """The read elements of a multi-output op: element index -> the node holding it."""

    def __init__(self, elements: dict[int, fx.Node]):
        self.elements = elements


class _PhaseBuilder:
    """Builds one phase's fx graph: placeholders on first read, nodes in op-list order."""

    def __init__(self, joint: JointGraph, sources: dict[str, InputSource], boxed: bool):
        self.joint = joint
        self.nodes = {n.name: n for n in joint.module.graph.nodes}
        self.graph = fx.Graph()
        if boxed:
            self.graph.set_codegen(_BoxedCodeGen())
        self.sources = dict(sources)  # original placeholder or kept name -> where it comes from
        self.inputs: list[InputSource] = []
        self.env: dict[str, fx.Node | _Elements] = {}
        self.first_compute: fx.Node | None = None
        self.read_elements = _read_elements(joint.module.graph)
        # a graph traced with symbolic sizes: its size nodes are computed in each phase from an input it has
        self.size_sources = size_sources(joint)
        self.size_dims: dict[str, list] = {}  # input placeholder -> the symbols it has as a dimension
        for symbol, where in self.size_sources.items():
            for name, _ in where:
                self.size_dims.setdefault(name, []).append(symbol)
        self.sizes: dict = {}  # sympy expression -> the node computing it in this phase

    def input(self, name: str, source: InputSource) -> fx.Node:
        """A placeholder for ``source``, placed before every computation (fx's argument order)."""
        if self.first_compute is None:
            node = self.graph.placeholder(_safe(name))
        else:
            with self.graph.inserting_before(self.first_compute):
                node = self.graph.placeholder(_safe(name))
        # The argument is named as the node: fx renames a node whose name is taken and then binds
        # it from its target (``getitem_11 = getitem``), and those lines would clobber a variable
        # that another placeholder's target already bound (a kept ``getitem_11``).
        node.target = node.name
        self.inputs.append(source)
        return node

    def read(self, name: str):
        node = self.nodes.get(name)
        if name not in self.env and node is not None and is_size_node(node):
            return self._size(node)
        if name not in self.env:
            source = self.sources.pop(name, None)
            if source is None:
                raise ValueError(f"the option reads {name!r} before computing it (or after freeing it)")
            self.env[name] = self.input(name, source)
            for symbol in self.size_dims.get(name, ()):  # (its sizes now: it may be freed before a size is needed)
                self._size_of(symbol)
        return self.env[name]

    def _size(self, node: fx.Node):
        """The size ``node`` computes (hierremat.blocks.symbolic_joint), from the sizes of this phase's inputs."""
        return self._size_of(size_expr(node.meta["val"]))

    def _size_of(self, expr):
        return fold_size(expr, self._symbol, lambda op, a, b: self.call(op, a, b), self.sizes)

    def _symbol(self, symbol) -> fx.Node:
        """``symbol`` as a dimension of an input this phase has (each input's are taken when it is read: read)."""
        for name, dim in self.size_sources.get(symbol, ()):  # (inputs: placeholders, never _Elements)
            if name in self.env:
                return self.call(torch.ops.aten.sym_size.int, self.env[name], dim)
        for name, dim in self.size_sources.get(symbol, ()):
            if name in self.sources:
                self.read(name)  # (takes its sizes, this one among them)
                return self.sizes[symbol]
        raise ValueError(f"the size {symbol} is a dimension of no input this phase has")

    def _added(self, node: fx.Node) -> fx.Node:
        if self.first_compute is None:
            self.first_compute = node
        return node

    def compute(self, name: str) -> fx.Node | _Elements:
        node = self.nodes[name]
        base = node.args[0] if node.target is operator.getitem else None
        if isinstance(base, fx.Node) and isinstance(self.read(base.name), _Elements):
            value = self.env[base.name].elements.get(node.args[1])
            if value is None:
                raise ValueError(f"{name} reads an element of {base.name} that no getitem of the graph reads")
        else:
            value = self._added(self.graph.node_copy(node, lambda n: self.read(n.name)))
            used = self.read_elements.get(name)
            if used is not None:  # unpack now: unread elements die with the call
                value = _Elements({i: self.graph.call_function(operator.getitem, (value, i)) for i in sorted(used)})
        self.env[name] = value
        return value

    def call(self, fn: Callable, *args) -> fx.Node:
        return self._added(self.graph.call_function(fn, args))

    def free(self, name: str) -> None:
        self.env.pop(name, None)

    def module(self, root: torch.nn.Module, outputs) -> fx.GraphModule:
        self.graph.output(outputs)
        self.graph.lint()
        return fx.GraphModule(root, self.graph, class_name="GeneratedOption")


def _safe(name: str) -> str:
    return name if name.isidentifier() else "v"


def _read_elements(graph: fx.Graph) -> dict[str, set[int]]:
    """Multi-output node -> the element indices that some getitem node reads."""
    read: dict[str, set[int]] = {}
    for node in graph.nodes:
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            read.setdefault(node.args[0].name, set()).add(node.args[1])
    return read


def _plain_sources(joint: JointGraph, with_input: bool) -> dict[str, InputSource]:
    """Sources of the joint graph's parameter, buffer and shared placeholders (and x's)."""
    sources: dict[str, InputSource] = {}
    for name in joint.param_inputs:
        sources[name] = ("param", name)
    for name in joint.buffer_inputs:
        sources[name] = ("buffer", name)
    for index, name in enumerate(joint.shared_names):
        sources[name] = ("shared", index)
    if with_input:
        sources[joint.input_name] = ("x", "")
    return sources


@dataclass(frozen=True)
class _Forward:
    """A forward phase built by :func:`_build_forward`."""

    builder: _PhaseBuilder
    module: fx.GraphModule
    kept_slots: tuple[tuple[str, int | None], ...]
    buffer_updates: tuple[str, ...]


def _build_forward(joint: JointGraph, fwd_ops: tuple, pure: bool) -> _Forward:
    """The forward phase of ``fwd_ops``: returns ``(y, *kept)``, and the buffer updates after
    them when ``pure`` (else the code copies them into the buffers)."""
    output_name = joint.output_names[0]
    fwd = _PhaseBuilder(joint, _plain_sources(joint, with_input=True), boxed=not pure)
    placeholder_of_buffer = {target: name for name, target in joint.buffer_inputs.items()}
    mutated = {node: placeholder_of_buffer[target] for node, target in joint.mutations}
    buffers: dict[str, fx.Node] = {}
    updates: dict[str, fx.Node] = {}
    for kind, name in fwd_ops:
        if kind != COMPUTE:
            fwd.free(name)
            continue
        value = fwd.compute(name)
        buffer = mutated.get(name)
        if buffer is None:
            continue
        if pure:
            updates[buffer] = value
            continue
        if buffer not in buffers:
            buffers[buffer] = fwd.input(f"buffer_{len(buffers)}", ("buffer", buffer))
        fwd.call(_copy_into, buffers[buffer], value)
    y = fwd.env.get(output_name)
    if not isinstance(y, fx.Node):
        raise ValueError(f"the forward does not leave the stage output {output_name} computed")
    skipped = sorted(set(mutated) - {name for kind, name in fwd_ops if kind == COMPUTE})
    if skipped:
        raise ValueError(f"the forward skips {skipped}, whose values update buffers")
    computed = [n for n in fwd.env if n not in fwd.nodes or fwd.nodes[n].op != "placeholder"]
    kept_slots: list[tuple[str, int | None]] = []
    kept_values: list[fx.Node] = []
    for name in computed:
        if name == output_name:
            continue
        value = fwd.env[name]
        if isinstance(value, _Elements):
            for index, element in value.elements.items():
                kept_slots.append((name, index))
                kept_values.append(element)
        else:
            kept_slots.append((name, None))
            kept_values.append(value)
    module = fwd.module(joint.module, (y, *kept_values, *updates.values()))
    return _Forward(fwd, module, tuple(kept_slots), tuple(updates))


def _check_one_output(joint: JointGraph) -> None:
    if len(joint.output_names) != 1 or len(joint.tangent_names) != 1:
        raise ValueError("block options run only on stages with one output and one output gradient")


@dataclass(frozen=True)
class ForwardProgram:
    """A stage's generated forward without grad (F_none / F_ck): ``forward(args)`` returns the
    output (buffer updates copied into the buffers); pure, ``forward(*args)`` returns
    ``(y, *updates)``, the new value of each buffer of ``buffer_updates``."""

    forward: Callable
    inputs: tuple[InputSource, ...]
    module: fx.GraphModule
    buffer_updates: tuple[str, ...] = ()


def generate_forward_only(joint: JointGraph, ops: tuple, pure: bool = False) -> ForwardProgram:
    """Generate the no-grad forward whose op list (hierremat.ilp.options.forward_only) keeps nothing."""
    _check_one_output(joint)
    built = _build_forward(joint, ops, pure)
    if built.kept_slots:
        raise ValueError(f"a forward without grad keeps nothing, this one keeps {[n for n, _ in built.kept_slots]}")
    return ForwardProgram(built.module.forward, tuple(built.builder.inputs), built.module, built.buffer_updates)


def generate_option(joint: JointGraph, option: BlockOption, accumulate: Callable | None = None) -> OptionProgram:
    """Generate ``option``'s forward and backward functions on ``joint``.

    accumulate(param, grad): called by the backward with each parameter and its gradient,
    as soon as it is computed. None: pure graphs (see the module docstring).
    """
    _check_one_output(joint)
    pure = accumulate is None
    output_name = joint.output_names[0]
    (tangent_name,) = joint.tangent_names.values()
    try:
        built = _build_forward(joint, option.fwd_ops, pure)
    except ValueError as err:
        raise ValueError(f"option {option.name!r}: {err}") from None
    fwd, forward, kept_slots = built.builder, built.module, built.kept_slots

    bwd_sources = _plain_sources(joint, with_input=option.pins_input)
    bwd_sources[tangent_name] = ("dy", "")
    for position, name in joint.resident_seeds.items():
        bwd_sources[name] = ("seed", position)
    if option.pins_output:
        bwd_sources[output_name] = ("y", "")
    bwd = _PhaseBuilder(joint, bwd_sources, boxed=not pure)
    kept_elements: dict[str, dict[int, int]] = {}
    for slot, (name, index) in enumerate(kept_slots):
        if index is None:
            bwd.sources[name] = ("kept", slot)
        else:
            kept_elements.setdefault(name, {})[index] = slot
    params: dict[str, fx.Node] = {}
    grads: dict[str, fx.Node] = {}
    placeholder_of_param = {target: name for name, target in joint.param_inputs.items()}
    grad_of = {node: placeholder_of_param[target] for target, node in joint.param_grad_names.items()}
    dx = None
    sums: dict[str, fx.Node] = {}
    sum_names = set(joint.resident_grads.values())
    for kind, name in option.bwd_ops:
        if kind != COMPUTE:
            bwd.free(name)
            continue
        node = bwd.nodes[name]
        for arg in node.all_input_nodes:  # kept elements of a multi-output op: placeholders when first read
            if arg.name in kept_elements and arg.name not in bwd.env:
                bwd.env[arg.name] = _Elements({
                    index: bwd.input(f"{arg.name}_{index}", ("kept", slot)) for index, slot in kept_elements.pop(arg.name).items()
                })
        value = bwd.compute(name)
        target = grad_of.get(name)
        if target is not None and pure:
            grads[target] = value
        elif target is not None:
            if target not in params:
                params[target] = bwd.input(f"param_{len(params)}", ("param", target))
            bwd.call(accumulate, params[target], value)
        if name == joint.input_grad_name:
            dx = value
        if name in sum_names:
            sums[name] = value
    missing = sum_names - set(sums)
    if missing:
        raise ValueError(f"option {option.name!r} does not compute the residents' gradient sums {sorted(missing)}")
    resident_sums = tuple(sums[name] for name in joint.resident_grads.values())
    backward = bwd.module(joint.module, (dx, *resident_sums, *grads.values()) if pure else (dx, *resident_sums))
    return OptionProgram(
        forward=forward.forward,
        backward=backward.forward,
        forward_inputs=tuple(fwd.inputs),
        backward_inputs=tuple(bwd.inputs),
        kept_slots=kept_slots,
        forward_module=forward,
        backward_module=backward,
        buffer_updates=built.buffer_updates,
        param_grads=tuple(grads),
        resident_grads=tuple(joint.resident_grads),
    )


def _copy_into(buffer: torch.Tensor, value: torch.Tensor) -> None:
    buffer.copy_(value)
