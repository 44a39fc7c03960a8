"""Stage times from the training steps (hierremat.runtime.step_times): for a family of input shapes on CPU whose
times are fitted from its steps rather than profiled apart, and for every shape's plan, solved again (the chain DP
alone) from its own steps' times once they are recorded.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Mapping, Sequence

from ..planning.shape_fit import ShapeSample, add_sample, chain_pattern
from ..runtime.profile import PROFILE_REPEATS
from .planned_shape import PlannedShape
from .shape_families import ShapeFamilies, input_shapes
from .shape_planning import device_types

log = logging.getLogger(__name__)

#: Steps per shape whose stage times its plan is first solved again from (StepRetimer.retime), for a family whose
#: times are fitted from its training steps (StepRetimer.times_from_steps): the medians of a shape's first three steps.
TIMED_STEPS = 3
#: Steps per shape whose stage times are recorded (hierremat.runtime.step_times): the shape's sample, that later
#: shapes' times are fitted from, follows the medians of its steps up to this many (a length seen again is timed
#: again), and its plan is solved again from them once they are all recorded. Fits from the medians of 7 interleaved
#: steps per length were within 10% of each length's own step at 9 of 11 lengths of the 4-layer GPT-2's loop and
#: 5 of 5 of the 12-layer's, those from its first 3 steps in a row at 7 of 11 and 2 of 5, from up to 6 (this) at
#: 8-9 of 11 and 5 of 5 (benchmarks/bench_shapes.py --accuracy; docs/results.md).
SAMPLED_STEPS = 9
#: Shapes timed in the training steps kept per family to fit from (spread over the sizes: add_sample).
STEP_SAMPLES = 12


def observed_times(planned: PlannedShape) -> tuple | None:
    """The stage times observed in ``planned``'s training steps (StepTimes.stage_times: what a stage's steps did
    not time taken from its plan's times), or None where none were."""
    step_times = planned.chain_module.planned.step_times
    if step_times is None:
        return None
    return step_times.stage_times([st.option_0_times for st in planned.plan.chain.costs.stages])


class StepRetimer:
    """The training steps' times of a RematModule's shapes: which families are timed there, the samples they give,
    and the plans solved again from them. ``plans``: the module's plans by input key (read, never changed here)."""

    def __init__(self, families: ShapeFamilies, plans: Mapping[tuple, PlannedShape]):
        self.families = families
        self.plans = plans

    def times_from_steps(self, family: tuple, args: tuple, kwargs: dict, deferring: bool, elsewhere: bool) -> bool:
        """Whether the family's stage times are taken from its training steps rather than profiled apart for them:
        for inputs on CPU (where a step's ops are timed as they run) while block options are still to be built once
        they pay (``deferring``), decided at the family's first shape and confirmed at its second (where block options
        were built by then, its shapes are profiled for times as before: those samples carry the node times that
        re-cost block options at the shapes fitted). ``elsewhere``: this shape is planned elsewhere (FSDP2's shards,
        a saved plan, a model without weights): no.

        Every shape of such a family records its first SAMPLED_STEPS steps (its sample follows them); a shape measured
        is timed from one run each and solved again from its steps' times once they are recorded; a shape fitted is
        fitted from the shapes timed so far, the shorter lengths measured for memory fits among them, and where those
        are too few however few (ShapeFit.of's ``reduced``) and planned again whenever more are timed; every shape is
        solved again from its own steps' times once they are recorded (retime)."""
        shapes = {input_shapes(c.skeleton) for c in self.plans.values() if c.family == family}
        steps = self.families.step_samples.get(family)
        if steps is None:
            if shapes or elsewhere or device_types(args, kwargs) != ("cpu",) or not deferring:
                return False
            self.families.step_samples[family] = []
            return True
        if len(shapes) == 1 and input_shapes((args, kwargs)) not in shapes and not deferring:
            del self.families.step_samples[family]  # (its second shape, block options built since)
            self._untime_shorter_lengths(family)
            return False
        return not elsewhere

    def _untime_shorter_lengths(self, family: tuple) -> None:
        """Where a family's times are profiled again (block options built since its first shape), the shorter
        lengths measured at its first shape to fit from with its steps' times (one timed run each, no block menu)
        count for memory alone: its shapes are then fitted from shapes profiled with their times and block menus."""
        samples = self.families.samples.get(family, [])
        samples[:] = [replace(s, times_measured=False) if s.cut and s.profile is not None
                      and s.profile.repeats < PROFILE_REPEATS else s for s in samples]

    def step_samples_of(self, family: tuple) -> list[ShapeSample]:
        """The family's shapes timed in its training steps (none where its times are not fitted from them), with
        the steps recorded since the last call added: each shape's stage times, bound by the family's symbolic
        capture (what its steps did not time taken from its plan's times: observed_times)."""
        samples = self.families.step_samples.get(family)
        symbolic = self.families.symbolic.get(family)
        if samples is None or symbolic is None:
            return []
        profiled = frozenset(s.bindings for s in self.families.samples.get(family, ()) if s.times_measured)  # (kept
        # beside their profiles: ShapeFit.step_ratios)
        for planned in self.plans.values():
            step_times = planned.chain_module.planned.step_times
            if planned.family != family or step_times is None or step_times.steps <= planned.steps_sampled:
                continue
            planned.steps_sampled = step_times.steps
            bindings = symbolic.bindings(*planned.skeleton)
            times = observed_times(planned)
            if bindings and times is not None:
                pattern = chain_pattern([info.signature for info in planned.chain.infos])
                add_sample(samples, ShapeSample.from_step_times(bindings, pattern, times), STEP_SAMPLES, profiled)
        return samples

    def timed_count(self, family: tuple) -> int:
        """How many of the family's shapes are timed, profiled or in the training steps (a shape whose times were
        fitted from fewer than a fit's monomials is planned again once more are: its own steps' times make it exact
        at itself, a third shape's the fit whole)."""
        timed = {s.bindings for s in self.families.samples.get(family, ()) if s.times_measured}
        return len(timed | {s.bindings for s in self.step_samples_of(family)})

    @staticmethod
    def times_due(planned: PlannedShape) -> tuple | None:
        """The stage times ``planned`` is to be solved again from now (its training steps': retime), or None where
        it is not due."""
        step_times = planned.chain_module.planned.step_times
        if step_times is None:
            return None
        early = planned.one_run and not planned.retimed_steps  # (after its first step)
        first = step_times.steps >= TIMED_STEPS > planned.retimed_steps  # (its first TIMED_STEPS, or a plan made
        # again since)
        if step_times.steps == planned.retimed_steps or (step_times.recording and not early and not first):
            return None
        return observed_times(planned)

    def retime(self, planned: PlannedShape, times: Sequence[tuple[float, float, float]] | None = None) -> None:
        """Solve a shape's plan again (the chain DP alone) from its training steps' times once its TIMED_STEPS steps
        are recorded (their medians) and again once all its SAMPLED_STEPS are, and, where it was measured from one
        timed run each, after its first step too: the times it runs with are then what its own steps took, whatever
        it was planned from (a fit from other lengths' single steps, one of them a noisy step, had predicted a
        268-token step at 2.8x the measured).

        ``times``: under FSDP2, where rank 0's shape is due (every rank solves again then, a collective: rank 0's
        plan on every rank), this rank's own shape's times to solve from (its steps' where due, else its plan's)."""
        times = times or self.times_due(planned)
        if times is None:
            return
        step_times = planned.chain_module.planned.step_times
        steps = step_times.steps if step_times is not None else 0
        before, note = planned.plan.predicted_step_time, planned.times_note
        planned.retime(times)
        planned.retimed_steps = steps
        planned.relabel_times(note, planned.times_note)
        if before > 0:  # (a heuristic: what block options could save, a share of the step, kept as that share)
            planned.block_gain *= planned.plan.predicted_step_time / before
        log.info("%s solved again at this shape from the times of its first %d training steps: predicted step %.1f ms "
                 "(%.1f ms before)", type(self.families.model).__name__, steps, planned.plan.predicted_step_time * 1e3,
                 before * 1e3)
