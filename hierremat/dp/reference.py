"""Pure-Python reference of the chain DP, written top-down from the case analysis.

Same signature and tables as ``hierremat.dp.kernel.fill_tables`` (see its docstring for
the recurrence); used to check the Numba kernel. O(L^3 M) in the interpreter: small
chains only.
"""

from __future__ import annotations

import math

import numpy as np


def fill_tables_reference(A, A_floor, OFN, UFN, nk, TIME, KEPT, OF, OB, PIN_OUT, PIN_IN, HL, GL, NV, DL, FV, OUT, IN, KOFF, M):
    chain = _ReferenceChain(A, A_floor, OFN, UFN, nk, TIME, KEPT, OF, OB, PIN_OUT, PIN_IN, HL, GL, NV, DL, FV, OUT,
                            IN, KOFF, M)
    chain.fill()
    return chain.C, chain.D


class _ReferenceChain:
    """The kernel's arrays (named as in ``fill_tables``) and its tables C (time) and D (decision), filled by length."""

    def __init__(self, A, A_floor, OFN, UFN, nk, TIME, KEPT, OF, OB, PIN_OUT, PIN_IN, HL, GL, NV, DL, FV, OUT, IN,
                 KOFF, M):
        self.A_floor, self.OFN, self.UFN, self.nk, self.TIME, self.KEPT = A_floor, OFN, UFN, nk, TIME, KEPT
        self.OF, self.OB, self.PIN_OUT, self.PIN_IN, self.HL, self.GL = OF, OB, PIN_OUT, PIN_IN, HL, GL
        self.NV, self.DL, self.FV, self.OUT, self.IN, self.KOFF, self.M = NV, DL, FV, OUT, IN, KOFF, M
        self.L, self.K = len(OFN), OF.shape[1]
        self.C = np.full((2, self.L, self.L, M + 1), np.inf)
        self.D = np.full((2, self.L, self.L, M + 1), -1, dtype=np.int32)
        self.A = [int(a) for a in A]

    def fill(self) -> None:
        L, K = self.L, self.K
        for length in range(L):
            for s in range(L - length):
                t = s + length
                for v in range(2):
                    for m in range(self.M + 1):
                        candidates = []
                        for k in range(self.nk[s]):
                            candidates += [(self.option_cost(v, s, t, m, k), k),
                                           (self.option_cost(v, s, t, m, k, True), K + 2 * L + k),
                                           (self.option_cost(v, s, t, m, k, True, True), 2 * K + 2 * L + k)]
                        for sp in range(s + 1, t + 1):
                            candidates += [(self.split_cost(v, s, t, m, sp), K + sp),
                                           (self.split_cost(v, s, t, m, sp, True), K + L + sp)]
                        for cost, c in candidates:
                            if cost < self.C[v, s, t, m]:
                                self.C[v, s, t, m], self.D[v, s, t, m] = cost, c

    def resident_after_right_part(self, t: int) -> int:
        """Slots a right part leaves behind beyond its input gradient."""
        return self.HL + self.GL if t == self.L - 1 else -int(self.A_floor[t + 1])

    def input_credit(self, v: int, s: int, k: int) -> int:
        """Slots freed when F_all(s, k) drops x_s (nobody else holds it)."""
        return int(self.A_floor[s]) if v == 0 and s > 0 and not self.PIN_IN[s, k] else 0

    def swept_residents(self, s: int, sp: int, t: int) -> int:
        """Slots of the residents the first sweep's F_ck(s) F_none(s+1..sp-1) make (held through the split)."""
        return int(self.FV[s, sp]) if t == self.L - 1 else 0

    def option_cost(self, v: int, s: int, t: int, m: int, k: int, kept_offloaded: bool = False,
                    with_input: bool = False) -> float:
        A, C, L, M, KEPT, OB, PIN_OUT = self.A, self.C, self.L, self.M, self.KEPT, self.OB, self.PIN_OUT
        if kept_offloaded and (s == t or self.KOFF[s, k] == math.inf):
            return math.inf
        if with_input and not (v == 0 and s > 0 and self.PIN_IN[s, k]):
            return math.inf
        if self.OF[s, k] > m:
            return math.inf
        credit = self.input_credit(v, s, k)
        # residents: the values F_all(s) makes in the first sweep, and what the sub-chain's backward left
        made = int(self.NV[s]) if t == L - 1 else 0
        held = made + int(self.DL[s + 1, t])
        if s == t and t == L - 1:
            # the Loss (x_L and its gradient), then B(s) with x_L if held or pinned
            present = max(self.HL, PIN_OUT[s, k] * A[L])
            fits = KEPT[s, k] - credit + self.GL + max(A[L], OB[s, k] + present) + held <= m
            return self.TIME[s, k] if fits else math.inf
        if s == t:
            fits = KEPT[s, k] + OB[s, k] - credit + PIN_OUT[s, k] * A[s + 1] + held <= m
            return self.TIME[s, k] if fits else math.inf
        backward_peak = (KEPT[s, k] + (1 + PIN_OUT[s, k]) * A[s + 1] + OB[s, k] - credit
                         + self.resident_after_right_part(t) + held)
        if backward_peak > m:
            return math.inf
        if not kept_offloaded:
            rest = min(M, m - KEPT[s, k] - A[s + 1] + credit - made)
            return self.TIME[s, k] + C[PIN_OUT[s, k], s + 1, t, rest] if rest >= 0 else math.inf
        # the kept values offloaded, with_input: and x_s, which the option pins and nobody else holds (v = 0,
        # s > 0): the rest runs without them; they are back for B(s)
        transfers = self.KOFF[s, k] + (self.OUT[s] + self.IN[s] if with_input else 0.0)
        rest = min(M, m - A[s + 1] + (int(self.A_floor[s]) if with_input else credit) - made)
        return self.TIME[s, k] + transfers + C[PIN_OUT[s, k], s + 1, t, rest] if rest >= 0 else math.inf

    def split_cost(self, v: int, s: int, t: int, m: int, sp: int, offload: bool = False) -> float:
        A, C, M, OFN = self.A, self.C, self.M, self.OFN
        forward_peak = max([OFN[s]] + [A[j] + OFN[j] + self.swept_residents(s, j, t) for j in range(s + 1, sp)])
        right_mem = m - A[sp] - self.swept_residents(s, sp, t)
        if forward_peak > m or right_mem < 0:
            return math.inf
        left_mem = min(M, right_mem - self.resident_after_right_part(t) - int(self.DL[sp, t]))
        if left_mem < 0:
            return math.inf
        forward_time = self.UFN[s]
        for j in range(s + 1, sp):
            forward_time += self.UFN[j]
        if not offload:
            return forward_time + C[0, sp, t, right_mem] + C[v, s, sp - 1, left_mem]
        if v != 0 or self.OUT[s] == math.inf:
            return math.inf
        # x_s copied out beside the sweep (the rest a stall), away through the right part, fetched back after
        right = C[0, sp, t, min(M, right_mem + int(self.A_floor[s]))]
        return forward_time + max(self.OUT[s] - forward_time, 0.0) + right + self.IN[s] + C[v, s, sp - 1, left_mem]
