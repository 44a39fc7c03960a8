"""Zero-byte taps that catch the gradient flowing into a stage's input (or a resident) in a
GradSink, without the autograd graph keeping the input alive (hierremat.runtime.executor,
hierremat.runtime.residents)."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..device.memory import owning

#: For the runner's backward steps, which autograd calls from wherever ``backward()`` was called:
#: inside a ``torch.compile``'d function Dynamo would otherwise compile them (and, with them,
#: the recomputations and their random draws) like any frame called there.
eager_only = torch.compiler.disable(reason="hierremat's chain backward runs its schedule eagerly")


class GradSink:
    """Receives the gradient that flows into a tapped stage input (or resident): a copy of it
    where it is a view into a larger storage, as it outlives the backward that made it
    (hierremat.device.memory.owning)."""

    grad: torch.Tensor | None = None


class _GradTap(torch.autograd.Function):
    """Identity on x whose backward hands the incoming gradient to a GradSink.

    Its only autograd input is a zero-size leaf, so the graph keeps no reference to x.
    """

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, x: torch.Tensor, sink: GradSink) -> torch.Tensor:
        ctx.sink = sink
        return x.view_as(x)

    @staticmethod
    @eager_only
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        ctx.sink.grad = owning(grad)
        return None, None, None


def tap_input(x: torch.Tensor, anchor: torch.Tensor | None) -> tuple[torch.Tensor, GradSink | None]:
    """x as the input of a grad-mode stage forward; with an anchor, its gradient goes to the sink."""
    x = x.detach()
    if anchor is None:
        return x, None
    sink = GradSink()
    with torch.enable_grad():
        return _GradTap.apply(anchor, x, sink), sink
