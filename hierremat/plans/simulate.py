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
    replay = _Replay(costs, output_grad_persists)
    timeline = []
    for idx, op in enumerate(ops):
        before = replay.used
        step = replay.step_of(op)
        if step is None:
            raise InvalidScheduleError(f"op {idx} ({op}): unknown op type")
        try:
            peak_op = step(op)
        except _Refused as refused:
            raise InvalidScheduleError(f"op {idx} ({op}): {refused}") from None
        timeline.append(MemoryEvent(idx, str(op), before, max(peak_op, replay.used), replay.used, replay.clock))
    replay.check_finished()
    peak = max(event.peak_bytes for event in timeline)
    return SimulationResult(time=replay.clock, peak_bytes=peak, timeline=tuple(timeline))


class _Refused(Exception):
    """An op the replay refuses (simulate names the op)."""


class _Replay:
    """The state of a replay: who holds each activation, the live tapes, the bytes in use and the clock (s).
    Each op's method checks the op, applies it, and returns its peak (bytes)."""

    def __init__(self, costs: ChainCosts, output_grad_persists: bool):
        self.costs = costs
        self.output_grad_persists = output_grad_persists
        self.L = costs.length
        self.a = costs.activation_bytes
        self.holders: dict[int, set] = {0: {"input"}}  # activation index -> who holds it
        self.grad_alive: set[int] = set()
        self.tapes: dict[int, int] = {}  # stage -> option index of its live F_all tape
        self.done_backward: set[int] = set()
        self.used = 0
        self.caller_part = 0  # the bytes of x_L the caller keeps after the Loss, where it keeps only part
        self.made: set[int] = set()  # stages whose residents exist
        self.clock = 0.0
        self.loss_done = False
        self.copy_started: dict[int, float] = {}  # x_i -> when the F_ck(i) its offload copy runs beside began
        self.offloaded: set[int] = set()
        self.kept_away: dict[int, bool] = {}  # stage whose tape's kept values are in the second tier -> x_i too
        self._steps = ((FNone, self.forward), (FCk, self.forward), (FAll, self.forward), (Offload, self.offload),
                       (Fetch, self.fetch), (OffloadKept, self.offload_kept), (FetchKept, self.fetch_kept),
                       (Loss, self.loss), (Backward, self.backward))

    def step_of(self, op):
        """The method that replays ``op`` (the first kind it is an instance of), or None for an unknown op."""
        return next((step for kind, step in self._steps if isinstance(op, kind)), None)

    def hold(self, j: int, who) -> None:
        if j not in self.holders:
            self.holders[j] = set()
            self.used += 0 if j == 0 else self.a[j]
        self.holders[j].add(who)

    def release(self, j: int, who) -> None:
        if j in self.holders:
            self.holders[j].discard(who)
            if not self.holders[j]:
                del self.holders[j]
                self.used -= self.a[j] - (self.caller_part if j == self.L else 0)

    def _check_forward(self, op) -> None:
        i, L = op.stage, self.L
        if not 0 <= i < L:
            raise _Refused(f"stage out of range 0..{L - 1}")
        if i in self.done_backward:
            raise _Refused("forward of a stage whose backward is done")
        if i in self.tapes:
            raise _Refused(f"stage {i} already holds a tape")
        if "chain" not in self.holders.get(i, ()) and i != 0:
            raise _Refused(f"its input x_{i} is not in memory (missing checkpoint)")
        if (i + 1) in self.holders:
            raise _Refused(f"x_{i + 1} is already in memory")
        if isinstance(op, FAll) and not 0 <= op.option < len(self.costs.stages[i].options):
            raise _Refused("option out of range")

    def forward(self, op) -> int:
        self._check_forward(op)
        i, stage = op.stage, self.costs.stages[op.stage]
        if isinstance(op, FAll):
            opt = stage.options[op.option]
            peak_op = self.used + opt.fwd_overhead_bytes
            self.used += opt.kept_bytes
            self.tapes[i] = op.option
            self.clock += opt.fwd_time
            if opt.pins_output:
                self.hold(i + 1, ("tape", i))
            if opt.pins_input:
                self.hold(i, ("tape", i))
        else:
            peak_op = self.used + stage.nograd_fwd_overhead_bytes
            if isinstance(op, FCk):
                self.copy_started[i] = self.clock
            self.clock += stage.nograd_fwd_time
        if i not in self.made:
            self.made.add(i)
            self.used += self.costs.resident_values_of(i)
        if i + 1 == self.L:
            self.hold(self.L, "caller")
        elif (i + 1) not in self.grad_alive:
            self.hold(i + 1, "chain")
        if not isinstance(op, FCk) and i != 0:
            self.release(i, "chain")
        return peak_op

    def offload(self, op) -> int:
        # x_i's copy out began with F_ck(i) and ran beside the compute since; what it did not finish
        # is a stall, then x_i leaves the device (Beaumont, Eyraud-Dubois and Shilova, NeurIPS 2021)
        i = op.stage
        if self.costs.tier is None:
            raise _Refused("the costs have no second tier")
        if not 0 < i < self.L or self.holders.get(i) != {"chain"}:
            raise _Refused(f"x_{i} is not a checkpoint the chain alone holds")
        hidden = self.clock - self.copy_started.get(i, self.clock)
        self.clock += max(0.0, self.costs.tier.offload_seconds(self.a[i]) - hidden)
        peak_op = self.used
        self.release(i, "chain")
        self.offloaded.add(i)
        return peak_op

    def fetch(self, op) -> int:
        i = op.stage
        if i not in self.offloaded:
            raise _Refused(f"x_{i} was not offloaded")
        self.offloaded.discard(i)
        self.clock += self.costs.tier.fetch_seconds(self.a[i])
        self.hold(i, "chain")
        return self.used

    def offload_kept(self, op) -> int:
        i, tier = op.stage, self.costs.tier
        if tier is None:
            raise _Refused("the costs have no second tier")
        if i not in self.tapes or i in self.kept_away:
            raise _Refused(f"no tape of F_all({i}) with its kept values on the device")
        opt = self.costs.stages[i].options[self.tapes[i]]
        if not opt.kept_offloadable:
            raise _Refused(f"option {self.tapes[i]} of stage {i} keeps nothing that can be offloaded")
        self.clock += tier.offload_seconds(opt.kept_bytes)
        peak_op = self.used
        self.used -= opt.kept_bytes
        self.kept_away[i] = False
        if op.with_input:  # x_i goes with them
            if not (opt.pins_input and i > 0 and self.holders.get(i) == {("tape", i)}):
                raise _Refused(f"x_{i} is not held by the tape of F_all({i}) alone")
            self.clock += tier.offload_seconds(self.a[i])
            self.release(i, ("tape", i))
            self.kept_away[i] = True
        return peak_op

    def fetch_kept(self, op) -> int:
        i = op.stage
        if i not in self.kept_away:
            raise _Refused(f"the kept values of stage {i} were not offloaded")
        opt = self.costs.stages[i].options[self.tapes[i]]
        self.clock += self.costs.tier.fetch_seconds(opt.kept_bytes)
        self.used += opt.kept_bytes
        if self.kept_away.pop(i):
            self.clock += self.costs.tier.fetch_seconds(self.a[i])
            self.hold(i, ("tape", i))
        return self.used

    def loss(self, op) -> int:
        costs, L = self.costs, self.L
        if self.loss_done:
            raise _Refused("second Loss")
        if L not in self.holders:
            raise _Refused(f"the chain output x_{L} was not computed")
        self.loss_done = True
        self.used += costs.output_grad + sum(r.grad_bytes for r in costs.residents if r.exported)
        self.grad_alive.add(L)
        peak_op = self.used
        if costs.held_output < self.a[L]:
            # the caller keeps only part of x_L: it stays whole while a tape pins it
            self.caller_part = costs.held_output
            self.release(L, "caller")
        return peak_op

    def backward(self, op) -> int:
        i, costs, L = op.stage, self.costs, self.L
        if not 0 <= i < L:
            raise _Refused(f"stage out of range 0..{L - 1}")
        if i not in self.tapes:
            raise _Refused(f"no F_all({i}) ran before it")
        if (i + 1) not in self.grad_alive:
            raise _Refused(f"gradient of x_{i + 1} not available")
        if i in self.kept_away:
            raise _Refused(f"the kept values of stage {i} are in the second tier (no Fetch_kept({i}))")
        opt = costs.stages[i].options[self.tapes.pop(i)]
        peak_op = self.used + costs.bwd_overhead(i, opt)
        self.clock += opt.bwd_time
        self.used -= opt.kept_bytes
        self.release(i, ("tape", i))
        self.release(i + 1, ("tape", i))
        if i + 1 < L or not self.output_grad_persists:
            self.grad_alive.discard(i + 1)
            self.used -= self.a[i + 1] if i + 1 < L else costs.output_grad
        self.grad_alive.add(i)
        self.used += costs.grad_bytes(i) + costs.step_grad(i)
        for r in costs.residents:
            if r.last_reader == i and r.readers and not r.exported:
                self.used += r.grad_bytes
            if r.producer == i:
                self.used -= r.grad_bytes + (0 if r.exported else r.value_bytes)
        self.done_backward.add(i)
        return peak_op

    def check_finished(self) -> None:
        if not self.loss_done:
            raise InvalidScheduleError("schedule has no Loss op")
        if len(self.done_backward) != self.L or self.tapes:
            raise InvalidScheduleError(
                f"schedule ends before the backward of every stage (tapes left: {sorted(self.tapes)})")
        if self.offloaded:
            raise InvalidScheduleError(f"schedule ends with x_{min(self.offloaded)} offloaded and never fetched")
