"""Chain costs as the DP's integer arrays: memory in slots, dominated options pruned.

Every size the DP *charges* is rounded up to whole slots and every size it *credits*
(a freed gradient, whose memory becomes available again) is rounded down, so a
schedule the DP accepts never exceeds the budget in exact bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..plans.costs import ChainCosts


def ceil_div(n: int, unit: int) -> int:
    return -(-int(n) // unit)


@dataclass(frozen=True)
class ChainArrays:
    """The DP's input arrays (see hierremat.dp.kernel for their use).

    A[i]      slots charged for x_i (and its gradient), i = 0..L
    A_floor[i] slots credited when the gradient of x_i is freed
    OFN[i], UFN[i]  no-grad forward overhead (slots) and time (s) of stage i
    nk[i]     number of options of stage i (after pruning)
    TIME[i,k], KEPT[i,k], OF[i,k], OB[i,k], PIN_OUT[i,k], PIN_IN[i,k]  option k of
              stage i: forward + backward time (s), kept slots, forward and backward
              overhead slots, 1 if the option pins the stage output / input.
    option_ids[i, k]  index of that option in costs.stages[i].options
    HL        slots of x_L held by the caller through the backward
    GL        slots of the gradient of x_L
    NV[i]     slots of the residents stage i makes (hierremat.plans.costs.ResidentCosts): made by
              F_all(i) in the first sweep (t = L-1), held until B(i)
    DL[b, t]  slots the residents and the parameter gradients the step allocates
              (ChainCosts.held_after_backward) hold once the backward of stages b..L-1 has run, above
              what they held when subproblem (b, t) started: just before the first
              forward of stage b when t = L-1 (the first sweep), just after B(t+1) else
    FV[s, j]  slots of the residents stages s..j-1 make in the first sweep (j >= s)
    OUT[i], IN[i]  seconds to offload x_i to the second tier and to fetch it back (ChainCosts.tier;
              inf where the chain has none, or for x_0 and x_L, which are never offloaded)
    KOFF[i,k]  seconds to offload what option k of stage i keeps and to fetch it back, one way then the
              other (inf where the chain has no tier or the option's kept values cannot be offloaded:
              OptionCosts.kept_offloadable)
    """

    A: np.ndarray
    A_floor: np.ndarray
    OFN: np.ndarray
    UFN: np.ndarray
    nk: np.ndarray
    TIME: np.ndarray
    KEPT: np.ndarray
    OF: np.ndarray
    OB: np.ndarray
    PIN_OUT: np.ndarray
    PIN_IN: np.ndarray
    option_ids: np.ndarray
    HL: int
    GL: int
    NV: np.ndarray
    DL: np.ndarray
    FV: np.ndarray
    unit: int
    OUT: np.ndarray
    IN: np.ndarray
    KOFF: np.ndarray

    def kernel_args(self, M: int) -> tuple:
        """The arguments of ``fill_tables`` (kernel and reference) for M slots of budget."""
        return (
            self.A, self.A_floor, self.OFN, self.UFN, self.nk, self.TIME, self.KEPT, self.OF, self.OB,
            self.PIN_OUT, self.PIN_IN, np.int64(self.HL), np.int64(self.GL), self.NV, self.DL, self.FV, self.OUT,
            self.IN, self.KOFF, np.int64(M),
        )


def _dominates(p: tuple, q: tuple) -> bool:
    """p is no worse than q in every term the DP reads."""
    return all(x <= y for x, y in zip(p, q))


def discretize(costs: ChainCosts, unit: int, prune: bool = True) -> ChainArrays:
    """Round costs to slots of ``unit`` bytes and drop options another one dominates.

    An option is dropped when another is no worse in time, in whether it pins its output
    (which selects the sub-table) and in every memory term the recurrences use (forward
    overhead; kept, kept + pinned output, backward overhead and backward overhead +
    pinned output, each with and without the input credit), compared in slots, and in the time with its
    kept values offloaded (KOFF, with x_i's transfers where the option pins it; inf where they cannot be): so
    pruning never changes the DP's optimum.
    """
    if unit < 1:
        raise ValueError("memory unit must be >= 1 byte")
    L = costs.length
    A = np.array([ceil_div(a, unit) for a in costs.activation_bytes], dtype=np.int64)
    A_floor = np.array([a // unit for a in costs.activation_bytes], dtype=np.int64)
    OFN = np.array([ceil_div(st.nograd_fwd_overhead_bytes, unit) for st in costs.stages], dtype=np.int64)
    UFN = np.array([st.nograd_fwd_time for st in costs.stages], dtype=np.float64)

    OUT, IN = transfer_seconds(costs)
    rows_per_stage = []
    for i, st in enumerate(costs.stages):
        rows = []
        for k, op in enumerate(st.options):
            kept = ceil_div(op.kept_bytes, unit)
            pin = int(bool(op.pins_output))
            pin_in = int(bool(op.pins_input))
            ob = ceil_div(costs.bwd_overhead(i, op), unit)
            of = ceil_div(op.fwd_overhead_bytes, unit)
            credit = 0 if pin_in or i == 0 else int(A_floor[i])
            terms = (kept, kept + pin * A[i + 1], ob, ob + pin * A[i + 1])
            koff = _kept_transfer_seconds(costs, op)
            # (an option that pins x_i may send it with its kept values, for the input credit)
            sent = OUT[i] + IN[i] if pin_in and 0 < i else 0.0
            time = op.fwd_time + op.bwd_time
            key = (time, time + koff, time + koff + sent, of, pin) + terms + tuple(x - credit for x in terms)
            rows.append((k, key, kept, of, ob, pin, pin_in, koff))
        if prune:
            survivors = []
            for r in rows:
                beaten = any(
                    _dominates(o[1], r[1]) and (o[1] != r[1] or o[0] < r[0]) for o in rows if o is not r
                )
                if not beaten:
                    survivors.append(r)
            rows = survivors
        rows_per_stage.append(rows)

    K = max(len(rows) for rows in rows_per_stage)
    shape = (L, K)
    TIME = np.zeros(shape, dtype=np.float64)
    KEPT = np.zeros(shape, dtype=np.int64)
    OF = np.zeros(shape, dtype=np.int64)
    OB = np.zeros(shape, dtype=np.int64)
    PIN_OUT = np.zeros(shape, dtype=np.int64)
    PIN_IN = np.zeros(shape, dtype=np.int64)
    KOFF = np.full(shape, np.inf)
    ids = np.full(shape, -1, dtype=np.int64)
    nk = np.zeros(L, dtype=np.int64)
    for i, rows in enumerate(rows_per_stage):
        nk[i] = len(rows)
        for j, (k, key, kept, of, ob, pin, pin_in, koff) in enumerate(rows):
            TIME[i, j] = key[0]
            KEPT[i, j], OF[i, j], OB[i, j], PIN_OUT[i, j], PIN_IN[i, j] = kept, of, ob, pin, pin_in
            KOFF[i, j] = koff
            ids[i, j] = k
    HL = ceil_div(costs.held_output, unit)
    GL = ceil_div(costs.output_grad, unit)
    NV, DL, FV = _resident_slots(costs, unit)
    return ChainArrays(A, A_floor, OFN, UFN, nk, TIME, KEPT, OF, OB, PIN_OUT, PIN_IN, ids, HL, GL, NV, DL, FV, unit,
                       OUT, IN, KOFF)


def _kept_transfer_seconds(costs: ChainCosts, option) -> float:
    """KOFF of ChainArrays for one option: seconds its kept values take out and back (inf: not offloadable)."""
    if costs.tier is None or not option.kept_offloadable:
        return float("inf")
    return costs.tier.round_trip_seconds(option.kept_bytes)


def transfer_seconds(costs: ChainCosts) -> tuple[np.ndarray, np.ndarray]:
    """(OUT, IN) of ChainArrays: seconds to offload each x_i and to fetch it back."""
    L = costs.length
    out, back = np.full(L + 1, np.inf), np.full(L + 1, np.inf)
    if costs.tier is not None:
        for i in range(1, L):
            out[i] = costs.tier.offload_seconds(costs.activation_bytes[i])
            back[i] = costs.tier.fetch_seconds(costs.activation_bytes[i])
    return out, back


def resident_terms(costs: ChainCosts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(NV, DL, FV) of ChainArrays in bytes (see there); all zero for a chain without residents
    whose step allocates no parameter gradient."""
    L = costs.length
    made = np.array([costs.residents_made_before(j) for j in range(L + 1)], dtype=np.int64)
    after = np.array([costs.held_after_backward(b) for b in range(L + 1)], dtype=np.int64)
    NV = np.array([costs.resident_values_of(i) for i in range(L)], dtype=np.int64)
    start = np.broadcast_to(after[1:], (L + 1, L)).copy()  # DL[b, t]: the start of (b, t) is after B(t+1) ...
    start[:, L - 1] = made  # ... or, in the first sweep, before the first forward of b
    DL = after[:, None] - start
    FV = made[None, :] - made[:L, None]
    return NV, DL, FV


def _resident_slots(costs: ChainCosts, unit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """resident_terms in slots, each rounded up (a negative one, memory returned, towards zero)."""
    return tuple(-(-x // unit) for x in resident_terms(costs))
