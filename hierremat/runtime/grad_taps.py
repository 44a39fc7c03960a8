"""Zero-byte taps that catch the gradient flowing into a stage's input (or a resident) in a
GradSink, without the autograd graph keeping the input alive (hierremat.runtime.executor,
hierremat.runtime.residents), and the relay that hands a stage's output gradients to its backward as
their only reference (GradRelay)."""

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


def backward_through(edges: list, grads: tuple) -> None:
    """Backpropagate ``grads`` through the stage outputs' edges (or tensors), skipping missing ones."""
    pairs = [(e, g) for e, g in zip(edges, grads) if e is not None and g is not None]
    if pairs:
        torch.autograd.backward([e for e, _ in pairs], [g for _, g in pairs])


class _HandOver(torch.autograd.Function):
    """A zero-size root after a stage's outputs whose backward takes their gradients out of a list: the autograd
    engine then holds the only reference to each, and frees it once the node that reads it has run."""

    @staticmethod
    def forward(ctx, grads: list, *outputs: torch.Tensor) -> torch.Tensor:
        ctx.grads, ctx.count = grads, len(outputs)
        return torch.empty(0, device=outputs[0].device)

    @staticmethod
    @eager_only
    @once_differentiable
    def backward(ctx, _):
        grads = [*ctx.grads, *[None] * (ctx.count - len(ctx.grads))]
        ctx.grads.clear()
        return None, *grads


class GradRelay:
    """The backward of a stage's outputs, fed gradients that nothing else references.

    A gradient passed to ``torch.autograd.backward`` stays referenced by its caller until the whole backward
    returns; one put in ``grads`` (in the outputs' order, None where an output gets none) is freed as soon as
    the first node that reads it has run, so the stage's backward peaks with one output-sized gradient less
    wherever that node makes its own (a ReLU's, a BatchNorm's). Usage::

        relay = GradRelay(out)            # after the stage's forward with grad
        relay.grads.append(grad_of_out)   # with no other reference to it
        relay.backward()
    """

    def __init__(self, out):
        outputs = out if isinstance(out, tuple) else (out,)
        self.grads: list = []
        with torch.enable_grad():
            self.root = _HandOver.apply(self.grads, *outputs) if any(o.requires_grad for o in outputs) else None

    def backward(self, edges: list = (), grads: tuple = ()) -> None:
        """Backpropagate ``grads`` (the stage's), with ``edges`` fed ``grads`` in the same call (the taps of the
        values the stage read: hierremat.runtime.residents), skipping missing ones."""
        root, self.root = self.root, None
        seed = None if root is None else torch.empty(0, device=root.device)
        backward_through([root, *edges], (seed, *grads))
        self.grads.clear()
