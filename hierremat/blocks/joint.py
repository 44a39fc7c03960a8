"""One stage's joint forward+backward ATen graph, and its BlockGraph.

How the joint graph is obtained
-------------------------------
With PyTorch's own AOTAutograd, through
``torch._functorch.aot_autograd.aot_export_joint_with_descriptors`` (the API behind
autoparallel). It traces ``stage(x, *shared)`` and ``torch.autograd.grad`` of its
outputs with fake tensors (nothing runs, no buffer changes, no RNG drawn) into ONE
functional ATen graph:

* parameters and buffers are lifted as placeholders (``ParamAOTInput`` /
  ``BufferAOTInput`` descriptors in ``node.meta["desc"]``), then the plain inputs
  ``x, *shared`` (``PlainAOTInput(idx)``), then one ``tangents_*`` placeholder per
  differentiable output (``TangentAOTInput``);
* the graph is functionalised: in-place buffer updates (BatchNorm running stats) become
  extra forward outputs (``InputMutationAOTOutput``) that the caller copies back;
* outputs are described too: ``PlainAOTOutput(idx)`` (the stage's outputs),
  ``GradAOTOutput(grad_of=...)`` (gradients of parameters and of x);
* every node carries ``meta["partitioner_tag"]``: ``"is_forward"`` for what was traced
  before ``autograd.grad`` started, ``"is_backward"`` after: that is the phase;
* every node has a fake tensor in ``meta["val"]`` (shape, dtype, storage identity, so
  views and their bases are known without running anything).

Random operators stay stateful ATen ops (``aten.native_dropout``, ``aten.bernoulli``,
...) tagged ``torch.Tag.nondeterministic_seeded``; run in graph order from the same RNG
state they draw exactly what eager autograd draws. (AOTAutograd can also functionalise
RNG into philox seed/offset inputs, CUDA only, via
``torch._functorch.config.functionalize_rng_ops``; we do not enable it, and refuse
graphs that have such inputs rather than misread them.)

In the BlockGraph, a multi-output operator (``native_layer_norm``, ``native_dropout``,
``_native_batch_norm_legit_functional``, ``convolution_backward``) is one node that
carries the time and owns the bytes of every element some ``getitem`` reads: the kernel
allocates them all at once. Its ``getitem`` users are views of it (0 bytes, time 0), so
the ILP computes, keeps and frees the operator's results together (they cannot be
recomputed one by one). Elements no ``getitem`` reads are freed at once, so their bytes
are the operator's workspace. A list of views of one storage (``split``) aliases that
storage's owner.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import sympy
import torch
from torch import fx, nn
from torch.multiprocessing.reductions import StorageWeakRef

from ..plans.block_graph import BACKWARD, FORWARD, BlockGraph, GraphNode
from ..device.autocast import AutocastState
from ..device.memory import allocated_bytes, owning
from .nodes import target_name

try:  # descriptor classes (torch >= 2.9)
    from torch._functorch._aot_autograd.descriptors import (
        BufferAOTInput,
        GradAOTOutput,
        InputMutationAOTOutput,
        ParamAOTInput,
        PlainAOTInput,
        PlainAOTOutput,
        TangentAOTInput,
    )
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
except ImportError:  # pragma: no cover - older torch
    aot_export_joint_with_descriptors = None


@dataclass
class JointGraph:
    """A stage's joint forward+backward graph and what its inputs and outputs mean.

    module: the joint fx GraphModule; run it flat with :func:`joint_inputs` (or use
        :func:`run_joint`), outputs in ``module.graph``'s output node order.
    stage: the traced stage (its parameters and buffers feed the param/buffer placeholders).
    param_inputs / buffer_inputs: placeholder name -> parameter / buffer target in ``stage``.
    input_name: placeholder of x; shared_names: placeholders of ``shared`` (in order).
    tangent_names: placeholder of the gradient of each differentiable output (output
        index -> name).
    output_names: node of each stage output, in the stage's output order.
    input_grad_name: node computing the gradient of x ("" if x needs none).
    param_grad_names: parameter target -> node computing its gradient.
    mutations: (node, buffer target): forward results to copy into buffers (BatchNorm
        running statistics), in order.
    phase: node name -> "forward" / "backward" for every call_function node.
    resident_seeds / resident_grads: for each position in ``shared`` of a value read with a
        gradient (a resident, hierremat.plans.stage_info.ResidentLayout), the placeholder of the
        gradient its later readers summed so far (None at run time when there is none yet)
        and the node computing the new sum (see :func:`_seed_resident_grads`).
    """

    module: fx.GraphModule
    stage: nn.Module
    param_inputs: dict[str, str]
    buffer_inputs: dict[str, str]
    input_name: str
    shared_names: tuple[str, ...]
    tangent_names: dict[int, str]
    output_names: tuple[str, ...]
    input_grad_name: str
    param_grad_names: dict[str, str]
    mutations: tuple[tuple[str, str], ...]
    phase: dict[str, str] = field(repr=False)
    resident_seeds: dict[int, str] = field(default_factory=dict)
    resident_grads: dict[int, str] = field(default_factory=dict)
    #: a graph traced with symbolic sizes (hierremat.blocks.symbolic_joint): each symbol's value at the shape it is
    #: costed at (storage bytes, :func:`to_block_graph`); None for a graph traced at one shape
    sizes: dict | None = field(default=None, repr=False)

    @property
    def nodes(self) -> list[fx.Node]:
        return list(self.module.graph.nodes)

    def compute_nodes(self) -> list[fx.Node]:
        return [n for n in self.module.graph.nodes if n.op == "call_function"]

    def tensor_nodes(self) -> list[fx.Node]:
        """The compute nodes except size nodes (:func:`is_size_node`): the BlockGraph's nodes."""
        return [n for n in self.module.graph.nodes if n.op == "call_function" and not is_size_node(n)]

    @property
    def forward_node_names(self) -> list[str]:
        return [name for name, ph in self.phase.items() if ph == FORWARD]

    @property
    def backward_node_names(self) -> list[str]:
        return [name for name, ph in self.phase.items() if ph == BACKWARD]

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.module.graph.nodes if n.op == "placeholder"]

    def output_descs(self) -> list:
        return list(_output_node(self.module).meta.get("desc") or [])


def _output_node(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


def is_random_node(node: fx.Node) -> bool:
    """The op draws random numbers: tagged ``nondeterministic_seeded``, except attention
    kernels (``_scaled_dot_product_*``, tagged whatever their arguments) called with
    ``dropout_p == 0``, which draw nothing."""
    target = node.target
    if not (isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags):
        return False
    for i, arg in enumerate(target._schema.arguments):
        if arg.name == "dropout_p":
            value = node.kwargs.get("dropout_p", node.args[i] if i < len(node.args) else arg.default_value)
            return value is None or not isinstance(value, (int, float)) or value > 0
    return True


def is_view_node(node: fx.Node) -> bool:
    """Whether the op's schema says its (first) result aliases an input without writing it
    (views, getitem of a list of views; not in-place operators)."""
    target = node.target
    if target is operator.getitem:
        return False
    if isinstance(target, torch._ops.OpOverload):
        returns = target._schema.returns
        return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write
    return False


def overwritten_argument(node: fx.Node) -> fx.Node | None:
    """The argument an in-place or ``out=`` operator call overwrites and returns (``add_``'s
    first, ``gelu_backward.grad_input``'s ``grad_input``), or None."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    returns = target._schema.returns
    info = returns[0].alias_info if returns else None
    if info is None or not info.is_write:
        return None
    for i, a in enumerate(target._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = node.args[i] if i < len(node.args) and not a.kwarg_only else node.kwargs.get(a.name)
            return value if isinstance(value, fx.Node) else None
    return None


class _ForwardUnderAutocast(nn.Module):
    """``stage`` whose forward runs under an autocast setting, so that a joint trace records the
    casts of the forward and traces the backward as autograd runs it after the context closed."""

    PREFIX = "stage."

    def __init__(self, stage: nn.Module, autocast: AutocastState):
        super().__init__()
        self.stage = stage
        self.autocast = autocast

    def forward(self, *args):
        with self.autocast.applied():
            return self.stage(*args)


class _TappedResidents(nn.Module):
    """``stage`` whose shared values at ``positions`` (residents read with a gradient) are read
    through a copy that is also returned: the trace then takes a tangent for each copy, which
    autograd puts in the copy's gradient buffer *before* the stage's own terms arrive, so the
    traced backward adds the terms to it in the order plain autograd adds them to the sum the
    later readers made. :func:`_seed_resident_grads` removes the copies again."""

    PREFIX = "stage."

    def __init__(self, stage: nn.Module, positions: tuple[int, ...]):
        super().__init__()
        self.stage = stage
        self.positions = positions

    def forward(self, x, *shared):
        shared = list(shared)
        taps = []
        for j in self.positions:
            shared[j] = shared[j].clone()
            taps.append(shared[j])
        return (self.stage(x, *shared), *taps)


def seeded_add(seed: torch.Tensor | None, term: torch.Tensor) -> torch.Tensor:
    """A resident's gradient sum after one reader's first term: ``seed + term``, or the term
    alone when no later reader contributed (there is no sum yet), as plain autograd forms it;
    copied where the term is a slice of a larger gradient (cat's backward), which the sum,
    held until the resident's producer runs its backward, would otherwise keep alive: the
    models count the sum at its own bytes (the traced node is an addition)."""
    return owning(term) if seed is None else torch.add(seed, term)


def trace_joint(
    stage: nn.Module, x: torch.Tensor, shared: tuple = (), input_requires_grad: bool | None = None,
    autocast: AutocastState | None = None, backward_under_autocast: bool = False,
    resident_grads: tuple[int, ...] = (),
) -> JointGraph:
    """Trace ``stage(x, *shared)`` forward and backward into one functional ATen graph.

    input_requires_grad: whether the gradient of x is part of the graph (default: x is
        floating point). Shared values are traced without gradient.
    autocast: the setting the forward runs under (None: autocast off). Every cast it makes
        becomes an explicit ``_to_copy`` node. The backward is traced with autocast off, as
        autograd runs it after a training step's autocast context closed, unless
        ``backward_under_autocast`` (one context around forward and backward: then autocast
        applies to the backward's ops too, as in eager mode).
    resident_grads: positions in ``shared`` of values read with a gradient (residents): the
        graph computes each one's gradient sum from the sum so far (``resident_seeds``).
    Tracing uses fake tensors: the stage's buffers and the RNG state are not touched.
    """
    if aot_export_joint_with_descriptors is None:  # pragma: no cover
        raise RuntimeError("hierremat.blocks.joint needs torch >= 2.9 (aot_export_joint_with_descriptors)")
    resident_grads = tuple(resident_grads)
    autocast = autocast if autocast is not None else AutocastState.off((x.device.type,))
    gm, prefix = _exported_joint(stage, x, tuple(shared), input_requires_grad, autocast, backward_under_autocast,
                                 resident_grads)

    def own(target: str) -> str:  # the stage's name of a parameter or buffer of the traced module
        return target.removeprefix(prefix)

    params, buffers, plain, tangents = _joint_inputs(gm, own)
    outputs, param_grads, shared_grads, input_grad, mutations = _joint_outputs(gm, own, resident_grads)
    seeds = {}
    if resident_grads:
        seeds = {j: tangents.pop(1 + k) for k, j in enumerate(resident_grads)}
        taps = {j: outputs.pop(1 + k) for k, j in enumerate(resident_grads)}
        shared_grads = _seed_resident_grads(gm, seeds, taps, shared_grads)
    phase = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            phase[node.name] = BACKWARD if node.meta.get("partitioner_tag") == "is_backward" else FORWARD
    _check_phase_order(gm, phase, set(tangents.values()) | set(seeds.values()))
    return JointGraph(
        module=gm,
        stage=stage,
        param_inputs=params,
        buffer_inputs=buffers,
        input_name=plain[0],
        shared_names=tuple(plain[i] for i in sorted(plain) if i != 0),
        tangent_names=dict(sorted(tangents.items())),
        output_names=tuple(outputs[i] for i in sorted(outputs)),
        input_grad_name=input_grad,
        param_grad_names=param_grads,
        mutations=tuple(mutations),
        phase=phase,
        resident_seeds=seeds,
        resident_grads=shared_grads,
    )


def _exported_joint(stage: nn.Module, x: torch.Tensor, shared: tuple, input_requires_grad: bool | None,
                    autocast: AutocastState, backward_under_autocast: bool,
                    resident_grads: tuple[int, ...]) -> tuple[fx.GraphModule, str]:
    """``stage``'s joint graph as AOTAutograd exports it (with descriptors), and the prefix its wrappers put on
    the stage's parameter and buffer names (trace_joint says what the arguments mean)."""
    if input_requires_grad is None:
        input_requires_grad = x.is_floating_point() or x.is_complex()
    x_in = x.detach().requires_grad_(input_requires_grad)
    shared_in = tuple(
        (s.detach().requires_grad_(j in resident_grads) if isinstance(s, torch.Tensor) else s)
        for j, s in enumerate(shared)
    )
    for j in resident_grads:
        if not (isinstance(shared_in[j], torch.Tensor) and shared_in[j].is_floating_point()):
            raise ValueError(f"shared value {j} is read with a gradient but is not a floating tensor")
    wrapped = autocast.enabled and not backward_under_autocast
    traced = _ForwardUnderAutocast(stage, autocast) if wrapped else stage
    if resident_grads:
        traced = _TappedResidents(traced, resident_grads)
    prefix = _TappedResidents.PREFIX * bool(resident_grads) + _ForwardUnderAutocast.PREFIX * wrapped
    ambient = autocast if backward_under_autocast else AutocastState.off((x.device.type,))
    with contextlib.ExitStack() as stack:
        stack.enter_context(ambient.applied())
        exported = aot_export_joint_with_descriptors(stack, traced, (x_in, *shared_in))
        return exported.graph_module, prefix


def _joint_inputs(gm: fx.GraphModule, own: Callable[[str], str]):
    """The joint graph's placeholders by their descriptors: parameters and buffers (node name -> the stage's name),
    plain inputs (position -> node name: x is 0) and tangents (output position -> node name)."""
    params, buffers, tangents = {}, {}, {}
    plain: dict[int, str] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        desc = node.meta.get("desc")
        if isinstance(desc, ParamAOTInput):
            params[node.name] = own(desc.target)
        elif isinstance(desc, BufferAOTInput):
            buffers[node.name] = own(desc.target)
        elif isinstance(desc, PlainAOTInput):
            plain[desc.idx] = node.name
        elif isinstance(desc, TangentAOTInput) and isinstance(desc.output, PlainAOTOutput):
            tangents[desc.output.idx] = node.name
        else:
            raise NotImplementedError(
                f"joint graph input {node.name} has a descriptor hierremat does not handle: {desc!r}"
            )
    if 0 not in plain:
        raise ValueError("the traced stage does not read its input x")
    return params, buffers, plain, tangents


def _joint_outputs(gm: fx.GraphModule, own: Callable[[str], str], resident_grads: tuple[int, ...]):
    """The joint graph's outputs by their descriptors: plain outputs (position -> node name), parameter gradients
    (the stage's name -> node name), residents' gradients (shared position -> node name), the input's gradient
    ("" where it has none) and buffer mutations ((node name, buffer name) pairs)."""
    out_node = _output_node(gm)
    outs = list(out_node.args[0])
    descs = out_node.meta.get("desc") or [None] * len(outs)
    outputs: dict[int, str] = {}
    param_grads: dict[str, str] = {}
    shared_grads: dict[int, str] = {}
    input_grad = ""
    mutations = []
    for value, desc in zip(outs, descs):
        if value is None or desc is None:
            continue
        if not isinstance(value, fx.Node):
            raise NotImplementedError(f"joint graph output {value!r} is not a graph value")
        if isinstance(desc, PlainAOTOutput):
            outputs[desc.idx] = value.name
        elif isinstance(desc, InputMutationAOTOutput) and isinstance(desc.mutated_input, BufferAOTInput):
            mutations.append((value.name, own(desc.mutated_input.target)))
        elif isinstance(desc, GradAOTOutput):
            of = desc.grad_of
            if isinstance(of, ParamAOTInput):
                param_grads[own(of.target)] = value.name
            elif isinstance(of, PlainAOTInput) and of.idx == 0:
                input_grad = value.name
            elif isinstance(of, PlainAOTInput) and of.idx - 1 in resident_grads:
                shared_grads[of.idx - 1] = value.name
            # gradients of other shared values are dropped: they are grad-free by contract
        else:
            raise NotImplementedError(f"joint graph output {value.name} has a descriptor hierremat does not handle: {desc!r}")
    return outputs, param_grads, shared_grads, input_grad, mutations


def _seed_resident_grads(gm: fx.GraphModule, seeds: dict[int, str], taps: dict[int, str],
                         grads: dict[int, str]) -> dict[int, str]:
    """Remove the copies :class:`_TappedResidents` made (their readers read the resident itself;
    they are no outputs any more) and make each seed's first addition a :func:`seeded_add`, so
    that the graph also runs without a seed. Returns position -> the node of the new sum.

    Raises ValueError where a resident's gradient is not the seed plus the stage's terms (a
    resident read only by operators without a gradient)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    out_node = _output_node(gm)
    tap_nodes = {nodes[name] for name in taps.values()}
    kept = [(v, d) for v, d in zip(out_node.args[0], out_node.meta.get("desc") or []) if v not in tap_nodes]
    out_node.args = ([v for v, _ in kept],)
    out_node.meta["desc"] = [d for _, d in kept]
    for j, name in taps.items():
        tap = nodes[name]
        if tap.target is not torch.ops.aten.clone.default:  # pragma: no cover - the wrapper's clone
            raise AssertionError(f"resident copy {name} is {tap.target}")
        tap.replace_all_uses_with(tap.args[0])
        gm.graph.erase_node(tap)
    sums = {}
    for j, name in seeds.items():
        seed = nodes[name]
        users = list(seed.users)
        first = users[0] if len(users) == 1 else None
        if j not in grads or first is None or first.target is not torch.ops.aten.add.Tensor or first.kwargs \
                or len(first.args) != 2 or grads[j] == name:
            raise ValueError(f"the gradient of shared value {j} is not a sum of the stage's terms")
        term = first.args[1] if first.args[0] is seed else first.args[0]
        with gm.graph.inserting_before(first):
            new = gm.graph.call_function(seeded_add, (seed, term))
        new.meta = dict(first.meta)
        first.replace_all_uses_with(new)
        gm.graph.erase_node(first)
        sums[j] = new.name if grads[j] == first.name else grads[j]
    gm.graph.lint()
    gm.recompile()
    return sums


def _check_phase_order(gm: fx.GraphModule, phase: dict[str, str], tangents: set[str]) -> None:
    """Forward nodes read no tangent and no backward node (the graph order may interleave; data may not)."""
    for node in gm.graph.nodes:
        if phase.get(node.name) != FORWARD:
            continue
        for a in node.all_input_nodes:
            if a.name in tangents or phase.get(a.name) == BACKWARD:
                raise AssertionError(f"forward node {node.name} reads {a.name}, which belongs to the backward")


# --------------------------------------------------------------------------- execution


def joint_inputs(joint: JointGraph, x: torch.Tensor, shared: tuple, tangents, seeds: dict | None = None) -> list:
    """Flat inputs of ``joint.module`` in placeholder order.

    tangents: one tensor, or a sequence with one per differentiable output (by output index).
    seeds: shared position -> the gradient sum so far of each resident the graph reads with a
    gradient (``joint.resident_seeds``), or None where there is none (default: zeros).
    """
    shared = tuple(shared)
    if isinstance(tangents, torch.Tensor):
        tangents = (tangents,)
    if seeds is None:
        seeds = {j: torch.zeros_like(shared[j]) for j in joint.resident_seeds}
    by_seed = {name: seeds[j] for j, name in joint.resident_seeds.items()}
    named = dict(joint.stage.named_parameters(remove_duplicate=False))
    named.update(joint.stage.named_buffers(remove_duplicate=False))
    plain = {joint.input_name: x, **dict(zip(joint.shared_names, shared))}
    by_tangent = {name: tangents[i] for i, name in joint.tangent_names.items()}
    args = []
    for node in joint.placeholders():
        if node.name in joint.param_inputs:
            args.append(named[joint.param_inputs[node.name]].detach())
        elif node.name in joint.buffer_inputs:
            args.append(named[joint.buffer_inputs[node.name]].detach())
        elif node.name in plain:
            value = plain[node.name]
            args.append(value.detach() if isinstance(value, torch.Tensor) else value)
        elif node.name in by_tangent:
            args.append(by_tangent[node.name])
        elif node.name in by_seed:
            args.append(by_seed[node.name])
        else:  # pragma: no cover - trace_joint refuses other placeholders
            raise AssertionError(node.name)
    return args


@dataclass
class JointResult:
    outputs: tuple[torch.Tensor, ...]
    input_grad: torch.Tensor | None
    param_grads: dict[str, torch.Tensor]
    buffer_updates: dict[str, torch.Tensor]
    #: shared position -> the gradient sum of each resident read with a gradient
    resident_grads: dict[int, torch.Tensor] = field(default_factory=dict)


def run_joint(joint: JointGraph, x, shared: tuple, tangents, apply_mutations: bool = True,
              seeds: dict | None = None) -> JointResult:
    """Execute the joint graph node by node (fx Interpreter), without autograd.

    apply_mutations: copy the new buffer values (BatchNorm running stats) into the
    stage's buffers, as eager training would. seeds: as :func:`joint_inputs` takes them.
    """
    args = joint_inputs(joint, x, shared, tangents, seeds)
    with torch.no_grad(), AutocastState.off((x.device.type,)).applied():  # the graph's casts are explicit
        flat = fx.Interpreter(joint.module).run(*args, enable_io_processing=False)
    out_node = _output_node(joint.module)
    values = {a.name: v for a, v in zip(out_node.args[0], flat) if isinstance(a, fx.Node)}
    updates = {target: values[name] for name, target in joint.mutations}
    if apply_mutations:
        buffers = dict(joint.stage.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for target, value in updates.items():
                buffers[target].copy_(value)
    return JointResult(
        outputs=tuple(values[n] for n in joint.output_names),
        input_grad=values.get(joint.input_grad_name) if joint.input_grad_name else None,
        param_grads={t: values[n] for t, n in joint.param_grad_names.items()},
        buffer_updates=updates,
        resident_grads={j: values[n] for j, n in joint.resident_grads.items()},
    )


# --------------------------------------------------------------------------- BlockGraph


def is_size_node(node: fx.Node) -> bool:
    """Whether ``node`` computes a size (a SymInt) rather than a tensor: ``aten.sym_size.int`` and the integer
    arithmetic on it that a trace with symbolic sizes records (hierremat.blocks.symbolic_joint)."""
    return node.op == "call_function" and isinstance(node.meta.get("val"),
                                                     (torch.SymInt, torch.SymFloat, torch.SymBool))


def size_expr(value) -> sympy.Expr:
    """A size's sympy expression (a SymInt's, in its trace's symbols), or the integer's."""
    if isinstance(value, (torch.SymFloat, torch.SymBool)):
        raise ValueError(f"{value} is a {type(value).__name__}, not an integer size")
    return value.node.expr if isinstance(value, torch.SymInt) else sympy.Integer(int(value))


def evaluate_size(value, sizes: dict | None) -> int:
    """``value`` (an int or a SymInt) at ``sizes`` (symbol -> int)."""
    expr = size_expr(value)
    if expr.free_symbols:
        if sizes is None or not expr.free_symbols <= sizes.keys():
            raise ValueError(f"a size {expr} of a graph traced with symbolic sizes, evaluated without its symbols' "
                             "values")
        expr = expr.xreplace({s: sympy.Integer(sizes[s]) for s in expr.free_symbols})
    return int(expr)


def _tensor_bytes(t: torch.Tensor, sizes: dict | None = None) -> int:
    """Bytes of t's storage as the budget's meter on t's device counts them (its symbolic size at ``sizes``)."""
    try:
        nbytes = t.untyped_storage().nbytes()
    except Exception:  # pragma: no cover - tensors without storage
        nbytes = t.numel() * t.element_size()
    return allocated_bytes(evaluate_size(nbytes, sizes), t.device)


def _op_name(node: fx.Node) -> str:
    if node.target is operator.getitem:
        return "getitem"
    return target_name(node.target)


@dataclass(frozen=True)
class NodeLayout:
    """Per node: bytes it owns, the node/input whose storage it shares, unused tuple bytes."""

    out_bytes: dict[str, int]
    alias_of: dict[str, str]
    unused_bytes: dict[str, int]


def storage_layout(joint: JointGraph) -> NodeLayout:
    """Who owns which storage, from the fake tensors in ``meta["val"]``.

    A node whose result's storage already exists (a view, a getitem of a list of views,
    ``_unsafe_view``, ``detach``, an in-place operator's result) owns nothing and aliases the
    storage's owner (a node or a placeholder). A tuple-valued node owns nothing either; its getitems own the elements.
    """
    owner: dict[StorageWeakRef, str] = {}
    out_bytes, alias_of, unused = {}, {}, {}
    for node in joint.module.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder":
            if isinstance(val, torch.Tensor):
                owner.setdefault(StorageWeakRef(val.untyped_storage()), node.name)
            continue
        if node.op != "call_function" or is_size_node(node):
            continue
        out_bytes[node.name] = 0
        if isinstance(val, torch.Tensor):
            key = StorageWeakRef(val.untyped_storage())
            overwritten = overwritten_argument(node)
            if overwritten is not None and key not in owner:
                # an in-place result is its argument: its storage is the argument's, whatever
                # storage the traced value had (hierremat.blocks.variants.in_place keeps the trace's)
                arg_val = overwritten.meta.get("val")
                arg_key = StorageWeakRef(arg_val.untyped_storage()) if isinstance(arg_val, torch.Tensor) else None
                if arg_key in owner:
                    owner[key] = owner[arg_key]
            if key in owner:
                alias_of[node.name] = owner[key]
            else:
                owner[key] = node.name
                out_bytes[node.name] = _tensor_bytes(val, joint.sizes)
        elif isinstance(val, (tuple, list)):
            tensors = [v for v in val if isinstance(v, torch.Tensor)]
            owners = {owner.get(StorageWeakRef(v.untyped_storage())) for v in tensors}
            if tensors and None not in owners and len(owners) == 1:
                alias_of[node.name] = owners.pop()  # a list of views (split, unbind) of one storage
                continue
            used = {u.args[1] for u in node.users if u.target is operator.getitem}
            unused[node.name] = sum(
                _tensor_bytes(v, joint.sizes)
                for i, v in enumerate(val)
                if isinstance(v, torch.Tensor) and i not in used and StorageWeakRef(v.untyped_storage()) not in owner
            )
    return NodeLayout(out_bytes, alias_of, unused)


def to_block_graph(joint: JointGraph, node_costs: dict[str, tuple[float, int]] | None = None) -> BlockGraph:
    """The BlockGraph of a traced stage: forward nodes, then backward nodes, in graph order.

    node_costs: node name -> (seconds, workspace bytes), e.g. from
    :func:`hierremat.runtime.node_profile.profile_nodes`; missing nodes cost 0.
    Inputs list only activation-carrying names (nodes, x, the output gradient);
    parameters, buffers, shared values and residents' gradient seeds are omitted (the chain DP
    counts them). Views own 0 bytes and name the
    storage's owner in ``alias_of`` ("" when that is a parameter, buffer or shared value).
    """
    if len(joint.output_names) != 1 or len(joint.tangent_names) != 1:
        raise ValueError(
            f"a BlockGraph has one output with a gradient; this stage has {len(joint.output_names)} outputs "
            f"and {len(joint.tangent_names)} differentiable ones"
        )
    node_costs = node_costs or {}
    layout = storage_layout(joint)
    (tangent,) = joint.tangent_names.values()
    activation = {joint.input_name, tangent}
    placeholders = {n.name: n for n in joint.placeholders()}
    # the elements of a multi-output op are allocated by the op: it owns their bytes
    element_bytes: dict[str, int] = {}
    element_of: dict[str, str] = {}  # getitem owning an element -> its op
    for node in joint.tensor_nodes():
        source = node.args[0] if node.target is operator.getitem and node.args else None
        if isinstance(source, fx.Node) and source.name in layout.unused_bytes and not layout.alias_of.get(node.name):
            element_bytes[source.name] = element_bytes.get(source.name, 0) + layout.out_bytes[node.name]
            element_of[node.name] = source.name
    nodes_fwd, nodes_bwd = [], []
    for node in joint.tensor_nodes():
        name = node.name
        activation.add(name)
        inputs = tuple(dict.fromkeys(a.name for a in node.all_input_nodes if a.name in activation))
        alias = layout.alias_of.get(name, "")
        alias = element_of.get(alias, alias)  # a view of an op's element is a view of the op
        if alias and alias in placeholders and alias not in (joint.input_name, tangent):
            alias = ""  # a view of a parameter, buffer or shared value: free, no activation storage
        out_bytes = layout.out_bytes[name] + element_bytes.get(name, 0)
        source = node.args[0] if node.target is operator.getitem and node.args else None
        if not alias and isinstance(source, fx.Node) and source.name in element_bytes:
            alias, out_bytes = source.name, 0  # an element of a multi-output op: a view of the op
        time_s, workspace, *scratch = node_costs.get(name, (0.0, 0))
        graph_node = GraphNode(
            name=name,
            op=_op_name(node),
            phase=joint.phase[name],
            inputs=inputs,
            out_bytes=out_bytes,
            time=float(time_s),
            workspace_bytes=int(workspace) + layout.unused_bytes.get(name, 0),
            scratch_bytes=int(scratch[0]) if scratch else 0,
            random=is_random_node(node),
            alias_of=alias,
            in_place=bool(alias) and overwritten_argument(node) is not None,
        )
        (nodes_fwd if graph_node.phase == FORWARD else nodes_bwd).append(graph_node)
    x_val = placeholders[joint.input_name].meta["val"]
    t_val = placeholders[tangent].meta["val"]
    # the node adding the block's terms to each resident's sum so far: its seed's one reader
    seed_readers = tuple(next(iter(placeholders[joint.resident_seeds[j]].users)).name for j in joint.resident_grads)
    return BlockGraph(
        nodes=tuple(nodes_fwd + nodes_bwd),
        input_name=joint.input_name,
        input_bytes=_tensor_bytes(x_val, joint.sizes),
        output_name=joint.output_names[0],
        output_grad_name=tangent,
        output_grad_bytes=_tensor_bytes(t_val, joint.sizes),
        input_grad_name=joint.input_grad_name,
        held_grad_names=tuple(joint.resident_grads.values()),
        seed_readers=seed_readers,
    )


def saved_for_backward(joint: JointGraph) -> dict[str, int]:
    """Storages the backward reads from the forward: owner name -> bytes.

    Owners are forward nodes (through views and getitems to the node owning the storage);
    reads of x, parameters, buffers and shared values are not counted. This is what
    plain autograd keeps between forward and backward, up to its own choices.
    """
    layout = storage_layout(joint)
    saved: dict[str, int] = {}
    for node in joint.tensor_nodes():
        if joint.phase[node.name] != BACKWARD:
            continue
        for a in node.all_input_nodes:
            if joint.phase.get(a.name) != FORWARD:
                continue
            base = layout.alias_of.get(a.name, a.name)
            if joint.phase.get(base) == FORWARD and layout.out_bytes.get(base, 0) > 0:
                saved[base] = layout.out_bytes[base]
    return saved
