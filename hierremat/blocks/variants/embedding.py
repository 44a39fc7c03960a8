"""The embedding that adds its rows into ``.grad`` (hierremat.ops.embedding) put into captured
graphs: every dense ``aten.embedding`` of a 2-d floating table that at most one other operator
reads is replaced by it (a table read by more than two keeps ``aten.embedding``: see the op's
module docstring)."""

from __future__ import annotations

import torch
from torch import fx

from ..rewrite import replace_calls
from ...ops.embedding import embedding

_EMBEDDING = torch.ops.aten.embedding.default

def _embedding_arguments(node: fx.Node, gm: fx.GraphModule) -> tuple | None:
    """The variant's arguments for a dense embedding of a 2-d floating table that at most one
    other operator reads, else None."""
    call = node.normalized_arguments(gm, normalize_to_only_use_kwargs=True)
    if call is None or call.kwargs.get("sparse", False):
        return None
    if isinstance(call.kwargs["weight"], fx.Node) and len(call.kwargs["weight"].users) > 2:
        return None
    call = call.kwargs
    table = call["weight"].meta.get("val") if isinstance(call["weight"], fx.Node) else None
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or not table.is_floating_point():
        return None
    return call["weight"], call["indices"], call.get("padding_idx", -1), call.get("scale_grad_by_freq", False)


def use_grad_in_place_embeddings(gm: fx.GraphModule) -> int:
    """Replace every dense ``aten.embedding`` of a 2-d table in ``gm`` by :func:`embedding`;
    returns how many."""
    return replace_calls(gm, _EMBEDDING, embedding, _embedding_arguments, "embeddings adding into .grad")
