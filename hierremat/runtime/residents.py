"""Residents at run time: values carried along the chain beside its activation
(hierremat.plans.stage_info.ResidentLayout), as the runner and the profiler hold them.

A stage that produces residents returns ``(x_{i+1}, *residents)``; a stage is called with
``(*shared, *residents)``, every resident at its index (None before it is produced). Their
gradients are summed across the stages that read them, latest first (:func:`tap_read`), and
handed to the producer's backward with its output's.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import get_gradient_edge

from ..plans.stage_info import ResidentLayout
from .grad_taps import GradSink, tap_input


def stage_shared(shared: tuple, values: dict[int, torch.Tensor], layout: ResidentLayout | None) -> tuple:
    """What a stage is called with after x: the shared values, then every resident (None if not made yet)."""
    if layout is None:
        return shared
    return (*shared, *(values.get(r) for r in range(len(layout))))


def split_output(out, layout: ResidentLayout | None, stage: int) -> tuple:
    """(x_{i+1}, the residents stage ``stage`` made) from its output."""
    if layout is None or not layout.produced_by(stage):
        return out, ()
    return out[0], tuple(out[1:])


def keep_made(values: dict[int, torch.Tensor], layout: ResidentLayout | None, stage: int, made: tuple,
              attached: bool = False, replace: bool = False) -> None:
    """Store the residents stage ``stage`` made, unless an earlier run of it stored them already
    (a recomputation makes the same values: replays restore the RNG). ``replace``: store this run's
    instead, for a recomputation with grad, whose tape may save them: keeping the first would hold
    both (no reader's tape holds the first then: a stage is recomputed once the backward has passed
    every later stage that ran with grad); but not a resident the model returns, whose first value
    the caller may hold. ``attached``: keep their autograd history (plain autograd runs), else
    detached."""
    if layout is None:
        return
    for r, value in zip(layout.produced_by(stage), made):
        if r not in values or (replace and r not in layout.exported):
            values[r] = value if attached else value.detach()


def tap_read(shared: tuple, layout: ResidentLayout | None, stage: int, anchor: torch.Tensor | None
             ) -> tuple[tuple, list[tuple[int, GradSink, object]]]:
    """``shared`` (from :func:`stage_shared`) with the floating residents stage ``stage`` reads tapped
    (hierremat.runtime.grad_taps.tap_input): (the tuple, [(resident, its sink, the tapped value's
    gradient edge)]). The stage's backward is then also fed, at that edge, the gradient the later
    readers summed (:func:`read_roots`), so the sink receives the running sum formed in the order
    plain autograd adds a value's gradient terms: bitwise the same."""
    if layout is None or anchor is None:
        return shared, []
    shared, taps = list(shared), []
    for r in layout.read_by(stage):
        j = layout.shared_count + r
        if shared[j] is not None and shared[j].is_floating_point():
            shared[j], sink = tap_input(shared[j], anchor)
            taps.append((r, sink, get_gradient_edge(shared[j])))
    return tuple(shared), taps


def read_roots(taps: list, grads: dict[int, torch.Tensor]) -> tuple[list, list]:
    """(edges, gradients) to feed a reader's backward besides its output's: at each tapped resident,
    the sum of its gradient so far (taken out of ``grads``; where there is none yet, no root)."""
    edges, values = [], []
    for r, _, edge in taps:
        g = grads.pop(r, None)
        if g is not None:
            edges.append(edge)
            values.append(g)
    return edges, values


def collect_reads(taps: list, grads: dict[int, torch.Tensor]) -> None:
    """After a reader's backward: each tapped resident's gradient so far is what its sink received."""
    for r, sink, _ in taps:
        if sink.grad is not None:
            grads[r] = sink.grad


def pop_seeds(layout: ResidentLayout | None, stage: int, grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """For a block option's backward (hierremat.runtime.block_exec): by shared position, the
    gradient sum so far of each resident stage ``stage`` reads, taken out of ``grads``."""
    if layout is None:
        return {}
    return {layout.shared_count + r: grads.pop(r) for r in layout.read_by(stage) if r in grads}


def keep_sums(layout: ResidentLayout | None, sums: dict[int, torch.Tensor], grads: dict[int, torch.Tensor]) -> None:
    """After a block option's backward: the new sums it returned (by shared position) into ``grads``."""
    for position, g in sums.items():
        grads[position - layout.shared_count] = g
