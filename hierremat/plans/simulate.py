"""Op-by-op replay of a ChainSchedule: time, peak bytes and the memory timeline.

This is the reference for the memory model that the chain DP optimises; it is written
independently of the DP's recurrences (it tracks who holds each value) so that tests
can compare the two. Rules:

* x_0 is the step's input and is not counted. x_L is held by the caller until the Loss
  (which creates its gradient of ``costs.output_grad`` bytes); from then on the caller
  holds ``costs.held_output`` bytes of it to the end. The output gradient (held by the
  autograd engine during our backward) is never freed.
* An activation x_j is in memory while something holds it: the chain (from the forward
  that produces it until F_none(j) or F_all(j) consumes it; F_ck(j) keeps it), the
  tape of F_all(j) if the option pins its input, the tape of F_all(j-1) if that option
  pins its output. A tape lives from its F_all to its B.
* An x_{j} produced when its gradient already exists is not held by the chain.
* B(i) frees its tape's kept bytes and the gradient of x_{i+1}, and produces the
  gradient of x_i.
* The peak of an op is the memory before it plus its overhead (see hierremat.plans.costs).
* Residents (hierremat.plans.costs.ResidentCosts): a value is made by the first forward of its
  producer and freed by the producer's backward (never, when exported); the copy a
  recomputing forward with grad makes is in its option's kept bytes. A gradient
  sum begins at the Loss (exported) or with the backward of its last reader (its bytes
  are in that backward's overhead) and is freed by the producer's backward.
* Offload_kept(i) moves the kept bytes of F_all(i)'s tape to the second tier, waiting for the copy (its
  time is added whole: nothing runs beside it), and with ``with_input`` x_i, which the tape must pin and
  hold alone; Fetch_kept(i) brings them back (its time added whole too) before B(i), which may not run while
  they are away.
"""

from __future__ import annotations

from dataclasses import dataclass

from .costs import ChainCosts
from ..errors import InvalidScheduleError
from .schedule import Backward, ChainSchedule, FAll, FCk, Fetch, FetchKept, FNone, Loss, Offload, OffloadKept


@dataclass(frozen=True)
class MemoryEvent:
    """One op of the replay: bytes in use before it, at its peak, and after it."""

    op_index: int
    op: str
    before_bytes: int
    peak_bytes: int
    after_bytes: int
    time: float  # seconds since the start of the step, at the op's end


@dataclass(frozen=True)
class SimulationResult:
    time: float
    peak_bytes: int
    timeline: tuple[MemoryEvent, ...]


def simulate(costs: ChainCosts, schedule: ChainSchedule | tuple, *, output_grad_persists: bool = True) -> SimulationResult:
    """Replay ``schedule`` (a ChainSchedule or a sequence of ops) under ``costs``.

    output_grad_persists: the output gradient stays until the end (hierremat's runner,
    whose autograd Function receives it); False frees it after B(L-1), as plain autograd
    does when the whole chain runs without our Function.

    Raises InvalidScheduleError on an op whose inputs are not in memory, a backward
    before its forward, a missing Loss, or an unfinished backward.
    """
    ops = schedule.ops if isinstance(schedule, ChainSchedule) else tuple(schedule)
    L = costs.length
    a = costs.activation_bytes
    holders: dict[int, set] = {0: {"input"}}  # activation index -> who holds it
    grad_alive: set[int] = set()
    tapes: dict[int, int] = {}  # stage -> option index of its live F_all tape
    done_backward: set[int] = set()
    state = {"used": 0, "caller_part": 0}
    made: set[int] = set()  # stages whose residents exist
    clock = 0.0
    loss_done = False
    timeline = []
    copy_started: dict[int, float] = {}  # x_i -> when the F_ck(i) its offload copy runs beside began
    offloaded: set[int] = set()
    kept_away: dict[int, bool] = {}  # stage whose tape's kept values are in the second tier -> whether x_i is too

    def hold(j: int, who) -> None:
        if j not in holders:
            holders[j] = set()
            state["used"] += 0 if j == 0 else a[j]
        holders[j].add(who)

    def release(j: int, who) -> None:
        if j in holders:
            holders[j].discard(who)
            if not holders[j]:
                del holders[j]
                state["used"] -= a[j] - (state["caller_part"] if j == L else 0)

    def fail(idx: int, op, why: str):
        raise InvalidScheduleError(f"op {idx} ({op}): {why}")

    for idx, op in enumerate(ops):
        before = state["used"]
        if isinstance(op, (FNone, FCk, FAll)):
            i = op.stage
            if not 0 <= i < L:
                fail(idx, op, f"stage out of range 0..{L - 1}")
            if i in done_backward:
                fail(idx, op, "forward of a stage whose backward is done")
            if i in tapes:
                fail(idx, op, f"stage {i} already holds a tape")
            if "chain" not in holders.get(i, ()) and i != 0:
                fail(idx, op, f"its input x_{i} is not in memory (missing checkpoint)")
            if (i + 1) in holders:
                fail(idx, op, f"x_{i + 1} is already in memory")
            if isinstance(op, FAll):
                if not 0 <= op.option < len(costs.stages[i].options):
                    fail(idx, op, "option out of range")
                opt = costs.stages[i].options[op.option]
                peak_op = before + opt.fwd_overhead_bytes
                state["used"] += opt.kept_bytes
                tapes[i] = op.option
                clock += opt.fwd_time
                if opt.pins_output:
                    hold(i + 1, ("tape", i))
                if opt.pins_input:
                    hold(i, ("tape", i))
            else:
                peak_op = before + costs.stages[i].nograd_fwd_overhead_bytes
                if isinstance(op, FCk):
                    copy_started[i] = clock
                clock += costs.stages[i].nograd_fwd_time
            if i not in made:
                made.add(i)
                state["used"] += costs.resident_values_of(i)
            if i + 1 == L:
                hold(L, "caller")
            elif (i + 1) not in grad_alive:
                hold(i + 1, "chain")
            if not isinstance(op, FCk) and i != 0:
                release(i, "chain")
        elif isinstance(op, Offload):
            # x_i's copy out began with F_ck(i) and ran beside the compute since; what it did not finish
            # is a stall, then x_i leaves the device (Beaumont, Eyraud-Dubois and Shilova, NeurIPS 2021)
            i = op.stage
            if costs.tier is None:
                fail(idx, op, "the costs have no second tier")
            if not 0 < i < L or holders.get(i) != {"chain"}:
                fail(idx, op, f"x_{i} is not a checkpoint the chain alone holds")
            hidden = clock - copy_started.get(i, clock)
            clock += max(0.0, costs.tier.offload_seconds(a[i]) - hidden)
            peak_op = before
            release(i, "chain")
            offloaded.add(i)
        elif isinstance(op, Fetch):
            i = op.stage
            if i not in offloaded:
                fail(idx, op, f"x_{i} was not offloaded")
            offloaded.discard(i)
            clock += costs.tier.fetch_seconds(a[i])
            hold(i, "chain")
            peak_op = state["used"]
        elif isinstance(op, OffloadKept):
            i = op.stage
            if costs.tier is None:
                fail(idx, op, "the costs have no second tier")
            if i not in tapes or i in kept_away:
                fail(idx, op, f"no tape of F_all({i}) with its kept values on the device")
            opt = costs.stages[i].options[tapes[i]]
            if not opt.kept_offloadable:
                fail(idx, op, f"option {tapes[i]} of stage {i} keeps nothing that can be offloaded")
            clock += costs.tier.offload_seconds(opt.kept_bytes)
            peak_op = before
            state["used"] -= opt.kept_bytes
            kept_away[i] = False
            if op.with_input:  # x_i goes with them
                if not (opt.pins_input and i > 0 and holders.get(i) == {("tape", i)}):
                    fail(idx, op, f"x_{i} is not held by the tape of F_all({i}) alone")
                clock += costs.tier.offload_seconds(a[i])
                release(i, ("tape", i))
                kept_away[i] = True
        elif isinstance(op, FetchKept):
            i = op.stage
            if i not in kept_away:
                fail(idx, op, f"the kept values of stage {i} were not offloaded")
            opt = costs.stages[i].options[tapes[i]]
            clock += costs.tier.fetch_seconds(opt.kept_bytes)
            state["used"] += opt.kept_bytes
            if kept_away.pop(i):
                clock += costs.tier.fetch_seconds(a[i])
                hold(i, ("tape", i))
            peak_op = state["used"]
        elif isinstance(op, Loss):
            if loss_done:
                fail(idx, op, "second Loss")
            if L not in holders:
                fail(idx, op, f"the chain output x_{L} was not computed")
            loss_done = True
            state["used"] += costs.output_grad + sum(r.grad_bytes for r in costs.residents if r.exported)
            grad_alive.add(L)
            peak_op = state["used"]
            if costs.held_output < a[L]:
                # the caller keeps only part of x_L: it stays whole while a tape pins it
                state["caller_part"] = costs.held_output
                release(L, "caller")
        elif isinstance(op, Backward):
            i = op.stage
            if not 0 <= i < L:
                fail(idx, op, f"stage out of range 0..{L - 1}")
            if i not in tapes:
                fail(idx, op, f"no F_all({i}) ran before it")
            if (i + 1) not in grad_alive:
                fail(idx, op, f"gradient of x_{i + 1} not available")
            if i in kept_away:
                fail(idx, op, f"the kept values of stage {i} are in the second tier (no Fetch_kept({i}))")
            opt = costs.stages[i].options[tapes.pop(i)]
            peak_op = before + costs.bwd_overhead(i, opt)
            clock += opt.bwd_time
            state["used"] -= opt.kept_bytes
            release(i, ("tape", i))
            release(i + 1, ("tape", i))
            if i + 1 < L or not output_grad_persists:
                grad_alive.discard(i + 1)
                state["used"] -= a[i + 1] if i + 1 < L else costs.output_grad
            grad_alive.add(i)
            state["used"] += costs.grad_bytes(i) + costs.step_grad(i)
            for r in costs.residents:
                if r.last_reader == i and r.readers and not r.exported:
                    state["used"] += r.grad_bytes
                if r.producer == i:
                    state["used"] -= r.grad_bytes + (0 if r.exported else r.value_bytes)
            done_backward.add(i)
        else:
            fail(idx, op, "unknown op type")
        used = state["used"]
        peak_op = max(peak_op, used)
        timeline.append(MemoryEvent(idx, str(op), before, peak_op, used, clock))

    if not loss_done:
        raise InvalidScheduleError("schedule has no Loss op")
    if len(done_backward) != L or tapes:
        raise InvalidScheduleError(f"schedule ends before the backward of every stage (tapes left: {sorted(tapes)})")
    if offloaded:
        raise InvalidScheduleError(f"schedule ends with x_{min(offloaded)} offloaded and never fetched")
    peak = max(event.peak_bytes for event in timeline)
    return SimulationResult(time=clock, peak_bytes=peak, timeline=tuple(timeline))
