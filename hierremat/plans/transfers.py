"""What a schedule moves to and from the second tier, and when the runner starts each move.

A schedule that offloads (ops ``Offload(i)``/``Fetch(i)``, hierremat.plans.schedule) starts copying x_i out
at the ``F_ck(i)`` before its ``Offload(i)``, so that the copy runs beside the forward sweep (Beaumont,
Eyraud-Dubois and Shilova, NeurIPS 2021: transfers overlap the stages' compute). The DP prices the fetch as
done at ``Fetch(i)``, after the right part's backward; the runner may start it earlier where the bytes it
brings back fit under the schedule's simulated peak: :func:`transfer_plan` finds, for each fetch, the
earliest op from which x_i can be held on the device without any op peaking above that peak (the fetches
taken in schedule order, each one's bytes added to the ops it spans before the next is placed). So the
measured peak stays at most the simulated one, and the step is at most as slow as predicted.

A schedule may also offload the values an option's tape keeps (``Offload_kept(i)`` after ``F_all(i, k)``,
``Fetch_kept(i)`` before ``B(i)``): their copy out is waited for where it is (the stages after i run in the
memory it frees), and their fetch is placed early as x_i's is.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidScheduleError
from .costs import ChainCosts
from .schedule import Backward, ChainSchedule, FAll, FCk, Fetch, FetchKept, Offload, OffloadKept
from .simulate import simulate


@dataclass(frozen=True)
class TransferPlan:
    """How a schedule uses the second tier.

    copy_starts: indices of the ``F_ck(i)`` ops before which x_i's copy out starts (the next op on stage
        i's value is its ``Offload(i)``).
    prefetches: (op index, stage) pairs: before the op at that index, start bringing x_stage back (the
        fetch completes at its ``Fetch``).
    offloaded: the stages whose input x_i is offloaded, in the order of their offloads (once per offload).
    kept_prefetches: (op index, stage) pairs: before the op at that index, start bringing back the values
        stage's tape keeps (the fetch completes at its ``Fetch_kept``).
    kept_offloaded: (stage, option, input) of each ``Offload_kept``, in schedule order: the option whose kept
        values leave the device, and whether x_stage goes with them (``OffloadKept.with_input``).
    moved_bytes: bytes sent out per step (the same bytes come back).
    stall_seconds: the predicted time the step waits on transfers: each copy out's part the forward sweep
        does not hide (all of a kept values' copy), plus each fetch (priced as not overlapped).
    tier_peak_bytes: the most bytes the second tier holds at once.
    """

    copy_starts: frozenset[int] = frozenset()
    prefetches: tuple[tuple[int, int], ...] = ()
    offloaded: tuple[int, ...] = ()
    kept_prefetches: tuple[tuple[int, int], ...] = ()
    kept_offloaded: tuple[tuple[int, int, bool], ...] = ()
    moved_bytes: int = 0
    stall_seconds: float = 0.0
    tier_peak_bytes: int = 0

    @property
    def moves_anything(self) -> bool:
        """Whether the schedule sends anything to the second tier."""
        return bool(self.offloaded or self.kept_offloaded)

    def prefetches_before(self) -> dict[int, list[tuple[int, bool]]]:
        """Op index -> (stage, kept) of the fetches that start before that op: x_stage's (kept False) or the
        values stage's tape keeps (kept True)."""
        found: dict[int, list[tuple[int, bool]]] = {}
        for pairs, kept in ((self.prefetches, False), (self.kept_prefetches, True)):
            for index, stage in pairs:
                found.setdefault(index, []).append((stage, kept))
        return found

    def describe(self) -> str:
        """One summary line: what moves, how much, the predicted stall and the tier's peak."""
        if not self.moves_anything:
            return "offloading: nothing offloaded"
        moved = []
        if self.offloaded:
            inputs = ", ".join(f"x_{i}" for i in self.offloaded)
            moved.append(f"{inputs} sent to the second tier after their forward sweeps and fetched before their "
                         "backwards")
        if self.kept_offloaded:
            stages = ", ".join(f"{i}{' (with x_' + str(i) + ')' if sent else ''}" for i, _, sent in self.kept_offloaded)
            moved.append(f"the values kept by the forwards with grad of stages {stages} sent after them and fetched "
                         "before their backwards")
        return (
            f"offloading: {'; '.join(moved)}; {_mib(self.moved_bytes)} each way per step, predicted stall "
            f"{self.stall_seconds * 1e3:.2f} ms, "
            f"second tier peak {_mib(self.tier_peak_bytes)}"
        )


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def transfer_plan(costs: ChainCosts, schedule: ChainSchedule) -> TransferPlan:
    """The TransferPlan of ``schedule`` under ``costs`` (module docstring); empty where nothing is offloaded."""
    ops = schedule.ops
    if not any(isinstance(op, (Offload, OffloadKept)) for op in ops):
        return TransferPlan()
    a = costs.activation_bytes
    timeline = simulate(costs, schedule, output_grad_persists=not schedule.keeps_everything).timeline
    peaks = [event.peak_bytes for event in timeline]
    ceiling = max(peaks)
    copy_starts, prefetches, offloaded, kept_prefetches, kept_offloaded = set(), [], [], [], []
    started_at: dict[int, int] = {}  # stage -> index of the F_ck its copy starts at
    offloaded_at: dict[int, int] = {}
    kept_at: dict[int, tuple[int, int, int]] = {}  # stage -> (index of its Offload_kept, kept bytes, x_i's bytes sent)
    tapes: dict[int, int] = {}  # stage -> option of its live F_all tape
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
            first = _place_fetch(peaks, ceiling, offloaded_at[i], index, a[i])
            if first < index:
                prefetches.append((first, i))
        elif isinstance(op, OffloadKept):
            i = op.stage
            kept, input_bytes = costs.stages[i].options[tapes[i]].kept_bytes, a[i] if op.with_input else 0
            kept_at[i] = (index, kept, input_bytes)
            kept_offloaded.append((i, tapes[i], op.with_input))
            moved += kept + input_bytes
            held += kept + input_bytes
            peak_held = max(peak_held, held)
            stall += costs.tier.offload_seconds(kept) + costs.tier.offload_seconds(input_bytes)
        elif isinstance(op, FetchKept):
            i = op.stage
            start, kept, input_bytes = kept_at.pop(i)
            held -= kept + input_bytes
            stall += costs.tier.fetch_seconds(kept) + costs.tier.fetch_seconds(input_bytes)
            first = _place_fetch(peaks, ceiling, start, index, kept + input_bytes)
            if first < index:
                kept_prefetches.append((first, i))
        elif hasattr(op, "stage"):
            started_at.pop(op.stage, None)
            if isinstance(op, FAll):
                tapes[op.stage] = op.option
            elif isinstance(op, Backward):
                del tapes[op.stage]
    return TransferPlan(frozenset(copy_starts), tuple(prefetches), tuple(offloaded), tuple(kept_prefetches),
                        tuple(kept_offloaded), moved, stall, peak_held)


def _place_fetch(peaks: list[int], ceiling: int, offloaded_at: int, fetch_at: int, nbytes: int) -> int:
    """The earliest op index after ``offloaded_at`` from which ``nbytes`` can be held until ``fetch_at`` without an
    op's peak going above ``ceiling``; adds them to those ops' ``peaks``."""
    first = fetch_at
    while first - 1 > offloaded_at and peaks[first - 1] + nbytes <= ceiling:
        first -= 1
    for k in range(first, fetch_at):
        peaks[k] += nbytes
    return first
