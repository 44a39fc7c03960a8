"""In-place operators where nothing reads what they overwrite (MONeT's in-place variants).

A functional ATen graph allocates a new result for every operator, so ``tanh(mul(x, c))``
holds both the product and the tanh at once, although nothing reads the product again.
:func:`run_in_place` rewrites such calls to forms that write their result over one argument,
running the same kernels, so every result is bitwise unchanged:

* a pointwise operator (``torch.Tag.pointwise``) runs its in-place overload (``tanh_``,
  ``add_``, ``mul_``, ...) when it overwrites its first argument, else its ``out=`` overload
  with ``out`` one of its tensor arguments (``gelu_backward.grad_input(grad, x,
  grad_input=grad)``, ``add.out(a, b, out=b)``): ATen's TensorIterator allows an output that
  is exactly one of its inputs;
* a few operators that are not pointwise but read every element they write before writing
  it run their ``out=`` overload the same way (:data:`ROW_WISE`: the softmax backward, whose
  kernels reduce a row, then write it; hierremat's packed-mask kernels ``masked_scale`` and
  ``where_bits``, hierremat.ops.packed_bits).

The overwritten argument must be

* a value computed in the same phase (forward or backward) whose storage holds nothing else,
  and which covers its whole storage in the result's layout (shape, strides, dtype), so the
  result needs no storage of its own;
* read by no other node after the call (in the forward, by no other node at all: the block
  ILP may recompute forward values, and computes a storage's values together, at its first
  one's place, so the call's other inputs must also come before that), nor returned, nor
  in a storage that a later value shares; a backward reader before the call is an ATen
  operator, whose schema says whether its result aliases (a Python function such as
  ``hierremat.blocks.joint.seeded_add`` may return its argument itself);
* passed once, and no other argument shares its storage.

The result then owns no bytes and shares the argument's storage (the block graph's
``GraphNode.in_place``): forward, the pair is one value for the block ILP, computed and freed
together, so no option can keep the overwritten value apart (it would only serve to
recompute the result, at the same bytes); backward, where every node runs once in graph
order, the step no longer allocates a result beside its argument. Every schedule the ILP had
remains (the merged value costs what the result alone cost), and each step needs at most the
memory it needed before: the rewrite is never worse, so it applies wherever variants do
(Shah et al., "Memory optimization for deep networks", ICLR 2021, choose in-place operators
where the overwritten value is dead). Autograd's saved-tensor rule is the same condition: the
backward never reads an overwritten value, since a value that the backward reads has a
reader after the call.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import operator

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from ...plans.block_graph import FORWARD
from ..joint import overwritten_argument

log = logging.getLogger(__name__)


def in_place_overload(target) -> torch._ops.OpOverload | None:
    """The in-place ATen overload of a pointwise ``target`` (``aten.add.Tensor`` ->
    ``aten.add_.Tensor``) that overwrites its first argument, or None."""
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.pointwise not in target.tags:
        return None
    namespace, _, name = target._schema.name.partition("::")
    if namespace != "aten" or name.endswith("_"):
        return None
    packet = getattr(torch.ops.aten, f"{name}_", None)
    overload = getattr(packet, target._overloadname, None) if packet is not None else None
    if overload is None:
        return None
    args = overload._schema.arguments
    if not args or args[0].alias_info is None or not args[0].alias_info.is_write:
        return None
    if [a.name for a in args] != [a.name for a in target._schema.arguments]:
        return None
    return overload


def _row_wise() -> frozenset:
    from ...ops import packed_bits  # noqa: F401  (defines the hierremat:: operators)

    aten, ours = torch.ops.aten, torch.ops.hierremat
    return frozenset({
        aten._softmax_backward_data.default, aten._log_softmax_backward_data.default,
        ours.masked_scale.default, ours.where_bits.default,
    })


#: Operators that are not tagged pointwise whose every kernel reads each element of its
#: arguments that it writes before writing it (so its ``out=`` may be one of its inputs):
#: softmax backwards reduce a row, then write it (CPU: one thread per row; CUDA: the row is
#: reduced block- or warp-wide before any thread writes), and hierremat's packed-mask kernels
#: write element i from element i.
ROW_WISE = _row_wise()


def out_overload(target) -> tuple[torch._ops.OpOverload, str] | None:
    """The ``out=`` overload of ``target`` and the name of its ``out`` argument
    (``aten.gelu_backward.default`` -> ``(aten.gelu_backward.grad_input, "grad_input")``), for
    pointwise ATen operators and :data:`ROW_WISE` ones; None otherwise."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    if target not in ROW_WISE and (torch.Tag.pointwise not in target.tags or target.namespace != "aten"):
        return None
    schema = target._schema
    if len(schema.returns) != 1 or schema.returns[0].alias_info is not None:
        return None
    signature = [(a.name, str(a.type), a.kwarg_only) for a in schema.arguments]
    packet = getattr(getattr(torch.ops, target.namespace), target._schema.name.partition("::")[2])
    for name in packet.overloads():
        overload = getattr(packet, name)
        args = overload._schema.arguments
        written = [a for a in args if a.alias_info is not None and a.alias_info.is_write]
        if len(written) != 1 or not written[0].kwarg_only or overload is target:
            continue
        rest = [(a.name, str(a.type), a.kwarg_only) for a in args if a is not written[0]]
        if rest == signature:
            return overload, written[0].name
    return None


def _storage(node: fx.Node):
    val = node.meta.get("val")
    return StorageWeakRef(val.untyped_storage()) if isinstance(val, torch.Tensor) else None


def _whole_storage_in_layout(arg: torch.Tensor, out: torch.Tensor) -> bool:
    return (
        arg.shape == out.shape and arg.stride() == out.stride() and arg.dtype == out.dtype
        and arg.storage_offset() == 0 and torch._prims_common.is_non_overlapping_and_dense_or_false(arg)
        and arg.untyped_storage().nbytes() == arg.numel() * arg.element_size()
    )


def run_in_place(joint):
    """``joint`` (a hierremat.blocks.joint.JointGraph) with every call that qualifies (module
    docstring) running its in-place or ``out=`` form, in place in ``joint.module``; node names,
    phases and ``meta["val"]`` are unchanged (hierremat.blocks.joint.storage_layout maps an
    in-place result's storage to its argument's). Returns ``joint``."""
    graph = joint.module.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    canonical: dict = {}  # storage -> the storage it is (an in-place result's -> its argument's)
    sharing: dict = {}  # canonical storage -> nodes whose value lives in it, in graph order
    for node in graph.nodes:
        key = _storage(node)
        if key is not None:
            sharing.setdefault(key, []).append(node)

    def family_of(arg):
        return canonical.get(_storage(arg), _storage(arg))

    def overwritable(node, arg) -> bool:
        """Whether ``node`` may write its result over ``arg`` (module docstring)."""
        out, arg_val = node.meta.get("val"), arg.meta.get("val")
        if not isinstance(out, torch.Tensor) or not isinstance(arg_val, torch.Tensor):
            return False
        phase = joint.phase.get(node.name)
        if arg.op != "call_function" or joint.phase.get(arg.name) != phase:
            return False
        if sum(a is arg for a in (*node.args, *node.kwargs.values())) != 1:
            return False
        if not _whole_storage_in_layout(arg_val, out):
            return False
        family = sharing.get(family_of(arg), [])
        if not family or family[0].op != "call_function" or family[0].target is operator.getitem:
            return False  # the storage of an input, or an element of a multi-output operator
        members = set(family)
        if any(order[m] > order[node] for m in family):
            return False
        if any(a is not arg and a in members for a in node.all_input_nodes):
            return False  # another argument is a view of the storage written
        if phase == FORWARD and any(order[a] > order[family[0]] for a in node.all_input_nodes if a not in members):
            return False  # the block ILP computes a storage's values together, at its first one's place
        # in the backward, readers may come before the call; not a Python function's
        # (hierremat.blocks.joint.seeded_add returns its term itself when there is no sum yet)
        return all(
            u is node or u in members
            or (phase != FORWARD and order[u] < order[node] and isinstance(u.target, torch._ops.OpOverload))
            for m in family for u in m.users
        )

    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        in_place = in_place_overload(node.target)
        if in_place is not None and node.args and isinstance(node.args[0], fx.Node) and overwritable(node, node.args[0]):
            arg = node.args[0]
            node.target = in_place
        else:
            out = out_overload(node.target)
            candidates = (a for a in node.args if isinstance(a, fx.Node))
            arg = next((a for a in candidates if overwritable(node, a)), None) if out is not None else None
            if arg is None:
                continue
            node.target, node.kwargs = out[0], {**node.kwargs, out[1]: arg}
        out_key, arg_key = _storage(node), family_of(arg)
        canonical[out_key] = arg_key
        sharing[arg_key] = sorted({*sharing[arg_key], *sharing.pop(out_key, [])}, key=order.__getitem__)
        rewritten += 1
    if rewritten:
        joint.module.recompile()
        log.debug("%d call(s) run in place", rewritten)
    return joint


def functional_joint(joint):
    """``joint`` with its in-place and ``out=`` calls back to their functional overloads, in a
    copy of its module (names and metadata kept, so option op lists still apply): what Inductor
    compiles. Inductor reuses buffers by its own analysis, and an option's compiled costs are
    measured on its compiled form (hierremat.runtime.compiled_option)."""
    if not any(_functional_form(n) is not None for n in joint.module.graph.nodes):
        return joint
    module = copy.deepcopy(joint.module)
    for node in module.graph.nodes:
        functional = _functional_form(node)
        if functional is not None:
            node.target, node.kwargs = functional
    module.recompile()
    return dataclasses.replace(joint, module=module)


def _functional_form(node: fx.Node) -> tuple[torch._ops.OpOverload, dict] | None:
    """(target, kwargs) of the functional call that :func:`run_in_place` rewrote into ``node``."""
    if overwritten_argument(node) is None:
        return None
    target = node.target
    namespace, _, name = target._schema.name.partition("::")
    if namespace == "aten" and name.endswith("_"):
        functional = getattr(getattr(torch.ops.aten, name[:-1], None), target._overloadname, None)
        if functional is not None and in_place_overload(functional) is target:
            return functional, dict(node.kwargs)
        return None
    packet = getattr(getattr(torch.ops, target.namespace), name)
    for overload_name in packet.overloads():
        functional = getattr(packet, overload_name)
        out = out_overload(functional)
        if out is not None and out[0] is target and out[1] in node.kwargs:
            return functional, {k: v for k, v in node.kwargs.items() if k != out[1]}
    return None
