"""The fused LM head (hierremat.ops.linear_cross_entropy) put into a stage graph.

:func:`fuse_linear_cross_entropy` rewrites a stage graph where a ``linear`` feeds a
cross-entropy through ops on its leading dimensions only (views, slices, contiguous, an
upcast to fp32), with class-index targets, no class weights and no label smoothing, and
where nothing else reads the logits; elsewhere it is not applied. It is an option the plan
picks by budget (hierremat.planning.output_stage), never a rewrite applied unconditionally.
"""

from __future__ import annotations

import logging

import torch
from torch import fx

from ...ops.linear_cross_entropy import linear_cross_entropy

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------- the rewrite

_LINEAR = torch.ops.aten.linear.default
_CROSS_ENTROPY = torch.ops.aten.cross_entropy_loss.default
_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default
_VIEWS = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default}
_COPIES = {torch.ops.aten.contiguous.default, torch.ops.aten.clone.default, torch.ops.aten.alias.default}
_CASTS = {torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default}
_SLICE = torch.ops.aten.slice.Tensor
_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _val(node) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _cross_entropy_call(node: fx.Node, gm: fx.GraphModule) -> dict | None:
    """(logits, target, reduction, ignore_index) of a cross-entropy node the fused head computes
    exactly (class-index targets on ``[N, C]`` logits, no weights, no label smoothing), else None."""
    from ...ops.cross_entropy import row_blocked_cross_entropy

    if node.op != "call_function":
        return None
    if node.target is row_blocked_cross_entropy:
        logits, target, reduction, ignore_index = node.args
    elif node.target is _CROSS_ENTROPY:
        call = node.normalized_arguments(gm, normalize_to_only_use_kwargs=True)
        if call is None:
            return None
        call = call.kwargs
        if call.get("weight") is not None or call.get("label_smoothing", 0.0) != 0.0:
            return None
        logits, target = call["input"], call["target"]
        reduction, ignore_index = call.get("reduction", 1), call.get("ignore_index", -100)
    else:
        return None
    lv, tv = _val(logits), _val(target)
    if lv is None or tv is None or lv.dim() != 2 or tv.dim() != 1 or tv.is_floating_point():
        return None
    if lv.dtype != torch.float32 or reduction not in (0, 1, 2):
        return None  # (the fused head computes the loss in fp32)
    return {"logits": logits, "target": target, "reduction": reduction, "ignore_index": ignore_index}


def _only_user(node: fx.Node) -> fx.Node | None:
    users = [u for u in node.users if u.target is not _ASSERT_METADATA]
    return users[0] if len(users) == 1 else None


def _path_from_linear(logits: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """(the linear node, the ops from it to ``logits`` in order) when every op between acts on
    the leading dimensions only (or upcasts to fp32) and has one reader, else None."""
    path = []
    node = logits
    while node.target is not _LINEAR:
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
            return None
        value, source = _val(node), _val(node.args[0])
        if value is None or source is None:
            return None
        if node.target in _VIEWS or node.target is _SLICE:
            if value.shape[-1] != source.shape[-1] or (node.target is _SLICE and node.args[1] % source.dim() == source.dim() - 1):
                return None
        elif node.target in _CASTS:
            if value.dtype != torch.float32 or source.dtype not in _FLOATS:
                return None
        elif node.target not in _COPIES:
            return None
        path.append(node)
        node = node.args[0]
    for op in (node, *reversed(path[1:])):
        if _only_user(op) is None:
            return None
    return node, list(reversed(path))


def fuse_linear_cross_entropy(gm: fx.GraphModule) -> int:
    """Rewrite, in place, every ``linear`` + cross-entropy of ``gm`` the fused head computes
    exactly (see the module docstring) into :func:`linear_cross_entropy`; returns how many."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        call = _cross_entropy_call(node, gm)
        if call is None or _only_user(call["logits"]) is not node:
            continue
        found = _path_from_linear(call["logits"])
        if found is None:
            continue
        linear, path = found
        h, weight, *rest = linear.args
        bias = rest[0] if rest else None
        hv, wv = _val(h), _val(weight)
        if hv is None or wv is None or hv.dtype != wv.dtype or hv.dtype not in _FLOATS:
            continue
        width = hv.shape[-1]
        with gm.graph.inserting_before(node):
            rows = h
            for op in path:  # the same leading-dimension ops on the hidden states
                if op.target in _VIEWS:
                    shape = list(op.args[1])
                    rows = gm.graph.call_function(torch.ops.aten.reshape.default, (rows, [*shape[:-1], width]))
                elif op.target is _SLICE:
                    rows = gm.graph.call_function(_SLICE, (rows, *op.args[1:]), dict(op.kwargs))
            fused = gm.graph.call_function(
                linear_cross_entropy, (rows, weight, bias, call["target"], call["reduction"], call["ignore_index"])
            )
        fused.meta = dict(node.meta)
        node.replace_all_uses_with(fused)
        gm.graph.erase_node(node)
        for op in [*reversed(path), linear]:
            for user in list(op.users):
                if user.target is _ASSERT_METADATA:
                    gm.graph.erase_node(user)
            gm.graph.erase_node(op)
        rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
        log.debug("linear + cross-entropy: %d head(s) fused", rewritten)
    return rewritten
