"""Block options: solved schedules as explicit op lists, the per-block menu, a simulator.

``solve_menu(graph)`` sweeps a grid of (retained bytes, peak) budgets between the
smallest feasible and keep-everything, reusing one ILP (budgets are variable bounds,
see ``formulation``), adds the two trivial options (keep every forward result the
backward reads; keep nothing and recompute from the input), and drops dominated
options. ``simulate_option`` replays an option's op lists on the *original* graph,
independently of the ILP, to check its predicted times and peaks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np

from ..plans import clock
from ..plans.block_graph import BlockGraph
from ..plans.block_options import COMPUTE
from .formulation import Decisions, Evaluation, Structure, compact, evaluate, op_lists, structure
from .solve import BlockIlp, solve_count
from ..plans.block_options import BlockOption, BlockOptions, ForwardOnly

log = logging.getLogger("hierremat.ilp")

# Per-solve limit of a menu sweep: solves near the least feasible peak are the slow ones
# (seconds to tens of seconds on a GPT-2-sized block); a stopped one keeps its incumbent.
MENU_TIME_LIMIT = 10.0
#: Seconds one menu's sweep may take in all (its solves' limits are cut to what is left; the
#: sweep then stops with what it found). A GPT-2 block's sweep takes 1-4 s on CPU; a T5 decoder
#: layer with packed dropout masks has peak-budget solves HiGHS does not prove in 10 s.
MENU_SWEEP_LIMIT = 15.0
#: A block whose ILP would have more recomputation variables than this is not solved: its
#: menu is the coarser heuristic one (see heuristic_options). A GPT-2 block has ~3,700.
MAX_ILP_VARIABLES = 20_000
#: The least a sweep's solve gets of the per-solve limit when rows share it (see _sweep).
MIN_SHARED_SOLVE_SECONDS = 1.0
#: A solve with less time than this left before the planning deadline is not started.
MIN_SOLVE_SECONDS = 0.5
#: An option whose op lists are longer than this many ops per node of the graph is not offered:
#: it recomputes long prefixes again and again (quadratic in a deep block; recompute-all of a
#: GPT-2 block has 19 per node), and the chain DP's stage-level recomputation does that better.
MAX_OPS_PER_NODE = 32


# ----------------------------------------------------------------------------- building options


def make_option(st: Structure, d: Decisions, name: str, optimal: bool, ev: Evaluation | None = None, **budgets) -> BlockOption:
    ev = ev or evaluate(st, d)
    if not ev.valid:
        raise ValueError(f"option {name}: {ev.why}")
    graph = st.cg.graph
    fwd_ops, bwd_ops = op_lists(st, d)
    option = BlockOption(
        name=name,
        fwd_ops=free_at_last_use(graph, fwd_ops),
        bwd_ops=free_at_last_use(graph, bwd_ops),
        fwd_time=float(ev.fwd_time),
        bwd_time=float(ev.bwd_time),
        kept_bytes=int(ev.kept_bytes),
        fwd_peak_bytes=int(ev.fwd_peak - graph.input_bytes),
        bwd_peak_bytes=int(ev.bwd_peak - ev.bwd_entry),
        pins_input=bool(d.pin_input),
        pins_output=bool(d.pin_output),
        optimal=bool(optimal),
        input_grad_bytes=graph.input_bytes if graph.input_grad_name else 0,
        **budgets,
    )
    # the earlier frees can only lower the ILP's peaks: the option states what it really uses
    simulated = simulate_option(graph, option)
    if simulated.fwd_peak_bytes > option.fwd_peak_bytes or simulated.bwd_peak_bytes > option.bwd_peak_bytes:
        raise AssertionError(f"option {name}: freeing at last use raised a peak")  # pragma: no cover
    return replace(option, fwd_peak_bytes=simulated.fwd_peak_bytes, bwd_peak_bytes=simulated.bwd_peak_bytes)


def free_at_last_use(graph: BlockGraph, ops: tuple) -> tuple:
    """``ops`` with every free moved up to just after the last op before it that computes or
    reads the freed name (to the front if none does).

    The staged formulation frees values at stage boundaries; the runtime's generated code
    (hierremat.runtime.option_codegen) drops each value at its last use, so the op lists say
    the same. Only frees move: what is computed, and what is alive at the end, are unchanged.
    """
    inputs = {n.name: n.inputs for n in graph.nodes}
    anchors: dict[int, list] = {}
    last_touch: dict[str, int] = {}
    for i, (kind, name) in enumerate(ops):
        if kind == COMPUTE:
            last_touch[name] = i
            for arg in inputs.get(name, ()):
                last_touch[arg] = i
        else:
            anchors.setdefault(last_touch.get(name, -1), []).append((kind, name))
    out = list(anchors.get(-1, ()))
    for i, op in enumerate(ops):
        if op[0] == COMPUTE:
            out.append(op)
            out += anchors.get(i, ())
    return tuple(out)


def keep_all_decisions(st: Structure) -> Decisions:
    """Keep every forward result the backward reads; no recomputation."""
    cg = st.cg
    y = cg.out_group
    reads = set()
    for t in cg.stages:
        reads |= set(cg.bwd[t].fwd_reads)
    kept = frozenset(g for g in reads if g not in (0, y))
    carry = [kept] + [kept & st.useful_sets[k] for k in range(1, st.K)]
    return Decisions(kept, 0 in reads, y in reads, tuple(frozenset() for _ in range(st.K)), tuple(carry))


def recompute_all_decisions(st: Structure) -> Decisions:
    """Keep nothing but x (and random results, which may not be recomputed); every stage
    recomputes what it needs from them (values held by backward views are carried)."""
    cg = st.cg
    G = cg.groups
    needed = set().union(*st.need) if st.K else set()
    kept = frozenset(g for g in needed if g != 0 and G[g].random)
    rec, carry = [], [kept]
    for k in range(st.K):
        if k >= 1:
            carry.append((kept & st.useful_sets[k]) | frozenset(st.forced[k]))
        rec.append(frozenset(g for g in st.cone[k] if g not in carry[k]))
    return Decisions(kept, 0 in needed, False, tuple(rec), tuple(carry))


def selective_decisions(st: Structure, keep) -> Decisions:
    """Keep the groups of ``keep`` (and the random ones the backward reads, which may not be
    recomputed); every stage recomputes, from what is present, what its reads need. The
    schedules between keep-all and recompute-all that a selective policy gives (torch's
    selective activation checkpointing keeps matmul outputs)."""
    cg = st.cg
    G = cg.groups
    needed = set().union(*st.need) if st.K else set()
    kept = frozenset(g for g in needed if g != 0 and (g in keep or G[g].random))
    carry, rec = [kept], []
    for k in range(st.K):
        if k >= 1:
            carry.append((kept & st.useful_sets[k]) | frozenset(st.forced[k]))
        present, todo, chosen = carry[k], list(cg.bwd[cg.stages[k]].fwd_reads), set()
        if k + 1 < st.K:
            todo += [g for g in st.forced[k + 1] if g not in kept]
        while todo:
            g = todo.pop()
            if g == 0 or g in present or g in chosen:
                continue
            chosen.add(g)
            todo.extend(G[g].inputs)
        rec.append(frozenset(chosen))
    return Decisions(kept, 0 in needed, False, tuple(rec), tuple(carry))


def heuristic_options(st: Structure) -> list[BlockOption]:
    """Options without the ILP (the coarser formulation of blocks too large for it, or left
    without time): keep the forward groups that are costliest to recompute per byte kept,
    at a few fractions of the recomputable bytes, each validated by the schedule evaluator."""
    G = st.cg.groups
    recomputable = [g for g in set().union(*st.cone) if not G[g].random] if st.K else []
    recomputable.sort(key=lambda g: (-G[g].time / max(1, G[g].out_bytes), g))
    total = sum(G[g].out_bytes for g in recomputable)
    out, seen = [], set()
    for fraction in (0.125, 0.25, 0.5, 0.75):
        keep, acc = set(), 0
        for g in recomputable:
            if acc + G[g].out_bytes > fraction * total:
                break
            keep.add(g)
            acc += G[g].out_bytes
        keep = frozenset(keep)
        if not keep or keep in seen:
            continue
        seen.add(keep)
        try:
            out.append(make_option(st, selective_decisions(st, keep), f"selective{int(fraction * 1000)}", optimal=False))
        except ValueError as err:  # not a schedule of the family (a forced carry it cannot meet)
            log.debug("selective option at %.3f skipped: %s", fraction, err)
    return out


def _ilp_variables(st: Structure) -> int:
    """About how many variables the block's ILP has (its recomputation variables)."""
    return sum(len(c) for c in st.cone)


def _log_rejected(label: str, budgets: dict, problem: str | None) -> None:
    log.error(
        "block %s: the ILP solution at %s was rejected (%s) and discarded; the menu goes on without it. This is "
        "a bug in hierremat's block ILP: please report it with the block signature.",
        label or "(unnamed)", {k: v for k, v in budgets.items() if k != "objective"} or budgets, problem,
    )


def _prune(options: list) -> list:
    out = []
    for i, o in enumerate(options):
        dominated = False
        for j, p in enumerate(options):
            if i == j or not p.dominates(o):
                continue
            # equal options: keep the first (prefer optimal ILP options, then earlier)
            if o.dominates(p) and (o.optimal, -i) > (p.optimal, -j):
                continue
            dominated = True
            break
        if not dominated:
            out.append(o)
    out.sort(key=lambda o: (o.kept_bytes, o.total_time))
    return out


def solve_menu(
    graph: BlockGraph,
    *,
    n_kept: int = 8,
    n_peak: int = 6,
    peak_step: float = 0.08,
    time_limit: float = MENU_TIME_LIMIT,
    sweep_limit: float = MENU_SWEEP_LIMIT,
    backend: str = "auto",
    ilp: BlockIlp | None = None,
    progress=None,
    label: str = "",
    deadline: float | None = None,
    recompute_across_dropouts: bool = True,
) -> BlockOptions:
    """The option menu of ``graph``: a (retained bytes x peak) budget sweep of the ILP,
    plus keep-all, recompute-all and the heuristic options, Pareto-pruned.

    n_kept budgets of retained bytes from the least feasible to keep-all; for each, the
    fastest schedule (all of those first), then up to n_peak peak budgets at
    (1 - peak_step * i) times its peak, stopping at the first infeasible one and adding one
    bisection step after it, or at the first one its time limit stopped (tighter ones only
    get harder to prove). The defaults (8 x 6 at 8% steps, about 50 solves per distinct
    block) keep the chain DP's plans within 1% of the whole-graph ILP's on GPT-2
    (benchmarks/bench_quality.py); the earlier 4 x 3 at 15% (about 18 solves) left gaps of
    up to 2.5%.

    Bounded: each solve is limited to ``time_limit`` seconds (a stopped solve keeps its
    incumbent, marked ``optimal=False`` with its MIP gap), the sweep to ``sweep_limit``
    seconds in all, and none runs past ``deadline`` (a ``hierremat.plans.clock.now()`` value): the
    sweep stops there with what it found. A block
    whose ILP would exceed MAX_ILP_VARIABLES is not solved at all. Either way the menu
    says so (``coarse``) and still holds keep-all, recompute-all and the heuristic options.

    progress: called after every solve with a short text (budgets, status, seconds), e.g.
    to advance a progress bar. label: names the block in logs (its signature).
    recompute_across_dropouts: False for a whole model as one graph: recomputation stops at
    dropouts (hierremat.ilp.formulation.structure).

    A solution the formulation's evaluation or the op-list simulator rejects is discarded,
    never offered, and logged as a bug (ERROR, with ``label``); the menu goes on without it.
    """
    t0 = clock.now()
    solves0 = solve_count()
    st = ilp.structure if ilp is not None else structure(compact(graph), recompute_across_dropouts)
    cands = _fixed_options(st)
    keep_all = cands[0]
    variables = _ilp_variables(st)
    coarse, cut = "", False
    if ilp is None and variables > MAX_ILP_VARIABLES:
        coarse = f"its ILP would have about {variables} variables (over {MAX_ILP_VARIABLES})"
    elif deadline is not None and clock.seconds_left(deadline) < MIN_SOLVE_SECONDS:
        coarse, cut = "no time was left before the planning deadline", True
    else:
        ilp = ilp or BlockIlp(graph, st)
        sweep_end = clock.now() + sweep_limit
        ended = _sweep(ilp, graph, keep_all, cands, n_kept, n_peak, peak_step, time_limit, backend, progress, label,
                       sweep_end if deadline is None else min(deadline, sweep_end))
        cut = ended and deadline is not None and deadline <= sweep_end
        if ended:
            coarse = ("the planning deadline came during its ILP sweep" if cut else
                      f"its ILP sweep took its {sweep_limit:g} s: the rest of it was not solved")
    if coarse:
        log.info("block %s: heuristic options%s, because %s", label or "(unnamed)",
                 " and what the ILP found in time" if ilp is not None else "", coarse)
    options = _prune(_offered(cands, keep_all, len(graph.nodes), label))
    seconds, solves = clock.now() - t0, solve_count() - solves0
    n_vars, n_constraints = (ilp.model.n_vars, ilp.model.n_constraints) if ilp is not None else (0, 0)
    log.debug(
        "block menu: %d options (of %d candidates), %d solves, %d variables, %d constraints, %.2fs",
        len(options), len(cands), solves, n_vars, n_constraints, seconds,
    )
    return BlockOptions(tuple(options), seconds, solves, n_vars, n_constraints, coarse, cut)


class _DeadlineReached(Exception):
    pass


def _fixed_options(st) -> list[BlockOption]:
    """Keep-all (first), recompute-all where it replays, and the heuristic options: every menu holds them."""
    cands = [make_option(st, keep_all_decisions(st), "keep_all", optimal=False)]
    try:
        cands.append(make_option(st, recompute_all_decisions(st), "recompute_all", optimal=False))
    except ValueError as err:
        log.info("recompute_all option skipped: %s", err)
    return cands + heuristic_options(st)


def _offered(cands: list[BlockOption], keep_all: BlockOption, n_nodes: int, label: str) -> list[BlockOption]:
    """The candidates but those (keep-all aside) whose op lists are over MAX_OPS_PER_NODE per node of the graph."""
    most_ops = MAX_OPS_PER_NODE * n_nodes
    long = [o.name for o in cands if o is not keep_all and len(o.fwd_ops) + len(o.bwd_ops) > most_ops]
    if long:
        log.debug("block %s: options %s recompute too much (over %d ops): not offered", label, long, most_ops)
    return [o for o in cands if o.name not in long]


def _sweep(ilp, graph, keep_all, cands, n_kept, n_peak, peak_step, time_limit, backend, progress, label,
           deadline) -> bool:
    """Run solve_menu's budget sweep, adding its options to ``cands``; True if ``deadline`` (the
    planning deadline or the sweep's own end) stopped it."""
    st = ilp.structure

    def solve(share: float = 1.0, **budgets):
        limit = max(time_limit * share, min(time_limit, MIN_SHARED_SOLVE_SECONDS))
        if deadline is not None:
            limit = min(limit, deadline - clock.now())
            if limit < MIN_SOLVE_SECONDS:
                raise _DeadlineReached
        res = ilp.solve(time_limit=limit, backend=backend, **budgets)
        if res.status == "rejected":
            _log_rejected(label, budgets, res.problem)
        if progress is not None:
            shown = ", ".join(f"{k}={v}" for k, v in budgets.items() if k != "objective")
            progress(f"{shown or budgets.get('objective', '')}: {res.status} in {res.solve_seconds:.2f}s")
        return res

    seen = set()

    def add(res, K, P):
        if not res.has_solution or res.decisions in seen:
            return
        seen.add(res.decisions)
        name = f"ilp_kept{int(K)}_peak{int(P) if P is not None else 'inf'}"
        try:
            option = make_option(
                st, res.decisions, name, optimal=res.optimal, ev=res.evaluation, kept_budget=int(K),
                peak_budget=None if P is None else int(P), mip_gap=0.0 if res.optimal else res.gap,
            )
        except (ValueError, AssertionError) as err:  # the op lists do not replay: never offer them
            _log_rejected(label, {"kept": K, "peak": P}, f"option {name}: {err}")
            return
        cands.append(option)

    try:
        kmin = solve(objective="kept")
        if not kmin.has_solution:
            log.warning("block ILP: no schedule found for the least-kept solve (%s)", kmin.status)
            return True
        k_lo = int(kmin.objective)
        k_hi = max(k_lo, keep_all.kept_bytes + (graph.input_bytes if keep_all.pins_input else 0) + _y_bytes(st, keep_all))
        rows = []
        kept_budgets = sorted({int(round(v)) for v in np.linspace(k_lo, k_hi, max(1, n_kept))})
        for K in kept_budgets:
            # each row's solves get a share of the per-solve limit, so that every row has its
            # fastest schedule and some of its peak budgets within the sweep's time
            fastest = solve(kept=K, share=1.0 / len(kept_budgets))
            add(fastest, K, None)
            if fastest.has_solution:
                rows.append((K, fastest))
        for K, fastest in rows:
            # Peak budgets below the fastest schedule's peak, descending until infeasible,
            # then one bisection step towards the least feasible peak. (Solving for the
            # least peak directly is a min-max ILP that HiGHS proves slowly on real blocks.)
            p_hi = int(max(fastest.evaluation.fwd_peak, fastest.evaluation.bwd_peak))
            feasible, infeasible = p_hi, None
            for i in range(1, max(1, n_peak) + 1):
                P = int(p_hi * (1.0 - peak_step * i))
                if P <= 0:
                    break
                res = solve(kept=K, peak=P, share=2.0 / len(rows))
                if not res.has_solution:
                    infeasible = P if res.status == "infeasible" else None
                    break
                add(res, K, P)
                feasible = int(max(res.evaluation.fwd_peak, res.evaluation.bwd_peak))
                if not res.optimal:
                    break
            if infeasible is not None and feasible - infeasible > 1:
                P = (feasible + infeasible) // 2
                add(solve(kept=K, peak=P, share=2.0 / len(rows)), K, P)
    except _DeadlineReached:
        return True
    return False


def _y_bytes(st: Structure, o: BlockOption) -> int:
    return st.cg.groups[st.cg.out_group].out_bytes if o.pins_output else 0


# ----------------------------------------------------------------------------- simulator


@dataclass(frozen=True)
class OptionSimulation:
    fwd_time: float
    bwd_time: float
    fwd_peak_bytes: int  # above the forward's entry (x)
    bwd_peak_bytes: int  # above the backward's entry
    kept_bytes: int  # retained storage at the end of the forward, x and y not counted


class _Replay:
    """Replays op lists on a graph's storages (the simulator's memory model, shared by
    :func:`simulate_option` and :func:`forward_only`).

    Memory is counted per storage (a view, with no bytes of its own, shares its base's
    storage, found by following ``alias_of``); a storage is allocated while any of its
    names is live. A compute's peak is the memory before it, plus its storage if new, plus
    its workspace.
    """

    def __init__(self, graph: BlockGraph):
        x, dy = graph.input_name, graph.output_grad_name
        self.nodes = {n.name: n for n in graph.nodes}
        self.size = {x: graph.input_bytes, dy: graph.output_grad_bytes}
        self.root = {x: x, dy: dy}
        for n in graph.nodes:
            # a result that owns bytes is a storage of its own even when attached to another node
            # (the elements of a multi-output op, see hierremat.blocks.joint); a view owns none
            owns = n.out_bytes > 0 or not n.alias_of
            self.root[n.name] = n.name if owns else self.root.get(n.alias_of, n.alias_of)
            self.size.setdefault(n.name, n.out_bytes)

    def storage_bytes(self, live: set) -> int:
        return sum(self.size[r] for r in {self.root[nm] for nm in live})

    def run(self, ops, live: set, phase: str) -> tuple[int, int, float]:
        """Replay ``ops`` from the names in ``live`` (updated in place): (entry bytes, peak
        bytes, seconds). Raises ValueError on an op that reads a value not in memory, computes
        a live name again or frees a dead one."""
        root, size, nodes = self.root, self.size, self.nodes
        mem = self.storage_bytes(live)
        names_of: dict[str, int] = {}  # storage -> how many live names hold it
        for nm in live:
            names_of[root[nm]] = names_of.get(root[nm], 0) + 1
        entry, peak, elapsed = mem, mem, 0.0
        for i, (kind, nm) in enumerate(ops):
            if kind == "compute":
                n = nodes.get(nm)
                if n is None or (phase == "forward" and n.phase != "forward"):
                    raise ValueError(f"{phase} op {i}: {nm!r} is not a node this phase may run")
                missing = [a for a in n.inputs if a not in live]
                if missing:
                    raise ValueError(f"{phase} op {i}: {nm} reads {missing}, not in memory")
                if nm in live:
                    raise ValueError(f"{phase} op {i}: {nm} is already in memory")
                new = 0 if names_of.get(root[nm], 0) else size[root[nm]]
                peak = max(peak, mem + new + n.workspace_bytes)
                live.add(nm)
                names_of[root[nm]] = names_of.get(root[nm], 0) + 1
                mem += new
                elapsed += n.time
            elif kind == "free":
                if nm not in live:
                    raise ValueError(f"{phase} op {i}: frees {nm!r}, which is not in memory")
                live.discard(nm)
                names_of[root[nm]] -= 1
                if not names_of[root[nm]]:
                    mem -= size[root[nm]]
            else:
                raise ValueError(f"{phase} op {i}: unknown kind {kind!r}")
        return entry, peak, elapsed


def simulate_option(graph: BlockGraph, option: BlockOption) -> OptionSimulation:
    """Replay ``option``'s op lists on ``graph``; independent of the ILP.

    Memory as :class:`_Replay` counts it. Raises ValueError on an op that reads a value not
    in memory, frees a dead name, computes a forward node twice in the forward or skips a
    random one there (a forward node no forward node reads may be left to the backward),
    runs a backward node twice or out of order, or leaves dx missing.
    """
    x, dy = graph.input_name, graph.output_grad_name
    replay = _Replay(graph)
    nodes, root = replay.nodes, replay.root
    live = {x}
    entry_f, peak_f, t_f = replay.run(option.fwd_ops, live, "forward")
    computed = [nm for k, nm in option.fwd_ops if k == "compute"]
    if len(set(computed)) != len(computed):
        raise ValueError("the forward phase computes a forward node twice")
    skipped_random = [n.name for n in graph.forward_nodes if n.random and n.name not in computed]
    if skipped_random:
        raise ValueError(f"the forward phase skips random nodes {skipped_random}")
    if graph.output_name not in live:
        raise ValueError("the block output is not in memory at the end of the forward")
    x_names = {nm for nm in live if root[nm] == x}
    y_names = {nm for nm in live if root[nm] == root[graph.output_name]}
    kept_names = live - x_names - y_names
    kept = replay.storage_bytes(kept_names)
    blive = {dy} | kept_names
    if option.pins_input:
        blive |= x_names
    if option.pins_output:
        blive |= y_names
    entry_b, peak_b, t_b = replay.run(option.bwd_ops, blive, "backward")
    order = [nm for k, nm in option.bwd_ops if k == "compute" and nodes[nm].phase == "backward"]
    if order != [n.name for n in graph.backward_nodes]:
        raise ValueError("the backward phase does not run every backward node once, in order")
    if graph.input_grad_name and graph.input_grad_name not in blive:
        raise ValueError("dx is not in memory at the end of the backward")
    lost = [name for name in graph.held_grad_names if name not in blive]
    if lost:
        raise ValueError(f"held gradients {lost} are not in memory at the end of the backward")
    return OptionSimulation(t_f, t_b, peak_f - entry_f, peak_b - entry_b, kept)


def recost_options(graph: BlockGraph, options) -> list[BlockOption]:
    """``options``, solved for a graph of the same structure at other sizes (another input shape), with
    their costs on ``graph``: times, kept bytes and peaks as :func:`simulate_option` replays them
    (exact for these sizes; which values an option keeps or recomputes stays as solved). In the same
    order and none dropped, so that option k is the same option at every shape (the chain DP passes
    over one another dominates here). None is proven optimal at these sizes (``optimal`` False, no
    MIP gap: the solve that made them was not stopped). Raises ValueError where an option's op lists
    do not replay on ``graph``."""
    recosted = []
    for option in options:
        sim = simulate_option(graph, option)
        recosted.append(replace(
            option, fwd_time=sim.fwd_time, bwd_time=sim.bwd_time, kept_bytes=sim.kept_bytes,
            fwd_peak_bytes=sim.fwd_peak_bytes, bwd_peak_bytes=sim.bwd_peak_bytes,
            input_grad_bytes=graph.input_bytes if graph.input_grad_name else 0,
            optimal=False, mip_gap=0.0, kept_budget=None, peak_budget=None,
        ))
    return recosted


def forward_only(graph: BlockGraph, also: frozenset = frozenset()) -> ForwardOnly:
    """The no-grad forward of ``graph``: its forward nodes that the output, a random node or a
    node of ``also`` (buffer updates) depends on, in graph order, each value freed at its last
    use. Random nodes always run, so the forward draws what every other forward of the block
    draws from the same RNG state."""
    forward = graph.forward_nodes
    by_name = {n.name: n for n in forward}
    needed: set[str] = set()
    todo = [graph.output_name, *also, *(n.name for n in forward if n.random)]
    while todo:
        name = todo.pop()
        if name in needed or name not in by_name:
            continue
        needed.add(name)
        todo += by_name[name].inputs
    computes = tuple((COMPUTE, n.name) for n in forward if n.name in needed)
    frees = tuple(("free", n.name) for n in forward if n.name in needed and n.name != graph.output_name)
    ops = free_at_last_use(graph, computes + frees)
    replay = _Replay(graph)
    live = {graph.input_name}
    entry, peak, seconds = replay.run(ops, live, "forward")
    if graph.output_name not in live:  # pragma: no cover - the output is computed and never freed
        raise AssertionError("the forward-only ops lose the block output")
    return ForwardOnly(ops, seconds, peak - entry)
