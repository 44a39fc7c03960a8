"""Numba kernel of the chain DP: fills the cost and decision tables.

Recurrence (Rotor, Beaumont et al. 2019, Sec. 4, extended to per-stage options as in
HiRemate, Zhao et al. 2023). C[v, s, t, m] is the least time to process stages s..t
forward and backward, starting with x_s in memory (and, when t < L-1, the gradient of
x_{t+1}), using at most m slots above the memory in use at the start. When t = L-1 the
subproblem also runs the Loss, which adds the output gradient (GL slots); from then on
the caller holds HL slots of x_L, and all of it stays while option k pins it. v = 1
when x_s is also held by the caller's tape (the previous stage's option pins its
output), so that F_all(s) cannot free it; v = 0 otherwise.

  option k of stage s, s == t:     F_all(s,k) [Loss] B(s)
  option k of stage s, s <  t:     F_all(s,k)  C[PIN_OUT, s+1, t, m - KEPT - A[s+1] + c]  B(s)
  checkpoint at s' in (s, t]:      F_ck(s) F_none(s+1..s'-1)  C[0, s', t, m - A[s']]
                                   C[v, s, s'-1, m - A[s'] - resid]
c = A_floor[s] is the credit of freeing x_s after F_all(s) when v = 0, s > 0 and the
option does not pin its input (else 0). resid is what a right part leaves beyond its
input gradient: HL + GL (held output and its gradient) when t = L-1, else -A_floor[t+1]
(the consumed gradient of x_{t+1}). For s = t = L-1 the backward peak is
KEPT - c + GL + max(A[L], OB + max(HL, PIN_OUT A[L])): at the Loss x_L and its gradient
coexist; during B(s) x_L is there if held or pinned. Memory left to a subproblem is capped at M, exact for
every state reachable from the top.

Residents (values carried beside the activation, hierremat.plans.costs.ResidentCosts) add three
terms, in slots: NV[s], the values F_all(s) makes in the first sweep (t = L-1), held
until B(s) (taken from the rest's memory and counted at B(s)); DL[b, t], what residents
hold once B(b..L-1) have run, above the subproblem's start (added to the backward peak
after a sub-chain starting at b, and taken from a left part's memory after the right part
(b, t)); FV[s, s'] (first sweep only), the values F_ck(s) F_none(s+1..s'-1) make, held
through the split. A subproblem with t = L-1 is always in the first sweep (no stage of it
has run yet) and one with t < L-1 never is (every stage of it has run once).

Parameter gradients the step allocates (ChainCosts.step_grad_bytes: ``.grad`` None at the
step's start) enter through the same terms: they are in OB[s, k] (B(s) may hold them all
before it ends) and, held from B(s) to the end of the step, in DL, as a resident's gradient
sum made by B(s) and never consumed is.

Offloading (ChainCosts.tier), a restriction of Beaumont, Eyraud-Dubois and Shilova's
(NeurIPS 2021, "Efficient Combination of Rematerialization and Offloading for Training DNNs") in
which a transfer overlaps only the forward sweep: at a split of (s, t) with v = 0, x_s may be
copied out while F_ck(s) F_none(s+1..s'-1) run (OUT[s] seconds; what the sweep does not hide is a
stall), leave the device while the right part runs, which then has A_floor[s] slots more, and be
fetched back (IN[s] seconds, not overlapped) before the left part, which sees the memory of the
split without offloading: its m proves the fetch fits.

  checkpoint at s', x_s offloaded: F_ck(s) F_none(..) Offload(s) C[0, s', t, m - A[s'] + A_floor[s]]
                                   Fetch(s) C[v, s, s'-1, m - A[s'] - resid]

An option whose kept values are explicit (KOFF[s,k] finite) may also send them to the second tier after
F_all(s,k), the copy waited for, and fetch them back before B(s) (a checkpointed activation of Beaumont et
al.'s formulation, here the values inside a block: POET's paging, Patil et al., ICML 2022), and x_s with
them where the option pins it and nothing else holds it (v = 0, s > 0), which is then credited as if freed
(c' = A_floor[s]) and adds its transfers OUT[s] + IN[s]. The rest runs without them; every peak term of
option k is unchanged (B(s) sees them all back):

  option k of stage s, s < t, kept values offloaded:
                                   F_all(s,k) Offload_kept(s) C[PIN_OUT, s+1, t, m - A[s+1] + c]
                                   Fetch_kept(s) B(s)           (time TIME + KOFF)
  the same with x_s:               F_all(s,k) Offload_kept(s, x) C[PIN_OUT, s+1, t, m - A[s+1] + c']
                                   Fetch_kept(s) B(s)           (time TIME + KOFF + OUT[s] + IN[s])

Decision table D: -1 infeasible, k in [0, K) an option, K + s' a checkpoint split, K + L + s' the
split with x_s offloaded, K + 2L + k option k with its kept values offloaded, 2K + 2L + k with x_s too.
Loops run over m innermost so table reads are contiguous; candidates are still tried
per m in the reference's order (options, then splits by s'), so ties resolve the same.
The pure-Python reference in hierremat.dp.reference has the same signature; hierremat.dp.decisions decodes D.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def fill_tables(A, A_floor, OFN, UFN, nk, TIME, KEPT, OF, OB, PIN_OUT, PIN_IN, HL, GL, NV, DL, FV, OUT, IN, KOFF, M):  # pragma: no cover - compiled
    L = OFN.shape[0]
    K = OF.shape[1]
    C = np.full((2, L, L, M + 1), np.inf)
    D = np.full((2, L, L, M + 1), -1, dtype=np.int32)
    AL = A[L]
    for d in range(L):
        for s in range(L - d):
            t = s + d
            last = t == L - 1
            resid = HL + GL if last else -A_floor[t + 1]
            made = NV[s] if last else 0
            held = made + DL[s + 1, t]
            for v in range(2):
                best = C[v, s, t]
                choice = D[v, s, t]
                for k in range(nk[s]):
                    credit = 0
                    if v == 0 and PIN_IN[s, k] == 0 and s > 0:
                        credit = A_floor[s]
                    if s == t:
                        if last:
                            present = max(HL, PIN_OUT[s, k] * AL)
                            bpeak = KEPT[s, k] - credit + GL + max(AL, OB[s, k] + present) + held
                        else:
                            bpeak = KEPT[s, k] + OB[s, k] - credit + PIN_OUT[s, k] * A[s + 1] + held
                    else:
                        bpeak = KEPT[s, k] + (1 + PIN_OUT[s, k]) * A[s + 1] + OB[s, k] - credit + resid + held
                    lo = max(OF[s, k], bpeak, 0)
                    offload = s < t and KOFF[s, k] < np.inf
                    send = offload and v == 0 and s > 0 and PIN_IN[s, k] == 1  # x_s may go with them
                    for m in range(lo, M + 1):
                        if s == t:
                            cost = TIME[s, k]
                            if cost < best[m]:
                                best[m] = cost
                                choice[m] = k
                            continue
                        mr = m - KEPT[s, k] - A[s + 1] + credit - made
                        if mr >= 0:
                            sub = C[PIN_OUT[s, k], s + 1, t, min(mr, M)]
                            if sub < np.inf and TIME[s, k] + sub < best[m]:
                                best[m] = TIME[s, k] + sub
                                choice[m] = k
                        mo = m - A[s + 1] + credit - made  # the rest's memory with the kept values away
                        if offload and mo >= 0:
                            sub = C[PIN_OUT[s, k], s + 1, t, min(mo, M)]
                            if sub < np.inf and TIME[s, k] + KOFF[s, k] + sub < best[m]:
                                best[m] = TIME[s, k] + KOFF[s, k] + sub
                                choice[m] = K + 2 * L + k
                        mx = m - A[s + 1] + A_floor[s] - made  # ... and x_s with them
                        if send and mx >= 0:
                            sub = C[PIN_OUT[s, k], s + 1, t, min(mx, M)]
                            cost = TIME[s, k] + (KOFF[s, k] + (OUT[s] + IN[s])) + sub  # (the reference's order)
                            if sub < np.inf and cost < best[m]:
                                best[m] = cost
                                choice[m] = 2 * K + 2 * L + k
                if s < t:
                    fwd_peak = OFN[s]
                    fwd_time = UFN[s]
                    for sp in range(s + 1, t + 1):
                        if fwd_peak > M:
                            break
                        swept = FV[s, sp] if last else 0
                        offload = v == 0 and OUT[s] < np.inf
                        stall = max(OUT[s] - fwd_time, 0.0) if offload else 0.0
                        for m in range(max(fwd_peak, A[sp] + swept), M + 1):
                            mr = m - A[sp] - swept
                            ml = mr - resid - DL[sp, t]
                            if ml < 0:
                                continue
                            if ml > M:
                                ml = M
                            left = C[v, s, sp - 1, ml]
                            if left == np.inf:
                                continue
                            right = C[0, sp, t, mr]
                            if right < np.inf:
                                cost = fwd_time + right + left
                                if cost < best[m]:
                                    best[m] = cost
                                    choice[m] = K + sp
                            if offload:  # x_s away while the right part runs
                                mo = mr + A_floor[s]
                                if mo > M:
                                    mo = M
                                right = C[0, sp, t, mo]
                                if right < np.inf:
                                    cost = fwd_time + stall + right + IN[s] + left
                                    if cost < best[m]:
                                        best[m] = cost
                                        choice[m] = K + L + sp
                        if sp < t:
                            p = A[sp] + OFN[sp] + swept
                            if p > fwd_peak:
                                fwd_peak = p
                            fwd_time += UFN[sp]
    return C, D
