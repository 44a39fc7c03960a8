"""In-place pointwise operators where nothing reads what they overwrite (MONeT's in-place variants).

A functional ATen graph allocates a new result for every operator, so ``tanh(mul(x, c))``
holds both the product and the tanh at once, although nothing reads the product again.
:func:`run_in_place` rewrites such calls to their in-place overloads (``tanh_``, ``add_``,
``mul_``, ...: the same ATen kernels, so every result is bitwise unchanged), where

* the operator is pointwise (``torch.Tag.pointwise``) and ATen has the in-place overload of
  the same name and overload, whose first argument it overwrites;
* that argument is a value computed in the same phase (forward or backward) whose storage
  holds nothing else: no value sharing the storage is read by any other node, or returned,
  or created after the call; and it covers its whole storage, in the result's layout
  (shape, strides, dtype), so the result needs no storage of its own;
* it is not passed twice to the call;
* in the forward, the call's other inputs come before the storage's first value (the block
  ILP computes a storage's values together, at that place).

The result then owns no bytes and shares its first argument's storage (the block graph's
``GraphNode.in_place``): forward, the pair is one value for the block ILP, computed and freed
together, so no option can keep the overwritten value apart (it would only serve to
recompute the result, at the same bytes); backward, the step no longer allocates a result
beside its argument. Every schedule the ILP had remains (the merged value costs what the
result alone cost), and each step needs at most the memory it needed before: the rewrite is
never worse, so it applies wherever variants do (Shah et al., "Memory optimization for
deep networks", ICLR 2021, choose in-place operators where the overwritten value is dead).
Autograd's saved-tensor rule is the same condition: the backward never reads an
overwritten value, since a value that the backward reads has a reader besides the call.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import operator

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..block_graph import FORWARD

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
    docstring) running its in-place overload, in place in ``joint.module``; node names, phases
    and ``meta["val"]`` are unchanged (hierremat.blocks.joint.storage_layout maps an in-place
    result's storage to its argument's). Returns ``joint``."""
    graph = joint.module.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    canonical: dict = {}  # storage -> the storage it is (an in-place result's -> its argument's)
    sharing: dict = {}  # canonical storage -> nodes whose value lives in it, in graph order
    for node in graph.nodes:
        key = _storage(node)
        if key is not None:
            sharing.setdefault(key, []).append(node)
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        overload = in_place_overload(node.target)
        if overload is None or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        arg, out = node.args[0], node.meta.get("val")
        arg_val = arg.meta.get("val")
        if not isinstance(out, torch.Tensor) or not isinstance(arg_val, torch.Tensor):
            continue
        if arg.op != "call_function" or joint.phase.get(arg.name) != joint.phase.get(node.name):
            continue
        if sum(a is arg for a in (*node.args, *node.kwargs.values())) != 1:
            continue
        if not _whole_storage_in_layout(arg_val, out):
            continue
        arg_key = canonical.get(_storage(arg), _storage(arg))
        family = sharing.get(arg_key, [])
        if not family or family[0].op != "call_function" or family[0].target is operator.getitem:
            continue  # the storage of an input, or an element of a multi-output operator
        members = set(family)
        if any(order[m] > order[node] for m in family):
            continue
        if joint.phase.get(node.name) == FORWARD and any(
            order[a] > order[family[0]] for a in node.all_input_nodes if a not in members
        ):
            continue  # the block ILP computes a storage's values together, at its first one's place
        if any(u is not node and u not in members for m in family for u in m.users):
            continue
        node.target = overload
        out_key = _storage(node)
        canonical[out_key] = arg_key
        merged = sorted({*family, *sharing.pop(out_key, [])}, key=order.__getitem__)
        sharing[arg_key] = merged
        rewritten += 1
    if rewritten:
        joint.module.recompile()
        log.debug("%d pointwise call(s) run in place", rewritten)
    return joint


def functional_joint(joint):
    """``joint`` with its in-place calls back to their functional overloads, in a copy of its
    module (names and metadata kept, so option op lists still apply): what Inductor compiles.
    Inductor reuses buffers by its own analysis, and an option's compiled costs are measured
    on its compiled form (hierremat.runtime.compiled_option)."""
    if not any(_functional_overload(n.target) is not None for n in joint.module.graph.nodes):
        return joint
    module = copy.deepcopy(joint.module)
    for node in module.graph.nodes:
        functional = _functional_overload(node.target)
        if functional is not None:
            node.target = functional
    module.recompile()
    return dataclasses.replace(joint, module=module)


def _functional_overload(target) -> torch._ops.OpOverload | None:
    """The functional overload whose in-place form :func:`in_place_overload` gives as ``target``."""
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.pointwise not in target.tags:
        return None
    namespace, _, name = target._schema.name.partition("::")
    if namespace != "aten" or not name.endswith("_"):
        return None
    functional = getattr(getattr(torch.ops.aten, name[:-1], None), target._overloadname, None)
    return functional if functional is not None and in_place_overload(functional) is target else None
