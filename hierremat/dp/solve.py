"""Solve a chain: discretise, fill the DP tables, backtrack to a ChainSchedule.

``solve_chain`` returns the fastest schedule of Rotor's family (persistent schedules,
Beaumont et al. 2019) whose peak fits the budget under the discretised memory model.
``min_peak_schedule`` returns the schedule of least peak in exact bytes (ties: least
time): its peak is the smallest feasible budget reported by InfeasibleBudgetError.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..plans.costs import ChainCosts, OptionCosts, StageCosts
from ..errors import InfeasibleBudgetError
from ..plans.schedule import Backward, ChainSchedule, FAll, FCk, Fetch, FetchKept, FNone, Loss, Offload, OffloadKept
from .decisions import Action, Choice, OptionChoice, SplitChoice, decode_code
from .discretize import ChainArrays, ceil_div, discretize, resident_terms

log = logging.getLogger(__name__)

DEFAULT_SLOTS = 500


@dataclass(frozen=True)
class ChainSolution:
    """A solved chain: the schedule and how it was found."""

    schedule: ChainSchedule
    solve_seconds: float
    slots: int
    options_before_pruning: int
    options_after_pruning: int
    fallback_min_peak: bool  # True if the DP's discretisation found nothing and the min-peak schedule was used


# A chooser maps (v, s, t, m) to the subproblem's Choice (hierremat.dp.decisions); v = 1 when x_s is held by the
# caller's tape (see hierremat.dp.kernel).
Chooser = Callable[[int, int, int, int], Choice]


class _Expander:
    """Turns decisions into ops, and computes each sub-schedule's exact peak and time.

    The exact-bytes terms mirror the DP's slot terms (see hierremat.dp.kernel); the
    simulator checks both independently.
    """

    def __init__(self, costs: ChainCosts):
        self.costs = costs
        self.a = costs.activation_bytes
        self.L = costs.length
        self.NV, self.DL, self.FV = resident_terms(costs)

    def swept_residents(self, s: int, sp: int, t: int) -> int:
        return int(self.FV[s, sp]) if t == self.L - 1 else 0

    def resident_after_right(self, t: int) -> int:
        return self.costs.output_resident if t == self.L - 1 else -self.a[t + 1]

    def input_credit(self, v: int, s: int, k: int) -> int:
        pins = self.costs.stages[s].options[k].pins_input
        return self.a[s] if v == 0 and s > 0 and not pins else 0

    def option_terms(self, v: int, s: int, t: int, k: int, sub_peak: int, kept_offloaded: bool = False,
                     with_input: bool = False) -> int:
        """Exact peak (bytes above the start) of F_all(s,k) [sub-chain] B(s); with ``kept_offloaded`` the
        sub-chain runs with the option's kept values in the second tier, and x_s with them if ``with_input``."""
        op = self.costs.stages[s].options[k]
        a, L = self.a, self.L
        credit = self.input_credit(v, s, k)
        made = int(self.NV[s]) if t == L - 1 else 0
        residents_held = made + int(self.DL[s + 1, t])
        if s == t == L - 1:
            held = max(self.costs.held_output, int(op.pins_output) * a[L])
            loss_and_backward = max(a[L], self.costs.bwd_overhead(s, op) + held)
            return max(
                op.fwd_overhead_bytes, op.kept_bytes - credit + self.costs.output_grad + loss_and_backward + residents_held
            )
        if s == t:
            resident = int(op.pins_output) * a[s + 1]
            return max(op.fwd_overhead_bytes, op.kept_bytes + self.costs.bwd_overhead(s, op) - credit + resident + residents_held)
        backward = op.kept_bytes + (1 + int(op.pins_output)) * a[s + 1] + self.costs.bwd_overhead(s, op) - credit
        return max(
            op.fwd_overhead_bytes,
            (0 if kept_offloaded else op.kept_bytes) + a[s + 1] - (a[s] if with_input else credit) + made + sub_peak,
            backward + self.resident_after_right(t) + residents_held,
        )

    def kept_transfer_times(self, s: int, k: int, with_input: bool) -> float:
        """Seconds that sending option k's kept values (and x_s ``with_input``) out and back adds, each waited for."""
        tier, kept = self.costs.tier, self.costs.stages[s].options[k].kept_bytes
        return tier.round_trip_seconds(kept) + (tier.round_trip_seconds(self.a[s]) if with_input else 0.0)

    def kept_offloads(self, v: int, s: int, t: int, k: int) -> tuple[bool, ...]:
        """The ``with_input`` of each way option k may offload its kept values: none where it cannot, False (kept values
        only), and True where it pins x_s and nothing else holds it (v = 0, s > 0)."""
        option = self.costs.stages[s].options[k]
        if self.costs.tier is None or s == t or not option.kept_offloadable:
            return ()
        return (False, True) if v == 0 and s > 0 and option.pins_input else (False,)

    def forward_peak(self, s: int, sp: int, t: int) -> int:
        stages, a = self.costs.stages, self.a
        return max(
            [stages[s].nograd_fwd_overhead_bytes]
            + [a[j] + stages[j].nograd_fwd_overhead_bytes + self.swept_residents(s, j, t) for j in range(s + 1, sp)]
        )

    def split_terms(self, s: int, t: int, sp: int, right_peak: int, left_peak: int, offloaded: bool = False) -> int:
        """Exact peak of F_ck(s) F_none(s+1..sp-1) [Offload(s)] right part [Fetch(s)] left part: with x_s
        offloaded the right part runs without it, and it is back before the left part."""
        a, swept = self.a, self.swept_residents(s, sp, t)
        return max(
            self.forward_peak(s, sp, t),
            a[sp] + swept + right_peak - (a[s] if offloaded else 0),
            a[sp] + swept + self.resident_after_right(t) + int(self.DL[sp, t]) + left_peak,
        )

    def offload_times(self, s: int, sweep_time: float) -> float:
        """Seconds an offload of x_s adds: the copy out the sweep (``sweep_time``) does not hide, the fetch."""
        tier, nbytes = self.costs.tier, self.a[s]
        return max(tier.offload_seconds(nbytes) - sweep_time, 0.0) + tier.fetch_seconds(nbytes)

    def can_offload(self, v: int, s: int) -> bool:
        return self.costs.tier is not None and v == 0 and 0 < s < self.L

    def expand(self, choose: Chooser, v: int, s: int, t: int, m: int, ops: list) -> tuple[int, float]:
        """Append the ops of subproblem (v, s, t) to ``ops``; return (exact peak, time)."""
        choice = choose(v, s, t, m)
        stages = self.costs.stages
        if isinstance(choice, OptionChoice):
            k, kept_offloaded, with_input = choice.option, choice.kept_offloaded, choice.with_input
            op = stages[s].options[k]
            ops.append(FAll(s, k))
            if s == t:
                if t == self.L - 1:
                    ops.append(Loss())
                sub_peak, sub_time = 0, 0.0
            else:
                if kept_offloaded:
                    ops.append(OffloadKept(s, with_input))
                sub_peak, sub_time = self.expand(choose, int(op.pins_output), s + 1, t, choice.memory_rest, ops)
                if kept_offloaded:
                    ops.append(FetchKept(s))
                    sub_time += self.kept_transfer_times(s, k, with_input)
            ops.append(Backward(s))
            peak = self.option_terms(v, s, t, k, sub_peak, kept_offloaded, with_input)
            return peak, op.fwd_time + sub_time + op.bwd_time
        sp, offloaded = choice.split, choice.offloaded
        ops.append(FCk(s))
        fwd_time = stages[s].nograd_fwd_time
        for j in range(s + 1, sp):
            ops.append(FNone(j))
            fwd_time += stages[j].nograd_fwd_time
        transfers = self.offload_times(s, fwd_time) if offloaded else 0.0
        if offloaded:
            ops.append(Offload(s))
        right_peak, right_time = self.expand(choose, 0, sp, t, choice.memory_right, ops)
        if offloaded:
            ops.append(Fetch(s))
        left_peak, left_time = self.expand(choose, v, s, sp - 1, choice.memory_left, ops)
        peak = self.split_terms(s, t, sp, right_peak, left_peak, offloaded)
        return peak, fwd_time + transfers + right_time + left_time


def _dp_chooser(arrays: ChainArrays, D: np.ndarray, M: int, L: int) -> Chooser:
    A, A_floor, KEPT = arrays.A, arrays.A_floor, arrays.KEPT
    K = arrays.OF.shape[1]

    def choose(v: int, s: int, t: int, m: int) -> Choice:
        c = int(D[v, s, t, m])
        if c < 0:
            raise AssertionError(f"backtracking reached an infeasible state {(v, s, t, m)}")
        action, index = decode_code(c, K, L)
        if action in (Action.SPLIT, Action.OFFLOADED_SPLIT):
            sp, offloaded = index, action is Action.OFFLOADED_SPLIT
            m_right = m - int(A[sp]) - (int(arrays.FV[s, sp]) if t == L - 1 else 0)
            m_left = m_right - arrays.HL - arrays.GL if t == L - 1 else m_right + int(A_floor[t + 1])
            m_left = min(M, m_left - int(arrays.DL[sp, t]))
            return SplitChoice(offloaded, sp, min(M, m_right + int(A_floor[s])) if offloaded else m_right, m_left)
        k = index
        # (x_s freed by F_all, or sent with the kept values)
        freed = v == 0 and s > 0 and (action is Action.OFFLOADED_OPTION_AND_INPUT or not arrays.PIN_IN[s, k])
        credit = int(A_floor[s]) if freed else 0
        made = int(arrays.NV[s]) if t == L - 1 else 0
        kept = 0 if action is not Action.OPTION else int(KEPT[s, k])
        m_rest = min(M, m - kept - int(A[s + 1]) + credit - made)
        return OptionChoice(action, int(arrays.option_ids[s, k]), m_rest)

    return choose


def load_kernel() -> None:
    """Load the Numba kernel's compiled code, once per process (from numba's on-disk cache after the first process's
    compile: about 0.3 s and 90 MiB of RSS, mostly LLVM's). A plan that needs no DP (keeping everything fits) calls
    this, so that the first later shape that does not fit (a longer sequence) pays none of it."""
    from .kernel import fill_tables

    if not fill_tables.signatures:  # (a two-stage chain: the array types every plan's tables have)
        option = OptionCosts(1.0, 1.0, kept_bytes=8, fwd_overhead_bytes=16, bwd_overhead_bytes=8)
        solve_chain(ChainCosts((8, 8, 8), (StageCosts(1.0, 8, (option,)),) * 2), 1024)


def _fill(arrays: ChainArrays, M: int, kernel: str):
    if kernel == "numba":
        from .kernel import fill_tables
    elif kernel == "reference":
        from .reference import fill_tables_reference as fill_tables
    else:
        raise ValueError(f"kernel must be 'numba' or 'reference', got {kernel!r}")
    return fill_tables(*arrays.kernel_args(M))


def _schedule(costs: ChainCosts, choose: Chooser, M: int, budget: int, unit: int) -> ChainSchedule:
    ops: list = []
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20 * costs.length + 1000))
    try:
        peak, total = _Expander(costs).expand(choose, 0, 0, costs.length - 1, M, ops)
    finally:
        sys.setrecursionlimit(limit)
    return ChainSchedule(tuple(ops), costs.length, total, int(peak), int(budget), int(unit))


def min_peak_schedule(costs: ChainCosts) -> ChainSchedule:
    """The schedule of least peak bytes (ties broken by time), exact, no discretisation."""
    L = costs.length
    ex = _Expander(costs)
    best: dict[tuple[int, int, int], tuple[int, float, Choice]] = {}
    for length in range(L):
        for s in range(L - length):
            t = s + length
            for v in (0, 1):
                cands = []
                for k, op in enumerate(costs.stages[s].options):
                    sub_peak, sub_time = (0, 0.0) if s == t else best[(int(op.pins_output), s + 1, t)][:2]
                    peak = ex.option_terms(v, s, t, k, sub_peak)
                    cands.append((peak, op.fwd_time + op.bwd_time + sub_time, OptionChoice(Action.OPTION, k)))
                    for with_input in ex.kept_offloads(v, s, t, k):
                        peak = ex.option_terms(v, s, t, k, sub_peak, True, with_input)
                        time = op.fwd_time + op.bwd_time + sub_time + ex.kept_transfer_times(s, k, with_input)
                        action = Action.OFFLOADED_OPTION_AND_INPUT if with_input else Action.OFFLOADED_OPTION
                        cands.append((peak, time, OptionChoice(action, k)))
                fwd_time = costs.stages[s].nograd_fwd_time
                for sp in range(s + 1, t + 1):
                    right, left = best[(0, sp, t)], best[(v, s, sp - 1)]
                    peak = ex.split_terms(s, t, sp, right[0], left[0])
                    cands.append((peak, fwd_time + right[1] + left[1], SplitChoice(False, sp)))
                    if ex.can_offload(v, s):
                        peak = ex.split_terms(s, t, sp, right[0], left[0], offloaded=True)
                        time = fwd_time + ex.offload_times(s, fwd_time) + right[1] + left[1]
                        cands.append((peak, time, SplitChoice(True, sp)))
                    fwd_time += costs.stages[sp].nograd_fwd_time
                best[(v, s, t)] = min(cands, key=lambda c: (c[0], c[1]))
    peak = best[(0, 0, L - 1)][0]
    return _schedule(costs, lambda v, s, t, m: best[(v, s, t)][2], 0, peak, 1)


def solve_chain(
    costs: ChainCosts,
    budget_bytes: int,
    *,
    slots: int = DEFAULT_SLOTS,
    kernel: str = "numba",
    prune: bool = True,
) -> ChainSolution:
    """Fastest schedule whose peak is at most ``budget_bytes``.

    Memory is discretised into ``slots`` units of ceil(budget / slots) bytes. Raises
    InfeasibleBudgetError (with the exact smallest feasible budget) when no schedule
    fits. Where sizes rounded up to slots make every schedule look too big at M (a budget
    at or near the minimum), the schedules of the tables filled beyond M whose exact peak
    fits are taken; where none fits, retries with 4x finer slots and then falls back to
    the min-peak schedule.
    """
    budget_bytes = int(budget_bytes)
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    started = time.perf_counter()
    n_options = sum(len(st.options) for st in costs.stages)
    L = costs.length
    for attempt_slots in (slots, 4 * slots):
        unit = max(1, ceil_div(budget_bytes, attempt_slots))
        M = budget_bytes // unit
        # Sizes round UP to units, so a schedule whose exact peak is within a few units of the
        # budget looks infeasible at M (keeping everything at exactly plain autograd's peak, say).
        # Fill the tables a little beyond M and take the largest memory whose schedule's exact
        # peak (replayed by the expander) still fits: never slower than the schedule at M.
        M_fill = M + 2 * L + 2
        arrays = discretize(costs, unit, prune=prune)
        C, D = _fill(arrays, M_fill, kernel)
        choose = _dp_chooser(arrays, D, M_fill, L)
        for m in dict.fromkeys((M_fill, M + (M_fill - M) // 2, M + (M_fill - M) // 4, M)):
            if not math.isfinite(C[0, 0, L - 1, m]):
                continue
            schedule = _schedule(costs, choose, m, budget_bytes, unit)
            if schedule.predicted_peak_bytes <= budget_bytes:
                return ChainSolution(
                    schedule, time.perf_counter() - started, attempt_slots, n_options, int(arrays.nk.sum()), False
                )
            if m == M:
                raise AssertionError("DP schedule exceeds its budget: memory rounding is broken")
        fallback = min_peak_schedule(costs)
        if fallback.predicted_peak_bytes > budget_bytes:
            raise InfeasibleBudgetError(budget_bytes, fallback.predicted_peak_bytes)
        log.info("budget %d B: no plan at %d slots, refining", budget_bytes, attempt_slots)
    log.info("budget %d B is within memory rounding of the minimum; using the min-peak schedule", budget_bytes)
    schedule = ChainSchedule(
        fallback.ops, costs.length, fallback.predicted_time, fallback.predicted_peak_bytes, budget_bytes, 1
    )
    return ChainSolution(schedule, time.perf_counter() - started, 4 * slots, n_options, n_options, True)
