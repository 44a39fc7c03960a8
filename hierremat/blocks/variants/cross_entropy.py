"""The row-blocked cross-entropy (hierremat.ops.cross_entropy) put into captured graphs: every
``aten.cross_entropy_loss`` call it computes exactly is replaced by it."""

from __future__ import annotations

import torch
from torch import fx

from ..rewrite import replace_calls
from ...ops.cross_entropy import row_blocked_cross_entropy

_CROSS_ENTROPY = torch.ops.aten.cross_entropy_loss.default

def _rewritable(node: fx.Node, gm: fx.GraphModule) -> dict | None:
    """The call's arguments when the variant computes exactly what it computes, else None."""
    call = node.normalized_arguments(gm, normalize_to_only_use_kwargs=True)
    if call is None:
        return None
    call = call.kwargs  # the schema's names; fx spells ``self`` as ``input``
    logits, target = call["input"].meta.get("val"), call["target"].meta.get("val")
    if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor):
        return None
    if logits.dim() != 2 or target.dim() != 1 or target.is_floating_point():
        return None  # class-index targets on [N, C] logits only (no probabilities, no extra dims)
    if call.get("weight") is not None or call.get("label_smoothing", 0.0) != 0.0:
        return None
    if logits.dtype not in (torch.float32, torch.float64):
        return None
    return call


def use_row_blocked_cross_entropy(gm: fx.GraphModule) -> int:
    """Replace every ``aten.cross_entropy_loss`` call of ``gm`` that the variant computes
    exactly (class-index targets, no weights, no label smoothing, fp32/fp64 logits) by
    :func:`row_blocked_cross_entropy`; returns how many."""

    def arguments(node: fx.Node, gm: fx.GraphModule) -> tuple | None:
        call = _rewritable(node, gm)
        if call is None:
            return None
        return call["input"], call["target"], call.get("reduction", 1), call.get("ignore_index", -100)

    return replace_calls(gm, _CROSS_ENTROPY, row_blocked_cross_entropy, arguments, "row-blocked cross-entropy")
