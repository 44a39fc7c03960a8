"""Fixed schedules that baselines use: no checkpointing and torch's uniform segments.

They are ChainSchedules like the DP's, so they run through the same runtime and are
measured the same way; their predicted time and peak come from the simulator.
"""

from __future__ import annotations

from ..plans.costs import ChainCosts
from ..plans.schedule import Backward, ChainSchedule, FAll, FCk, FNone, Loss
from ..plans.simulate import simulate


def _priced(costs: ChainCosts, ops: list, **simulate_options) -> ChainSchedule:
    result = simulate(costs, ops, **simulate_options)
    return ChainSchedule(tuple(ops), costs.length, result.time, result.peak_bytes, result.peak_bytes, 1)


def keep_all_schedule(costs: ChainCosts) -> ChainSchedule:
    """Plain autograd: every stage forwarded once with grad (option 0), then every backward.

    hierremat runs this schedule as plain autograd (no chain Function), so it is priced
    with the output gradient freed after its last use, as autograd frees it.
    """
    L = costs.length
    ops = [FAll(i, 0) for i in range(L)] + [Loss()] + [Backward(i) for i in reversed(range(L))]
    return _priced(costs, ops, output_grad_persists=False)


def segment_bounds(length: int, segments: int) -> list[tuple[int, int]]:
    """Stage ranges [start, end) of ``torch.utils.checkpoint.checkpoint_sequential``.

    torch makes segments of ``length // segments`` stages and the last one takes the rest.
    """
    if not 1 <= segments <= length:
        raise ValueError(f"segments must be in 1..{length}, got {segments}")
    size = length // segments
    bounds = [(k * size, (k + 1) * size) for k in range(segments - 1)]
    return bounds + [((segments - 1) * size, length)]


def uniform_segments_schedule(costs: ChainCosts, segments: int) -> ChainSchedule:
    """torch's checkpoint_sequential: all segments but the last keep only their input.

    Forward: each checkpointed segment runs without grad from its input; the last runs
    with grad. Backward: each checkpointed segment, from the last, is re-run with grad
    and then back-propagated.
    """
    bounds = segment_bounds(costs.length, segments)
    ops: list = []
    for start, end in bounds[:-1]:
        ops += [FCk(start)] + [FNone(j) for j in range(start + 1, end)]
    last_start, last_end = bounds[-1]
    ops += [FAll(j, 0) for j in range(last_start, last_end)] + [Loss()]
    ops += [Backward(j) for j in reversed(range(last_start, last_end))]
    for start, end in reversed(bounds[:-1]):
        ops += [FAll(j, 0) for j in range(start, end)] + [Backward(j) for j in reversed(range(start, end))]
    return _priced(costs, ops)
