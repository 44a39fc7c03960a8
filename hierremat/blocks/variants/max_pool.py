"""The max-pool that runs its CPU forward channels-last (hierremat.ops.max_pool) put into captured graphs: every
``aten.max_pool2d`` is replaced by it (the operator itself runs ATen's kernel wherever the channels-last one is not
faster or not the same bits)."""

from __future__ import annotations

import torch
from torch import fx

from ..rewrite import replace_calls
from ...ops.max_pool import max_pool2d

_MAX_POOL2D = torch.ops.aten.max_pool2d.default


def _pair(value) -> list[int]:
    values = [value] if isinstance(value, int) else list(value)
    return values * 2 if len(values) == 1 else values


def _max_pool_arguments(node: fx.Node, gm: fx.GraphModule) -> tuple | None:
    """The variant's arguments (every one of them, as pairs) for an ``aten.max_pool2d`` call, else None."""
    call = node.normalized_arguments(gm, normalize_to_only_use_kwargs=True)
    if call is None:
        return None
    call = call.kwargs
    kernel = _pair(call["kernel_size"])
    stride = _pair(call.get("stride") or kernel)
    return (call["input"], kernel, stride, _pair(call.get("padding", 0)), _pair(call.get("dilation", 1)),
            bool(call.get("ceil_mode", False)))


def use_channels_last_max_pools(gm: fx.GraphModule) -> int:
    """Replace every ``aten.max_pool2d`` in ``gm`` by :func:`max_pool2d`; returns how many."""
    return replace_calls(gm, _MAX_POOL2D, max_pool2d, _max_pool_arguments, "max-pools pooled channels-last")
