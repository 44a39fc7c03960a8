"""The per-block rematerialization ILP: graph compaction, the 0/1 model, decoding.

Never imports torch (pure Python + numpy/scipy), like ``hierremat.dp``.

What is decided
---------------
A block option (DESIGN.md, "The block model") says which forward results are kept at
the end of the forward, which are recomputed during the backward and when, and when
every value is freed. The forward runs once, in order; backward nodes run exactly once,
in order. So instead of Checkmate's full grid (Jain et al., "Checkmate: breaking the
memory wall with optimal tensor rematerialization", MLSys 2020: one stage per node,
R/S/FREE/U over all nodes and stages) we use the much smaller *backward-staged* form of
Rockmate/HiRemate (Zhao et al., "Rockmate", ICML 2023; "HiRemate", 2023): stages are
the backward nodes that read forward values ("consumer" nodes c_0 < c_1 < ...), and
recomputation variables exist only for forward groups that some stage may need.

Compaction (before the ILP)
---------------------------
* Views are free and belong to their base (Checkmate and Rockmate treat aliases as
  the base tensor): a forward view joins its root's *group*; the group is computed as
  base, then its views, and freed as a whole. An in-place result (``GraphNode.in_place``,
  hierremat.blocks.variants.in_place) is such a member too, though it reads other values: they
  become the group's inputs. A view of the block input x joins x's
  group (x is never recomputed). A view that reads values outside its alias chain is
  treated as a copy the size of its root (conservative) and logged.
* Backward views keep their place in the backward (they run once), cost 0 bytes, and
  their consumers read the view's storage root. A backward view of a *forward* group
  holds that group's storage, so the group is forced to stay (A = 1, no recompute) in
  every stage after the view up to the view's last consumer.
* Chain fusion (exact): a forward group j that is not x, not the output, not random,
  whose only consumer (forward or backward) is the group l right after it, with
  bytes(j) >= bytes(l), is fused into l (compute j, compute l, free j). Keeping j is
  then dominated by keeping l (fewer bytes, no recompute, no need for l's other
  inputs), and fusing frees j right after l inside a recomputation, so the compacted
  family contains a schedule at least as good as every schedule it removes.

Schedule family (what the ILP represents; the test's exhaustive search enumerates it)
----------------------------------------------------------------------------------
Forward phase: every group in order; a group is freed right after its last forward
reader (or right after itself if it has none) unless it is kept (S_g = 1). x is held by
the caller; the output y is held by the chain from its computation to the end.
*Deferred* groups are the exception: a group that no forward group reads, that some
backward stage may need, and that is neither y nor random (a ReLU's packed mask,
hierremat.blocks.variants.relu_masks) is computed in the forward only if it is kept. Unkept,
computing it there would be wasted (it would be freed at once and recomputed where it is
needed), so its forward time and its forward peak row are paid only with S_g = 1. The
values it reads are still freed at its place in the order, computed or not.

Backward phase, stage k (consumer node c_k): first recompute the groups with
R[k, g] = 1, in topological order, then run c_k. Values present in stage k are those
present at its start (A[k, g], with A[0, g] = S_g) or recomputed in it; they stay until
c_k has run ("lazy within a stage", like MONeT's per-backward-operator recomputation
rows, Shah et al., "Memory optimization for deep networks", ICLR 2021, where the
recomputed tensors of an operator's backward are counted together), then every one not
carried to stage k+1 (A[k+1, g] = 0) is freed. Carried values stay through the
non-consumer backward nodes in between. Backward values are freed right after their
last reader; dx and the residents' gradient sums (held_grad_names) are never freed; dy stays for the whole backward (the chain DP frees it
at the end of B, see hierremat.plans.simulate).

Persistent values (the chain DP's pins): x can only be *pinned* (pins_input: held
until the end of B; it is never recomputed, and without the pin it is unavailable in
the backward). The output y can be pinned (pins_output: held until the end of B) or,
unpinned, recomputed and carried like any group (A[0, y] = 0: the chain may free y).
Random groups (dropout) are never recomputed: they must be kept or carried.

Variables (all binary): PX (pin x), PY (pin y); R[k, g] for g in cone_k (non-random
ancestors of the stage's reads, not expanded through random groups or x: a group is
only recomputable where it is needed); A[k, g] (present at the start of stage k) only
at g's *key* stages (those whose need-closure holds g). Between two keys a value is
either carried all the way or freed right after the earlier one (carrying it part-way
costs memory and saves nothing, so this loses no optimum), hence the presence at a
pass-through stage is the next key's variable, and S[g] (kept at the end of the
forward) is the first key's. Three continuous auxiliaries carry the budgets as
*bounds*, so one matrix serves the whole budget sweep and every objective: kv
(retained bytes), pv (peak bytes), tv (recomputation time).

Constraints:
* reads: for each forward group g read by c_k, avail(k, g) >= 1, where avail is
  A + R (+ PY for y; PX for x);
* dependencies: R[k, g] <= avail(k, h) for every input h of g (Checkmate's R/S rule
  restricted to the stage; inputs recomputed earlier in the same stage count);
* carry: A[k+1, g] <= A[k, g] + R[k, g] (Checkmate's S_{t+1} <= S_t + R_t);
  no double presence: A + R (+ PY) <= 1;
* kept budget: sum_g S_g b_g + PX b_x + PY b_y <= kv (retained bytes, pins included);
* peak rows, one per forward group, per backward node and per possible recomputation
  (k, j), each an exact closed form of the memory at that moment (MONeT-style rows
  instead of Checkmate's U/FREE variables):
    forward j:  x + live non-optional values + sum_{g<j, dead by j} S_g b_g + peak_j
                (S_j peak_j for a deferred j)
    backward t: dy + live backward values + b_t + ws_t + PX b_x + PY b_y
                + sum_g (A[k,g] + R[k,g]) b_g   (t = c_k)  or  sum_g A[k,g] b_g (before c_k)
    recompute (k, j): dy + live backward values before c_k + PX b_x + PY b_y
                + sum_{g<j} (A+R)[k,g] b_g + sum_{g>j} A[k,g] b_g + A[k,j] b_j
                + R[k,j] peak_j
  where peak_j is the group's peak above what is in memory before it (its result plus
  workspace, and its internal transients when fused). A row (k, j) with R[k, j] = 0 is
  below row c_k, so the max over rows is exactly the peak: pv >= every row. Rows that
  can never bind are left out: (k, j) unless j's transient (peak_j - b_j) exceeds what
  c_k adds, and all but the largest non-consumer row between two stages (same terms).
Objective: minimise tv = sum R[k,g] time_g + sum_{g deferred} S_g time_g (the other forward
and backward times are constants).

Budget parametrisation: kv <= K (bytes retained at the end of the forward, pins
included) and pv <= P, one bound on the absolute peak of both phases, counting x
during the forward and dy during the backward. The DP's overheads are derived from the
solution: fwd overhead = forward peak - bytes(x); bwd overhead = backward peak - (PX x +
kept + PY y + dy), at least bytes(dx).

Size and speed (synthetic GPT-2-like block, tests/test_ilp.py: 123 forward / 146
backward ATen nodes -> 94 groups, 123 stages): 3714 variables, 7935 constraints, 34k
nonzeros. With HiGHS: fastest-schedule and least-kept solves take < 1 s, budgets well
inside the feasible region 0.3-6 s, budgets within ~10% of the least feasible peak
10-25 s (the min-max is hard to prove), so ``solve_menu`` caps each solve.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from scipy import sparse

from ..plans.block_graph import BlockGraph
from ..plans.block_options import COMPUTE, FREE

log = logging.getLogger("hierremat.ilp")



# ----------------------------------------------------------------------------- compaction


@dataclass(frozen=True)
class FwdGroup:
    """A compacted forward value: a storage root with its views, possibly fused chains.

    steps: the ("compute" | "free", original node name) ops that (re)compute the group,
        leaving exactly its members' names of the final storage live.
    names: the names alive after ``steps`` (freed together when the group is freed).
    peak_extra: peak above the memory before it while running ``steps`` (>= out_bytes).
    """

    index: int
    name: str
    steps: tuple
    names: tuple
    inputs: tuple
    out_bytes: int
    time: float
    peak_extra: int
    random: bool
    is_input: bool = False


@dataclass(frozen=True)
class BwdNode:
    """A backward node after alias resolution.

    fwd_reads: forward groups it reads (0 is x). bwd_reads: backward storage roots it reads.
    root: index of its storage root (itself unless it is a view). fwd_root: forward group
    whose storage it aliases (-1 if none).
    """

    index: int
    name: str
    out_bytes: int
    time: float
    workspace_bytes: int
    fwd_reads: tuple
    bwd_reads: tuple
    root: int
    fwd_root: int = -1


@dataclass
class CompactGraph:
    graph: BlockGraph
    groups: list  # FwdGroup, index 0 is x
    bwd: list  # BwdNode
    out_group: int
    dy_bytes: int
    dx_root: int  # -1 if none
    fwd_last_use: list  # per group: index of last forward group reading it (itself if none)
    bwd_last_use: list  # per backward storage root: position of last reader (len(bwd) = never freed)
    bwd_root_names: dict  # backward root -> names sharing its storage
    stages: list  # backward positions of consumer nodes
    fwd_view_holds: list  # (group, first stage index after the view, last stage index) forced carries
    bwd_name_free: dict  # backward position -> names freed right after it

    @property
    def n(self) -> int:
        return len(self.groups)


def compact(graph: BlockGraph) -> CompactGraph:
    fwd = graph.forward_nodes
    bwd_nodes = graph.backward_nodes
    x, dy = graph.input_name, graph.output_grad_name
    # forward storage roots
    root: dict[str, str] = {x: x}
    as_copy: set[str] = set()
    for n in fwd:
        if n.alias_of:
            if n.alias_of not in root:
                raise ValueError(f"forward view {n.name!r} aliases {n.alias_of!r}, which is not a forward value")
            r = root[n.alias_of]
            if n.in_place or all(root.get(i) == r for i in n.inputs):
                root[n.name] = r
                continue
            log.warning("view %s reads values outside its alias chain; modelled as a copy of its root", n.name)
            as_copy.add(n.name)
        root[n.name] = n.name
    order = {x: -1, **{n.name: i for i, n in enumerate(fwd)}}
    roots = sorted({root[n.name] for n in fwd} | {x}, key=lambda r: order[r])
    members: dict[str, list] = {r: [] for r in roots}
    for n in fwd:
        members[root[n.name]].append(n)
    groups_raw = []  # dicts, fused below
    for r in roots:
        ms = members[r]
        out = graph.input_bytes if r == x else 0
        running, peak = 0, 0
        for m in ms:
            b = m.out_bytes
            if m.name in as_copy:
                b = max(b, fwd[order[root[m.alias_of]]].out_bytes if root[m.alias_of] != x else graph.input_bytes)
            peak = max(peak, running + b + m.workspace_bytes)
            running += b
        out += running
        groups_raw.append(
            dict(
                name=r,
                steps=[(COMPUTE, m.name) for m in ms],
                names=[m.name for m in ms] + ([x] if r == x else []),
                inputs={root[i] for m in ms for i in m.inputs if i in root} - {r},
                out_bytes=out,
                time=sum(m.time for m in ms),
                peak_extra=max(peak, running) if r != x else peak,
                random=any(m.random for m in ms),
                is_input=r == x,
            )
        )
    out_root = root[graph.output_name]
    if out_root == x:
        raise ValueError("the block output aliases its input; such a block has nothing to plan")

    # backward alias resolution: a name's storage root among forward roots / x / dy / backward
    broot: dict[str, tuple] = {dy: ("dy", dy)}
    for r, ms in members.items():
        for m in ms:
            broot[m.name] = ("f", r)
    broot[x] = ("f", x)
    for n in bwd_nodes:
        # a view (no bytes of its own) shares its base's storage; an element of a multi-output
        # op (attached to the op through alias_of, with bytes) is a storage of its own
        is_view = n.alias_of and n.out_bytes == 0 and n.alias_of in broot
        if is_view and (n.in_place or all(broot.get(i) == broot[n.alias_of] for i in n.inputs if i in broot)):
            broot[n.name] = broot[n.alias_of]
        else:
            broot[n.name] = ("b", n.name)

    # consumers of each forward root (by root name), for fusion
    def consumers(groups):
        gname_of = {}
        for g in groups:
            for nm in g["names"]:
                gname_of[nm] = g["name"]
            for _, nm in g["steps"]:
                gname_of[nm] = g["name"]
        cons = {g["name"]: set() for g in groups}
        for g in groups:
            for i in g["inputs"]:
                cons[gname_of.get(i, i)].add(g["name"])
        for n in bwd_nodes:
            for i in n.inputs:
                k = broot.get(i)
                if k and k[0] == "f":
                    cons[gname_of.get(k[1], k[1])].add(("bwd", n.name))
        return cons, gname_of

    changed = True
    while changed:
        changed = False
        cons, gname_of = consumers(groups_raw)
        for j in range(1, len(groups_raw) - 1):
            gj, gl = groups_raw[j], groups_raw[j + 1]
            if gj["random"] or gj["name"] == out_root or cons[gj["name"]] != {gl["name"]}:
                continue
            if gj["out_bytes"] < gl["out_bytes"]:
                continue
            fused = dict(
                name=gl["name"],
                steps=gj["steps"] + gl["steps"] + [(FREE, nm) for nm in gj["names"]],
                names=gl["names"],
                inputs=(gj["inputs"] | gl["inputs"]) - {gj["name"]},
                out_bytes=gl["out_bytes"],
                time=gj["time"] + gl["time"],
                peak_extra=max(gj["peak_extra"], gj["out_bytes"] + gl["peak_extra"]),
                random=gl["random"],
                is_input=False,
            )
            # members of j now resolve to the fused group (its root name is l's)
            for _, nm in gj["steps"]:
                if broot.get(nm, ("", ""))[0] == "f":
                    broot[nm] = ("f", gl["name"])
            groups_raw[j : j + 2] = [fused]
            # any group reading j now reads l
            for g in groups_raw:
                if gj["name"] in g["inputs"]:
                    g["inputs"] = (g["inputs"] - {gj["name"]}) | {gl["name"]}
            changed = True
            break

    gindex = {g["name"]: i for i, g in enumerate(groups_raw)}
    name_to_group = {}
    for i, g in enumerate(groups_raw):
        for _, nm in g["steps"]:
            name_to_group[nm] = i
        for nm in g["names"]:
            name_to_group[nm] = i

    def group_of_root(r):
        return gindex[r] if r in gindex else name_to_group[r]

    groups = []
    for i, g in enumerate(groups_raw):
        inputs = tuple(sorted({group_of_root(r) for r in g["inputs"]} - {i}))
        if any(h > i for h in inputs):
            raise ValueError(f"group {g['name']} reads a later group; graph order is not topological")
        groups.append(
            FwdGroup(
                index=i,
                name=g["name"],
                steps=tuple(g["steps"]),
                names=tuple(g["names"]),
                inputs=inputs,
                out_bytes=int(g["out_bytes"]),
                time=float(g["time"]),
                peak_extra=int(g["peak_extra"]),
                random=bool(g["random"]),
                is_input=bool(g["is_input"]),
            )
        )
    out_group = name_to_group[graph.output_name]
    fwd_last_use = list(range(len(groups)))
    for g in groups:
        for h in g.inputs:
            fwd_last_use[h] = max(fwd_last_use[h], g.index)

    # backward nodes
    bpos = {n.name: t for t, n in enumerate(bwd_nodes)}
    bwd = []
    for t, n in enumerate(bwd_nodes):
        fr, br = set(), set()
        for i in n.inputs:
            kind, r = broot[i]
            if kind == "f":
                fr.add(group_of_root(r))
            elif kind == "b":
                br.add(bpos[r])
        kind, r = broot[n.name]
        bwd.append(
            BwdNode(
                index=t,
                name=n.name,
                out_bytes=int(n.out_bytes) if kind == "b" and r == n.name else 0,
                time=float(n.time),
                workspace_bytes=int(n.workspace_bytes),
                fwd_reads=tuple(sorted(fr)),
                bwd_reads=tuple(sorted(br - {t})),
                root=bpos[r] if kind == "b" else -1,
                fwd_root=group_of_root(r) if kind == "f" and r != x else -1,
            )
        )
    m = len(bwd)
    # name-level last use (views extend their root's storage)
    name_last = {}
    for t, n in enumerate(bwd_nodes):
        name_last.setdefault(n.name, t)
        for i in n.inputs:
            if i in bpos:
                name_last[i] = max(name_last.get(i, t), t)
    # a view's storage lifetime covers its own last use and its alias children's
    hold_end = dict(name_last)
    for n in reversed(bwd_nodes):
        if broot[n.name][0] != "b" or broot[n.name][1] != n.name:
            if n.alias_of in hold_end:
                hold_end[n.alias_of] = max(hold_end[n.alias_of], hold_end[n.name])
    bwd_last_use = [-1] * m
    bwd_root_names: dict[int, list] = {}
    for t, n in enumerate(bwd_nodes):
        kind, r = broot[n.name]
        if kind == "b":
            rt = bpos[r]
            bwd_last_use[rt] = max(bwd_last_use[rt], hold_end[n.name])
            bwd_root_names.setdefault(rt, []).append(n.name)
    dx_root = -1
    if graph.input_grad_name:
        kind, r = broot[graph.input_grad_name]
        if kind == "b":
            dx_root = bpos[r]
            bwd_last_use[dx_root] = m
    for name in graph.held_grad_names:  # residents' gradient sums: held past the backward, as dx
        kind, r = broot[name]
        if kind == "b":
            bwd_last_use[bpos[r]] = m
    # names freed after each backward position: a backward storage root's names together at
    # its last use; names aliasing x / dy / a forward group after their own last reader
    bwd_name_free: dict[int, list] = {}
    for rt, nms in bwd_root_names.items():
        if bwd_last_use[rt] < m:
            bwd_name_free.setdefault(bwd_last_use[rt], []).extend(nms)
    for t, n in enumerate(bwd_nodes):
        if broot[n.name][0] != "b":
            bwd_name_free.setdefault(name_last[n.name], []).append(n.name)
    stages = [t for t in range(m) if bwd[t].fwd_reads]
    stage_of = {t: k for k, t in enumerate(stages)}
    holds = []
    for t, n in enumerate(bwd_nodes):
        g = bwd[t].fwd_root
        if g >= 0:
            end = hold_end[n.name]
            ks = [stage_of[u] for u in stages if t < u <= end]
            if ks:
                holds.append((g, ks[0], ks[-1]))
    return CompactGraph(
        graph=graph,
        groups=groups,
        bwd=bwd,
        out_group=out_group,
        dy_bytes=int(graph.output_grad_bytes),
        dx_root=dx_root,
        fwd_last_use=fwd_last_use,
        bwd_last_use=bwd_last_use,
        bwd_root_names={k: tuple(v) for k, v in bwd_root_names.items()},
        stages=stages,
        fwd_view_holds=holds,
        bwd_name_free={t: tuple(v) for t, v in bwd_name_free.items()},
    )


# ----------------------------------------------------------------------------- structure


@dataclass
class Structure:
    """Sets derived from a CompactGraph that both the ILP and the brute force use."""

    cg: CompactGraph
    need: list  # per stage: groups possibly needed (closure of reads, not through random / x)
    cone: list  # per stage: recomputable groups (sorted)
    useful: list  # per stage k: groups that some stage >= k may need (no x)
    bwd_live_before: list  # per backward position: bytes of backward values alive just before it
    x_needed: bool
    y_needed: bool
    forced: list  # per stage: groups that must be present at its start (backward-view holds)
    deferred: frozenset = frozenset()  # groups the forward computes only when kept (module docstring)
    useful_sets: list = None  # useful as frozensets (membership tests)

    def __post_init__(self) -> None:
        if self.useful_sets is None:
            self.useful_sets = [frozenset(u) for u in self.useful]

    @property
    def K(self) -> int:
        return len(self.cg.stages)


#: Recomputation variables (the cones' total size) above which the cones stop at groups that
#: read a random value (see :func:`structure`).
FULL_CONE_LIMIT = 20_000


def _cones(cg: CompactGraph, cut_at_random_readers: bool) -> tuple[list, list]:
    """(need, cone) per stage: the groups possibly needed and the recomputable ones."""
    groups = cg.groups
    reads_random = [any(groups[h].random for h in g.inputs) for g in groups]
    need, cone = [], []
    for t in cg.stages:
        seen, expanded = set(), set()
        stack = [(g, True) for g in cg.bwd[t].fwd_reads]
        while stack:
            g, expand = stack.pop()
            seen.add(g)
            if not expand or g in expanded or g == 0 or groups[g].random:
                continue
            expanded.add(g)
            through = not (cut_at_random_readers and reads_random[g])
            stack.extend((h, through) for h in groups[g].inputs if through or h not in seen)
        need.append(seen)
        cone.append(sorted(expanded))
    return need, cone


def structure(cg: CompactGraph, recompute_across_dropouts: bool = True) -> Structure:
    """The graph's stages, their cones and what they may need.

    A stage's cone is every deterministic ancestor of its reads, not expanded through random
    groups or x. With ``recompute_across_dropouts=False``, or where the cones would hold more
    than FULL_CONE_LIMIT recomputation variables in all, they also stop at groups that read a
    random value (a dropout's output from its packed mask): such a group stays recomputable,
    from inputs that are present (kept or carried), as a native dropout's output never is.
    Recomputation then never crosses a dropout, which bounds the cones by the model's dropout
    spacing. For a whole model as one graph with recomputable dropout outputs, whose full
    cones reach back to its start, that is the difference between an ILP HiGHS proves in
    seconds and one it leaves with 80% gaps after minutes (GPT-2, 4 layers: 449 against 5257
    recomputation variables). Within a block the full cones stay: cut ones would have to keep
    what a dropout reads, such as the attention probabilities, whenever its output is needed.
    """
    need, cone = _cones(cg, cut_at_random_readers=not recompute_across_dropouts)
    variables = sum(len(c) for c in cone)
    if recompute_across_dropouts and variables > FULL_CONE_LIMIT:
        need, cone = _cones(cg, cut_at_random_readers=True)
        log.info("block ILP: recomputation stops at dropouts (%d recomputation variables, %d uncut)",
                 sum(len(c) for c in cone), variables)
    K = len(cg.stages)
    useful = [set() for _ in range(K + 1)]
    for k in range(K - 1, -1, -1):
        useful[k] = useful[k + 1] | (need[k] - {0})
    m = len(cg.bwd)
    live_before = []
    for t in range(m):
        s = 0
        for u in range(t):
            if cg.bwd[u].root == u and cg.bwd_last_use[u] >= t:
                s += cg.bwd[u].out_bytes
        live_before.append(s)
    forced = [set() for _ in range(K)]
    for g, k0, k1 in cg.fwd_view_holds:
        for k in range(k0, k1 + 1):
            forced[k].add(g)
    x_needed = any(0 in nd for nd in need)
    y_needed = any(cg.out_group in nd for nd in need)
    deferred = frozenset(
        g for g in useful[0]
        if g != cg.out_group and not cg.groups[g].random and cg.fwd_last_use[g] == g
    )
    return Structure(cg, need, cone, [sorted(u) for u in useful], live_before, x_needed, y_needed, forced, deferred)


def forward_groups(st: Structure, kept: frozenset) -> list[int]:
    """The groups (not x) the forward computes, in order, when ``kept`` are kept: all but the
    deferred groups left unkept."""
    return [g for g in range(1, st.cg.n) if g not in st.deferred or g in kept]


# ----------------------------------------------------------------------------- decisions


@dataclass(frozen=True)
class Decisions:
    """A point of the schedule family (see the module docstring)."""

    kept: frozenset  # S: groups kept at end of forward (not x; y only through pin_output)
    pin_input: bool
    pin_output: bool
    recompute: tuple  # per stage: frozenset of groups recomputed
    carry: tuple  # per stage k >= 1: frozenset of groups present at its start (A); carry[0] = kept


@dataclass(frozen=True)
class Evaluation:
    fwd_time: float
    bwd_time: float
    recompute_time: float
    kept_bytes: int  # sum of S (x and y excluded)
    retained_bytes: int  # kept + pinned x + pinned y
    fwd_peak: int  # absolute, x included
    bwd_peak: int  # absolute, dy and the retained bytes included
    bwd_entry: int  # PX x + kept + PY y + dy
    valid: bool
    why: str = ""


def evaluate(st: Structure, d: Decisions) -> Evaluation:
    """Exact cost of a point of the family, by direct accounting (no matrices)."""
    cg = st.cg
    G = cg.groups
    b = [g.out_bytes for g in G]
    y = cg.out_group
    bx = b[0]
    why = ""
    # forward (running byte sums and expiry buckets: linear in the graph)
    computed = set(forward_groups(st, d.kept))
    fwd_time = G[0].time + sum(G[g].time for g in computed)
    live: set = set()
    live_bytes = 0
    expire: dict[int, list[int]] = {}
    for g in computed:
        expire.setdefault(cg.fwd_last_use[g], []).append(g)
    fwd_peak = bx + (G[0].peak_extra if G[0].steps else 0)
    for j in range(1, len(G)):
        if j in computed:
            fwd_peak = max(fwd_peak, bx + live_bytes + G[j].peak_extra)
            live.add(j)
            live_bytes += b[j]
        # values are freed at their last reader's place, run or deferred
        for g in expire.pop(j, ()):
            if g in live and g != y and g not in d.kept:
                live.discard(g)
                live_bytes -= b[g]
    kept_bytes = sum(b[g] for g in d.kept)
    fwd_peak = max(fwd_peak, bx + live_bytes)
    # backward
    pin = (bx if d.pin_input else 0) + (b[y] if d.pin_output else 0)
    entry = pin + kept_bytes + cg.dy_bytes
    bwd_peak = entry
    rec_time = 0.0
    K = st.K
    present = set(d.kept)
    present_bytes = kept_bytes
    nxt = 0
    for t, node in enumerate(cg.bwd):
        base = cg.dy_bytes + st.bwd_live_before[t] + pin
        if nxt < K and cg.stages[nxt] == t:
            k = nxt
            A = set(d.carry[k]) if k > 0 else set(d.kept)
            R = set(d.recompute[k])
            if A & R:
                why = why or f"stage {k}: recomputes a present value"
            if not R <= set(st.cone[k]):
                why = why or f"stage {k}: recomputes outside its cone"
            if not all(g in A or (g == y and d.pin_output) for g in st.forced[k]):
                why = why or f"stage {k}: a value held by a backward view is missing"
            avail, avail_bytes = set(A), sum(b[g] for g in A)
            for j in sorted(R):  # recomputed in topological order; each counts from its computation on
                for h in G[j].inputs:
                    ok = (h == 0 and d.pin_input) or (h == y and d.pin_output) or h in avail
                    if not ok:
                        why = why or f"stage {k}: recomputing {G[j].name} needs {G[h].name}"
                bwd_peak = max(bwd_peak, base + avail_bytes + G[j].peak_extra)
                rec_time += G[j].time
                if j not in avail:
                    avail.add(j)
                    avail_bytes += b[j]
            P = avail  # A | R
            for h in node.fwd_reads:
                ok = (h == 0 and d.pin_input) or (h == y and d.pin_output) or h in P
                if not ok:
                    why = why or f"stage {k}: {node.name} needs {G[h].name}"
            bwd_peak = max(bwd_peak, base + avail_bytes + node.out_bytes + node.workspace_bytes)
            present = set(d.carry[k + 1]) if k + 1 < K else set()
            present_bytes = sum(b[g] for g in present)
            if not present <= P:
                why = why or f"stage {k + 1}: carries a value that is not present"
            nxt += 1
        else:
            bwd_peak = max(bwd_peak, base + present_bytes + node.out_bytes + node.workspace_bytes)
    bwd_time = sum(n.time for n in cg.bwd) + rec_time
    if d.pin_output and y in d.kept:
        why = why or "y both kept and pinned"
    return Evaluation(
        fwd_time=fwd_time,
        bwd_time=bwd_time,
        recompute_time=rec_time,
        kept_bytes=kept_bytes,
        retained_bytes=kept_bytes + pin,
        fwd_peak=fwd_peak,
        bwd_peak=bwd_peak,
        bwd_entry=entry,
        valid=not why,
        why=why,
    )


# ----------------------------------------------------------------------------- the model


@dataclass
class IlpModel:
    """Matrices of the ILP (built once per graph; budgets are bounds of kv / pv / tv).

    Rows: lb <= A x <= ub. Columns: binaries first, then kv, pv, tv (continuous).
    Bytes are divided by ``byte_scale`` and times by ``time_scale`` inside the model.
    """

    structure: Structure
    A: sparse.csr_matrix
    row_lb: np.ndarray
    row_ub: np.ndarray
    n_binary: int
    var_names: list
    col_S: dict
    col_R: dict  # (k, g) -> col
    col_A: dict  # (k, g) -> col, at g's key stages k
    next_key: dict  # (k, g) -> first key stage >= k of g, -1 if none
    col_PX: int  # -1 if absent
    col_PY: int
    col_kv: int
    col_pv: int
    col_tv: int
    byte_scale: float
    time_scale: float
    fixed_time: float  # forward (deferred groups aside) + backward times (constants)

    @property
    def n_vars(self) -> int:
        return self.A.shape[1]

    @property
    def n_constraints(self) -> int:
        return self.A.shape[0]

    def objective(self, which: str = "time") -> np.ndarray:
        c = np.zeros(self.n_vars)
        c[{"time": self.col_tv, "peak": self.col_pv, "kept": self.col_kv}[which]] = 1.0
        return c

    def bounds(self, kept=None, peak=None, recompute_time=None):
        lb = np.zeros(self.n_vars)
        ub = np.ones(self.n_vars)
        inf = np.inf
        ub[self.col_kv] = inf if kept is None else kept / self.byte_scale
        ub[self.col_pv] = inf if peak is None else peak / self.byte_scale
        ub[self.col_tv] = inf if recompute_time is None else recompute_time / self.time_scale
        return lb, ub

    def integrality(self) -> np.ndarray:
        it = np.zeros(self.n_vars, dtype=np.int8)
        it[: self.n_binary] = 1
        return it

    def presence(self, k: int, g: int) -> int:
        nk = self.next_key.get((k, g), -1)
        return -1 if nk < 0 else self.col_A.get((nk, g), -1)

    def decode(self, xs: np.ndarray) -> Decisions:
        st = self.structure
        on = lambda c: bool(c >= 0 and xs[c] > 0.5)  # noqa: E731
        kept = frozenset(g for g, c in self.col_S.items() if on(c))
        rec = tuple(frozenset(g for (kk, g), c in self.col_R.items() if kk == k and on(c)) for k in range(st.K))
        carry = [kept] + [frozenset(g for g in st.useful[k] if on(self.presence(k, g))) for k in range(1, st.K)]
        return Decisions(kept, on(self.col_PX), on(self.col_PY), rec, tuple(carry))


def build_model(st: Structure) -> IlpModel:
    cg = st.cg
    G = cg.groups
    y = cg.out_group
    K = st.K
    b_raw = [g.out_bytes for g in G]
    scale_b = float(max([1] + b_raw + [cg.dy_bytes] + [n.out_bytes + n.workspace_bytes for n in cg.bwd] + [g.peak_extra for g in G]))
    fwd_time = sum(g.time for g in G)
    scale_t = fwd_time if fwd_time > 0 else 1.0
    fixed_fwd_time = fwd_time - sum(G[g].time for g in st.deferred)
    b = [v / scale_b for v in b_raw]

    names = []

    def new(name):
        names.append(name)
        return len(names) - 1

    # Presence variables only at a group's "key" stages (those whose need-closure holds
    # it): between two keys a value is either carried the whole way or freed right after
    # the earlier one (carrying it part-way and freeing it before it is needed again
    # costs memory and saves nothing), so the presence at a pass-through stage is the
    # variable of the next key. The first key's variable is S (kept from the forward).
    keys = {g: [k for k in range(K) if g in st.need[k]] for g in range(1, len(G))}
    col_R, col_A, col_S = {}, {}, {}
    for g in range(1, len(G)):
        for i, k in enumerate(keys[g]):
            if i == 0 and g == y:
                continue  # y is never kept unpinned: A[first key, y] = 0
            col_A[k, g] = new(f"A[{k},{G[g].name}]")
            if i == 0:
                col_S[g] = col_A[k, g]
    col_PX = new("PX") if st.x_needed else -1
    col_PY = new("PY") if st.y_needed else -1
    for k in range(K):
        for g in st.cone[k]:
            col_R[k, g] = new(f"R[{k},{G[g].name}]")
    n_bin = len(names)
    col_kv, col_pv, col_tv = new("kv"), new("pv"), new("tv")
    next_key = {}
    for g in range(1, len(G)):
        nk = -1
        for k in range(K - 1, -1, -1):
            if g in st.need[k]:
                nk = k
            next_key[k, g] = nk

    rows, cols, vals, lbs, ubs = [], [], [], [], []
    r = [0]

    def row(terms, lo, hi):
        for c, v in terms:
            if c >= 0 and v != 0:
                rows.append(r[0])
                cols.append(c)
                vals.append(v)
        lbs.append(lo)
        ubs.append(hi)
        r[0] += 1

    def A_col(k, g):
        """Presence of g at the start of stage k (-1: never)."""
        nk = next_key.get((k, g), -1)
        return -1 if nk < 0 else col_A.get((nk, g), -1)

    def avail_terms(k, g):
        if g == 0:
            return [(col_PX, 1.0)]
        t = [(A_col(k, g), 1.0), (col_R.get((k, g), -1), 1.0)]
        if g == y:
            t.append((col_PY, 1.0))
        return [(c, v) for c, v in t if c >= 0]

    inf = np.inf
    pin_terms = [(col_PX, b[0]), (col_PY, b[y])]
    for k in range(K):
        node = cg.bwd[cg.stages[k]]
        reads = set(node.fwd_reads)
        consumers = {}
        for g in st.cone[k]:
            for h in G[g].inputs:
                consumers.setdefault(h, []).append(g)
        for g in node.fwd_reads:
            row(avail_terms(k, g), 1.0, inf)
        for g in st.cone[k]:
            rc = col_R[k, g]
            for h in G[g].inputs:
                row([(rc, -1.0)] + avail_terms(k, h), 0.0, inf)
            terms = [(A_col(k, g), 1.0), (rc, 1.0)] + ([(col_PY, 1.0)] if g == y else [])
            row(terms, -inf, 1.0)
            if g not in reads:  # recompute only what this stage uses (a dominance cut)
                row([(rc, -1.0)] + [(col_R[k, c], 1.0) for c in consumers.get(g, [])], 0.0, inf)
        for g in st.forced[k]:
            row([(A_col(k, g), 1.0)] + ([(col_PY, 1.0)] if g == y else []), 1.0, inf)
    for g in range(1, len(G)):
        ks = keys[g]
        for k1, k2 in zip(ks, ks[1:]):
            row([(col_A[k2, g], 1.0), (col_A.get((k1, g), -1), -1.0), (col_R.get((k1, g), -1), -1.0)], -inf, 0.0)
        if g == y and col_PY >= 0:
            for k in ks:
                if (k, y) in col_A and (k, y) not in col_R:
                    row([(col_A[k, y], 1.0), (col_PY, 1.0)], -inf, 1.0)
    # kept budget
    row([(c, b[g]) for g, c in col_S.items()] + pin_terms + [(col_kv, -1.0)], -inf, 0.0)
    # recompute time, and the forward time of the deferred groups that are kept
    row([(c, G[g].time / scale_t) for (k, g), c in col_R.items()]
        + [(col_S[g], G[g].time / scale_t) for g in sorted(st.deferred)] + [(col_tv, -1.0)], -inf, 0.0)

    # forward peak rows: constant part + optional kept values already dead
    bx = b[0]
    n = len(G)
    if G[0].steps:
        row([(col_pv, -1.0)], -inf, -(bx + G[0].peak_extra / scale_b))
    for j in range(1, n):
        mandatory = sum(b[g] for g in range(1, j) if cg.fwd_last_use[g] >= j or g == y)
        opt = [(col_S[g], b[g]) for g in range(1, j) if cg.fwd_last_use[g] < j and g != y and g in col_S]
        if j in st.deferred:  # only computed when kept
            row(opt + [(col_S[j], G[j].peak_extra / scale_b), (col_pv, -1.0)], -inf, -(bx + mandatory))
        else:
            row(opt + [(col_pv, -1.0)], -inf, -(bx + mandatory + G[j].peak_extra / scale_b))
    end_mand = sum(b[g] for g in range(1, n) if g == y)
    row([(c, b[g]) for g, c in col_S.items()] + [(col_pv, -1.0)], -inf, -(bx + end_mand))

    # backward rows
    dy = cg.dy_bytes / scale_b
    nxt = 0
    gap_const = {}  # next stage index (K: none) -> largest constant among the nodes before it
    for t, node in enumerate(cg.bwd):
        raw = cg.dy_bytes + st.bwd_live_before[t] + node.out_bytes + node.workspace_bytes
        if nxt < K and cg.stages[nxt] == t:
            k = nxt
            base = (cg.dy_bytes + st.bwd_live_before[t]) / scale_b
            # recomputation rows; row (k, j) can exceed the stage row only when j's
            # transient (peak_extra - bytes) exceeds what c_k adds, so others are omitted
            for j in st.cone[k]:
                if G[j].peak_extra - G[j].out_bytes <= node.out_bytes + node.workspace_bytes:
                    continue
                terms = list(pin_terms)
                terms += [(A_col(k, g), b[g]) for g in st.useful[k]]
                terms += [(col_R[k, g], b[g]) for g in st.cone[k] if g < j]
                terms += [(col_R[k, j], G[j].peak_extra / scale_b)]
                row(_merge(terms) + [(col_pv, -1.0)], -inf, -base)
            terms = list(pin_terms)
            terms += [(A_col(k, g), b[g]) for g in st.useful[k]]
            terms += [(col_R[k, g], b[g]) for g in st.cone[k]]
            row(_merge(terms) + [(col_pv, -1.0)], -inf, -raw / scale_b)
            nxt += 1
        else:
            gap_const[nxt] = max(gap_const.get(nxt, 0), raw)
    # nodes between two stages hold the same forward values: one row per gap
    for k, raw in gap_const.items():
        terms = list(pin_terms)
        if k < K:
            terms += [(A_col(k, g), b[g]) for g in st.useful[k]]
        row(_merge(terms) + [(col_pv, -1.0)], -inf, -raw / scale_b)
    # the backward entry (retained bytes + dy) is also a moment of the backward
    row([(c, b[g]) for g, c in col_S.items()] + pin_terms + [(col_pv, -1.0)], -inf, -dy)

    nrows = r[0]
    A = sparse.csr_matrix((vals, (rows, cols)), shape=(nrows, len(names)))
    A.sum_duplicates()
    return IlpModel(
        structure=st,
        A=A,
        row_lb=np.array(lbs, dtype=float),
        row_ub=np.array(ubs, dtype=float),
        n_binary=n_bin,
        var_names=names,
        col_S=col_S,
        col_R=col_R,
        col_A=col_A,
        next_key=next_key,
        col_PX=col_PX,
        col_PY=col_PY,
        col_kv=col_kv,
        col_pv=col_pv,
        col_tv=col_tv,
        byte_scale=scale_b,
        time_scale=scale_t,
        fixed_time=fixed_fwd_time + sum(nd.time for nd in cg.bwd),
    )


def _merge(terms):
    acc = {}
    for c, v in terms:
        if c >= 0 and v != 0:
            acc[c] = acc.get(c, 0.0) + v
    return list(acc.items())


# ----------------------------------------------------------------------------- op lists


def op_lists(st: Structure, d: Decisions) -> tuple[tuple, tuple]:
    """The explicit forward and backward op lists of a point of the family."""
    cg = st.cg
    G = cg.groups
    y = cg.out_group
    graph = cg.graph
    fwd_ops = []
    fwd_ops += list(G[0].steps)
    alive = set()
    x_views = [nm for nm in G[0].names if nm != graph.input_name]

    def free_group(g, out):
        for nm in G[g].names:
            if g == 0 and nm == graph.input_name:
                continue
            out.append((FREE, nm))

    computed = set(forward_groups(st, d.kept))
    for j in range(1, len(G)):
        # values are freed at their last reader's place, run or deferred
        if j in computed:
            fwd_ops += list(G[j].steps)
            alive.add(j)
        for g in sorted(alive):
            if cg.fwd_last_use[g] <= j and g != y and g not in d.kept:
                free_group(g, fwd_ops)
                alive.discard(g)
        if cg.fwd_last_use[0] == j and not d.pin_input:
            fwd_ops += [(FREE, nm) for nm in x_views]
    if cg.fwd_last_use[0] == 0 and not d.pin_input:
        fwd_ops += [(FREE, nm) for nm in x_views]
    if not d.pin_output:
        # y's other names are not needed after the forward; y itself stays with the chain
        fwd_ops += [(FREE, nm) for nm in G[y].names if nm != graph.output_name]

    bwd_ops = []
    K = st.K
    nxt = 0
    present = set(d.kept)
    for t, node in enumerate(cg.bwd):
        if nxt < K and cg.stages[nxt] == t:
            k = nxt
            R = d.recompute[k]
            for j in sorted(R):
                bwd_ops += list(G[j].steps)
            bwd_ops.append((COMPUTE, node.name))
            P = present | set(R)
            nxt_present = set(d.carry[k + 1]) if k + 1 < K else set()
            for g in sorted(P - nxt_present):
                free_group(g, bwd_ops)
            present = nxt_present
            nxt += 1
        else:
            bwd_ops.append((COMPUTE, node.name))
        bwd_ops += [(FREE, nm) for nm in cg.bwd_name_free.get(t, ())]
    return tuple(fwd_ops), tuple(bwd_ops)
