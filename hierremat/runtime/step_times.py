"""Stage times observed in the training steps themselves: time samples without extra runs.

A model trained at many lengths has its stage times fitted over the lengths measured
(hierremat.planning.shape_fit). Profiling a length apart from the training costs a profile's worth of
runs; the steps at each length run every stage's forward and backward anyway. A :class:`StepTimes`
attached to a chain runner (hierremat.runtime.executor) records, in the steps it runs on CPU, how long
each stage's ops took: the no-grad forward of the stage itself (``F_none``/``F_ck``, not generated code),
the forward with grad under autograd (``F_all`` of option 0) and the backward of that forward. Each step
runs the ops it runs; the medians over the steps recorded give the shape's stage times, what a stage's
steps did not time taken from the plan's own times (scaled by the forward timed).

Only CPU steps are timed: ``time.perf_counter`` around an op measures it where the kernels run
synchronously (on CUDA the host would measure the launches).
"""

from __future__ import annotations

import statistics
from typing import Sequence


class StepTimes:
    """Seconds per op kind (``"nograd"``, ``"forward"``, ``"backward"``) and stage over the first ``steps`` steps of
    one shape's plans (``chain``: what identifies the chain timed, its stages' signatures: a plan made again for the
    same shape goes on recording here only where its chain is the same).

    record(): a step's seconds (the runner records a step that ran through its backward, or, where the stages are
    simply called, the forward of one with grad: one backward call times no stage). stage_times(): the medians, a
    stage's missing kinds taken from the plan's own times."""

    def __init__(self, stages: int, steps: int, chain: tuple = ()):
        if steps < 1:
            raise ValueError(f"steps must be at least 1, got {steps}")
        self.stages = stages
        self.wanted = steps
        self.chain = chain
        self.steps = 0
        self._seconds: dict[tuple[str, int], list[float]] = {}

    @property
    def recording(self) -> bool:
        """Whether the next step is to be timed."""
        return self.steps < self.wanted

    def record(self, seconds: dict[tuple[str, int], list[float]]) -> None:
        """Add one step's seconds, by (kind, stage) (each run of an op in it: a stage recomputed runs its forward
        more than once)."""
        if not self.recording:
            return
        self.steps += 1
        for key, values in seconds.items():
            self._seconds.setdefault(key, []).extend(values)

    def stage_times(
        self, planned: Sequence[tuple[float, float, float]],
    ) -> tuple[tuple[float, float, float], ...] | None:
        """Per stage, (no-grad forward, forward, backward) seconds: the medians of the runs recorded. ``planned[i]``:
        stage i's as its plan has them, what a kind never timed is taken from: its share of the forward times the
        forward timed (a no-grad forward never run, a backward where the stages were simply called), or all three
        where its forward never ran under autograd (it ran a block option). None before a step was recorded or
        where no stage's forward was timed."""
        if not self.steps or not any(("forward", i) in self._seconds for i in range(self.stages)):
            return None
        times = []
        for i, (nograd, fwd, bwd) in enumerate(planned):
            forward = self._seconds.get(("forward", i))
            if not forward:
                times.append((nograd, fwd, bwd))
                continue
            timed = statistics.median(forward)
            scale = timed / fwd if fwd > 0 else 1.0
            others = [self._seconds.get((kind, i)) for kind in ("nograd", "backward")]
            times.append((statistics.median(others[0]) if others[0] else nograd * scale, timed,
                          statistics.median(others[1]) if others[1] else bwd * scale))
        return tuple(times)
