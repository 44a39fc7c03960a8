"""The linear layer whose backward adds its weight gradient into ``.grad`` (hierremat.ops.linear)
put into captured graphs, for weights far larger than the activations they meet.

A call of ``aten.linear`` is replaced where its weight is a parameter that no other operator
reads, of at least MIN_WEIGHT_BYTES and WEIGHT_TO_ACTIVATIONS times the bytes of the call's input
and output together, and its input is contiguous, on the CPU, at sizes the capture fixed: there the
whole weight gradient is the largest tensor of the backward, and the batch's rows the product sums
over are few (VGG's and AlexNet's fully connected layers). A language model's projections, whose
gradients weigh about what a long batch's activations weigh, keep ``aten.linear``.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from ..rewrite import replace_calls
from ...ops.linear import linear

_LINEAR = torch.ops.aten.linear.default
#: The smallest weight, in bytes, whose calls are replaced.
MIN_WEIGHT_BYTES = 2**20
#: How many times the bytes of a call's input and output its weight must hold to be replaced.
WEIGHT_TO_ACTIVATIONS = 8


def _bytes(t: torch.Tensor) -> int | None:
    numel = t.numel()
    return numel * t.element_size() if isinstance(numel, int) else None


def _linear_arguments(node: fx.Node, gm: fx.GraphModule) -> tuple | None:
    """The variant's arguments for a call whose weight dwarfs its activations (module docstring), else None."""
    x, weight, bias = (list(node.args) + [None])[:3]
    if not isinstance(weight, fx.Node) or weight.op != "get_attr" or len(weight.users) != 1:
        return None
    value = operator.attrgetter(weight.target)(gm)
    x_val, out_val = x.meta.get("val") if isinstance(x, fx.Node) else None, node.meta.get("val")
    if not isinstance(value, torch.nn.Parameter) or value.dim() != 2 or not value.is_floating_point():
        return None
    if not isinstance(x_val, torch.Tensor) or x_val.dim() < 2 or not x_val.is_contiguous() or x_val.device.type not in ("cpu", "meta"):
        return None
    activations = [_bytes(x_val), _bytes(out_val)] if isinstance(out_val, torch.Tensor) else [None]
    weight_bytes = _bytes(value)
    if None in activations or weight_bytes < max(MIN_WEIGHT_BYTES, WEIGHT_TO_ACTIVATIONS * sum(activations)):
        return None
    return x, weight, bias


def use_grad_in_place_linears(gm: fx.GraphModule) -> int:
    """Replace the calls of ``aten.linear`` in ``gm`` that the module docstring names by :func:`linear`;
    returns how many."""
    return replace_calls(gm, _LINEAR, linear, _linear_arguments, "linear layers adding into .grad")
