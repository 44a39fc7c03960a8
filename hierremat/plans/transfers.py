"""What a schedule moves to and from the second tier, and when the runner starts each move (issue 34).

A schedule that offloads (ops ``Offload(i)``/``Fetch(i)``, hierremat.plans.schedule) starts copying x_i out
at the ``F_ck(i)`` before its ``Offload(i)``, so that the copy runs beside the forward sweep (Beaumont,
Eyraud-Dubois and Shilova, NeurIPS 2021: transfers overlap the stages' compute). The DP prices the fetch as
done at ``Fetch(i)``, after the right part's backward; the runner may start it earlier where the bytes it
brings back fit under the schedule's simulated peak: :func:`transfer_plan` finds, for each fetch, the
earliest op from which x_i can be held on the device without any op peaking above that peak (the fetches
taken in schedule order, each one's bytes added to the ops it spans before the next is placed). So the
measured peak stays at most the simulated one, and the step is at most as slow as predicted.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidScheduleError
from .costs import ChainCosts
from .schedule import ChainSchedule, FCk, Fetch, Offload
from .simulate import simulate


@dataclass(frozen=True)
class TransferPlan:
    """How a schedule uses the second tier.

    copy_starts: indices of the ``F_ck(i)`` ops before which x_i's copy out starts (the next op on stage
        i's value is its ``Offload(i)``).
    prefetches: (op index, stage) pairs: before the op at that index, start bringing x_stage back (the
        fetch completes at its ``Fetch``).
    offloaded: the stages whose input x_i is offloaded, in the order of their offloads (once per offload).
    moved_bytes: bytes sent out per step (the same bytes come back).
    stall_seconds: the predicted time the step waits on transfers: each copy out's part the forward sweep
        does not hide, plus each fetch (priced as not overlapped).
    tier_peak_bytes: the most bytes the second tier holds at once.
    """

    copy_starts: frozenset[int] = frozenset()
    prefetches: tuple[tuple[int, int], ...] = ()
    offloaded: tuple[int, ...] = ()
    moved_bytes: int = 0
    stall_seconds: float = 0.0
    tier_peak_bytes: int = 0

    def prefetches_before(self) -> dict[int, list[int]]:
        """Op index -> stages whose fetch starts before that op."""
        found: dict[int, list[int]] = {}
        for index, stage in self.prefetches:
            found.setdefault(index, []).append(stage)
        return found

    def describe(self) -> str:
        """One summary line: what moves, how much, the predicted stall and the tier's peak."""
        if not self.offloaded:
            return "offloading: nothing offloaded"
        inputs = ", ".join(f"x_{i}" for i in self.offloaded)
        return (
            f"offloading: {inputs} sent to the second tier after their forward sweeps and fetched before their "
            f"backwards; {_mib(self.moved_bytes)} each way per step, predicted stall "
            f"{self.stall_seconds * 1e3:.2f} ms, "
            f"second tier peak {_mib(self.tier_peak_bytes)}"
        )


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def transfer_plan(costs: ChainCosts, schedule: ChainSchedule) -> TransferPlan:
    """The TransferPlan of ``schedule`` under ``costs`` (module docstring); empty where nothing is offloaded."""
    ops = schedule.ops
    if not any(isinstance(op, Offload) for op in ops):
        return TransferPlan()
    a = costs.activation_bytes
    timeline = simulate(costs, schedule, output_grad_persists=not schedule.keeps_everything).timeline
    peaks = [event.peak_bytes for event in timeline]
    ceiling = max(peaks)
    copy_starts, prefetches, offloaded = set(), [], []
    started_at: dict[int, int] = {}  # stage -> index of the F_ck its copy starts at
    offloaded_at: dict[int, int] = {}
    held = peak_held = moved = 0
    stall = 0.0
    for index, op in enumerate(ops):
        if isinstance(op, FCk):
            started_at[op.stage] = index
        elif isinstance(op, Offload):
            i = op.stage
            start = started_at.pop(i, None)
            if start is None:
                raise InvalidScheduleError(
                    f"op {index} ({op}): no F_ck({i}) since x_{i} was last used, to copy it out beside")
            copy_starts.add(start)
            offloaded_at[i] = index
            offloaded.append(i)
            moved += a[i]
            held += a[i]
            peak_held = max(peak_held, held)
            sweep = timeline[index - 1].time - (timeline[start - 1].time if start else 0.0)
            stall += max(0.0, costs.tier.offload_seconds(a[i]) - sweep)
        elif isinstance(op, Fetch):
            i = op.stage
            held -= a[i]
            stall += costs.tier.fetch_seconds(a[i])
            first = index
            while first - 1 > offloaded_at[i] and peaks[first - 1] + a[i] <= ceiling:
                first -= 1
            for k in range(first, index):
                peaks[k] += a[i]
            if first < index:
                prefetches.append((first, i))
        elif hasattr(op, "stage"):
            started_at.pop(op.stage, None)
    return TransferPlan(frozenset(copy_starts), tuple(prefetches), tuple(offloaded), moved, stall, peak_held)
