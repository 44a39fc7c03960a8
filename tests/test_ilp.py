"""The per-block ILP against an exhaustive search, the op-list simulator and Gurobi."""

import itertools
import json
import logging
import math
import subprocess
import sys
import time

import numpy as np
import pytest

from hierremat.plans import clock as planning_clock
from hierremat.plans.block_graph import BlockGraph, GraphNode
from hierremat.plans.costs import ChainCosts, StageCosts
from hierremat.ilp import BlockIlp, simulate_option, solve_count, solve_menu
from hierremat.ilp.formulation import evaluate, structure, compact, Decisions
from hierremat.ilp import formulation, options as options_module
from hierremat.plans.block_options import BlockOption, BlockOptions
from hierremat.ilp.options import (
    heuristic_options, keep_all_decisions, make_option, recompute_all_decisions,
)

log = logging.getLogger("hierremat.ilp.test")


# ----------------------------------------------------------------------------- graphs


def random_graph(rng, n_fwd=None, n_bwd=None) -> BlockGraph:
    """A small joint graph with views, random nodes, branching and backward views."""
    n_fwd = n_fwd or int(rng.integers(3, 9))
    nodes = []
    fwd_names = ["x"]
    storage_owner = {"x": "x"}
    for i in range(n_fwd):
        name = f"f{i}"
        if 0 < i < n_fwd - 1 and rng.random() < 0.2:  # a view of an earlier value
            base = fwd_names[int(rng.integers(0, len(fwd_names)))]
            nodes.append(GraphNode(name, "aten.view", "forward", (base,), 0, float(rng.integers(0, 2)), alias_of=base))
        else:
            k = 1 if len(fwd_names) == 1 or rng.random() < 0.6 else 2
            inputs = tuple(sorted(set(rng.choice(fwd_names[-4:], size=k).tolist()), key=fwd_names.index))
            nodes.append(
                GraphNode(
                    name,
                    "aten.op",
                    "forward",
                    inputs,
                    int(rng.integers(1, 12)),
                    float(rng.integers(1, 6)),
                    workspace_bytes=int(rng.integers(0, 4)) if rng.random() < 0.3 else 0,
                    random=bool(rng.random() < 0.15),
                )
            )
        fwd_names.append(name)
    out = fwd_names[-1]
    n_bwd = n_bwd or int(rng.integers(2, n_fwd + 2))
    bwd_names = ["dy"]
    for j in range(n_bwd):
        name = f"b{j}"
        reads = [bwd_names[-1]]
        if len(bwd_names) > 2 and rng.random() < 0.3:
            reads.append(bwd_names[int(rng.integers(0, len(bwd_names) - 1))])
        n_f = int(rng.integers(0, 3))
        # later backward nodes read earlier forward values (reverse order, loosely)
        hi = max(1, len(fwd_names) - int(j * len(fwd_names) / n_bwd))
        for _ in range(n_f):
            reads.append(fwd_names[int(rng.integers(max(0, hi - 4), hi))])
        reads = tuple(dict.fromkeys(reads))
        if j > 0 and rng.random() < 0.15:  # backward view of a forward value or of a gradient
            base = reads[-1]
            nodes.append(GraphNode(name, "aten.t", "backward", (base,), 0, 0.0, alias_of=base))
        else:
            nodes.append(
                GraphNode(name, "aten.grad", "backward", reads, int(rng.integers(1, 12)), float(rng.integers(1, 6)),
                          workspace_bytes=int(rng.integers(0, 4)) if rng.random() < 0.3 else 0)
            )
        bwd_names.append(name)
    # dx: the last backward node that is not a view
    dx = next(n.name for n in reversed(nodes) if n.phase == "backward" and not n.alias_of) if rng.random() < 0.8 else ""
    out_bytes = next(n.out_bytes for n in nodes if n.name == out) if out != "x" else 0
    return BlockGraph(tuple(nodes), "x", int(rng.integers(1, 12)), out, "dy", max(out_bytes, 1), dx)


def transformer_block(seq=64, d=32, heads=4, rng=None) -> BlockGraph:
    """A synthetic GPT-2-like decoder block at the ATen level: ~120 forward / ~150 backward
    nodes, views, dropouts, residual branches; gradients mirror the forward."""
    rng = rng or np.random.default_rng(0)
    B = 4  # bytes per element
    act = seq * d * B
    att = heads * seq * seq * B
    nodes = []
    fwd = []

    def F(name, inputs, nbytes, t=None, view=False, random=False, ws=0):
        nodes.append(
            GraphNode(
                name, "aten.f", "forward", tuple(inputs), 0 if view else nbytes,
                (1e-6 if view else float(t if t is not None else 1e-5 * (1 + nbytes / act))),
                workspace_bytes=ws, random=random, alias_of=inputs[0] if view else "",
            )
        )
        fwd.append(name)
        return name

    def layernorm(p, x):
        mu = F(f"{p}_mean", [x], seq * B)
        xc = F(f"{p}_sub", [x, mu], act)
        var = F(f"{p}_var", [xc], seq * B)
        rs = F(f"{p}_rsqrt", [var], seq * B)
        xn = F(f"{p}_mul", [xc, rs], act)
        sc = F(f"{p}_scale", [xn], act)
        return F(f"{p}_shift", [sc], act)

    def linear(p, x, out_mult, in_mult=1):
        c = F(f"{p}_cast", [x], act * in_mult // 2)  # autocast copy of the input
        v = F(f"{p}_view", [c], 0, view=True)
        mm = F(f"{p}_mm", [v], act * out_mult // 2, t=1e-4 * out_mult)
        vb = F(f"{p}_view2", [mm], 0, view=True)
        b = F(f"{p}_bias", [vb], act * out_mult // 2)
        return F(f"{p}_upcast", [b], act * out_mult)

    x = "x"
    h = layernorm("ln1", x)
    qkv = linear("qkv", h, 3)
    parts = []
    for nm in ("q", "k", "v"):
        s = F(f"split_{nm}", [qkv], 0, view=True)
        v = F(f"{nm}_view", [s], 0, view=True)
        t = F(f"{nm}_perm", [v], 0, view=True)
        parts.append(F(f"{nm}_cont", [t], act))
    q, k, v = parts
    kt = F("k_t", [k], 0, view=True)
    sc = F("scores", [q, kt], att, t=2e-4)
    sc2 = F("scale", [sc], att)
    msk = F("mask", [sc2], att)
    mx = F("amax", [msk], heads * seq * B)
    sub = F("sm_sub", [msk, mx], att)
    ex = F("sm_exp", [sub], att)
    sm = F("sm_sum", [ex], heads * seq * B)
    pr = F("sm_div", [ex, sm], att)
    dr = F("attn_drop", [pr], att, random=True)
    ctx = F("ctx", [dr, v], act, t=2e-4)
    cp = F("ctx_perm", [ctx], 0, view=True)
    cc = F("ctx_cont", [cp], act)
    cv = F("ctx_view", [cc], 0, view=True)
    o = linear("proj", cv, 1)
    od = F("resid_drop1", [o], act, random=True)
    r1 = F("resid1", [x, od], act)
    h2 = layernorm("ln2", r1)
    fc = linear("fc", h2, 4)
    # gelu (tanh approximation, decomposed)
    g = fc
    for i, nm in enumerate(["pow", "mul1", "add1", "mul2", "tanh", "add2", "mul3", "mul4"]):
        g = F(f"gelu_{nm}", [g] + ([fc] if nm in ("add1", "mul4") else []), act * 4)
    p2 = linear("proj2", g, 1, in_mult=4)
    od2 = F("resid_drop2", [p2], act, random=True)
    y = F("resid2", [r1, od2], act)
    # a second, smaller MLP branch (adapter) to reach GPT-2's ATen node count
    for i in range(3):
        ha = layernorm(f"ln_a{i}", y)
        a = linear(f"ad{i}", ha, 1)
        a = F(f"ad_relu{i}", [a], act)
        y = F(f"ad_res{i}", [y, a], act)
    y2 = F("out_view", [y], 0, view=True)
    y3 = F("out", [y2], act)
    # backward: mirror the forward in reverse; every non-view forward node gets 1-2 nodes
    bwd = []
    prev = "dy"

    def Bk(name, inputs, nbytes, t=2e-5, view=False):
        nodes.append(GraphNode(name, "aten.b", "backward", tuple(dict.fromkeys(inputs)), 0 if view else nbytes, t,
                               alias_of=inputs[0] if view else ""))
        bwd.append(name)
        return name

    fnodes = {n.name: n for n in nodes if n.phase == "forward"}
    grads = {"out": "dy"}
    for name in reversed(fwd):
        n = fnodes[name]
        gout = grads.get(name)
        if gout is None:
            continue
        if n.alias_of:
            grads[n.inputs[0]] = Bk(f"g_{name}", [gout], 0, view=True) if name.endswith("perm") else gout
            continue
        saved = [i for i in n.inputs if i != "x" or name == "ln1_mean"]
        if n.random:
            saved = [name]
        if name.startswith("pad_cast"):
            saved = []
        g1 = Bk(f"g_{name}", [gout] + saved[:2], max(fnodes[i].out_bytes if i in fnodes else act for i in n.inputs))
        for j, i in enumerate(n.inputs):
            if i in grads:  # accumulate a second gradient of i
                grads[i] = Bk(f"acc_{name}_{i}", [grads[i], g1], fnodes[i].out_bytes if i in fnodes else act)
            else:
                grads[i] = g1 if j == 0 else Bk(f"g_{name}_{j}", [g1] + saved[:1], fnodes[i].out_bytes if i in fnodes else act)
        if name.endswith("_mm"):
            Bk(f"gw_{name}", [gout] + saved[:1], 4 * d * d * 4)  # weight gradient (freed at once)
    dx = grads["x"]
    return BlockGraph(tuple(nodes), "x", act, "out", "dy", act, dx)


# ----------------------------------------------------------------------------- exhaustive search


def brute_force(st, kept_budget, peak_budget):
    res = brute_force_schedule(st, kept_budget, peak_budget)
    return None if res is None else res[0]


def brute_force_schedule(st, kept_budget, peak_budget):
    """Least total time over every schedule of the family (module docstring of
    hierremat.ilp.formulation) with retained bytes <= kept_budget and peak <= peak_budget,
    by a DP over stages whose state is the set of present values. Written from the
    family's definition, independently of the ILP's matrices. None when infeasible."""
    cg = st.cg
    G = cg.groups
    b = [g.out_bytes for g in G]
    y, n, K = cg.out_group, len(G), st.K
    bx, dy = b[0], cg.dy_bytes
    best_total, best_dec = math.inf, None
    optional = [g for g in st.useful[0] if g != y] if K else []
    # a group no forward group reads, possibly needed in the backward, neither y nor random, is
    # computed in the forward only if kept
    deferred = {g for g in optional if not G[g].random and not any(g in G[h].inputs for h in range(g + 1, n))}
    fixed = sum(G[g].time for g in range(n) if g not in deferred) + sum(nd.time for nd in cg.bwd)

    def fwd_peak(S):
        live, peak = {}, bx + (G[0].peak_extra if G[0].steps else 0)
        for j in range(1, n):
            if j not in deferred or j in S:  # an unkept deferred group is not computed here
                peak = max(peak, bx + sum(live.values()) + G[j].peak_extra)
                live[j] = b[j]
            for g in list(live):
                if cg.fwd_last_use[g] <= j and g != y and g not in S:
                    del live[g]
        return max(peak, bx + sum(live.values()))

    def between_ok(lo, hi, present, pin):
        for t in range(lo, hi):
            m = dy + st.bwd_live_before[t] + pin + sum(b[g] for g in present) + cg.bwd[t].out_bytes + cg.bwd[t].workspace_bytes
            if m > peak_budget:
                return False
        return True

    for px in ([False, True] if st.x_needed else [False]):
        for py in ([False, True] if st.y_needed else [False]):
            pin = bx * px + b[y] * py
            for r in range(len(optional) + 1):
                for S in itertools.combinations(optional, r):
                    S = frozenset(S)
                    kept = sum(b[g] for g in S)
                    if kept + pin > kept_budget or fwd_peak(S) > peak_budget or dy + kept + pin > peak_budget:
                        continue
                    first = cg.stages[0] if K else len(cg.bwd)
                    if not between_ok(0, first, S, pin):
                        continue
                    states = {S: (sum(G[g].time for g in S & deferred), ())}
                    for k in range(K):
                        t = cg.stages[k]
                        nxt_t = cg.stages[k + 1] if k + 1 < K else len(cg.bwd)
                        new_states = {}
                        base = dy + st.bwd_live_before[t] + pin
                        cone = [g for g in st.cone[k] if not (g == y and py)]
                        for A, (tm, path) in states.items():
                            if not all(g in A or (g == y and py) for g in st.forced[k]):
                                continue
                            cand = [g for g in cone if g not in A]
                            for rr in range(len(cand) + 1):
                                for R in itertools.combinations(cand, rr):
                                    ok, present, rtime = True, set(A), 0.0
                                    for j in R:  # ascending: topological
                                        if not all((h == 0 and px) or (h == y and py) or h in present for h in G[j].inputs):
                                            ok = False
                                            break
                                        m = base + sum(b[g] for g in present) + G[j].peak_extra
                                        if m > peak_budget:
                                            ok = False
                                            break
                                        present.add(j)
                                        rtime += G[j].time
                                    if not ok:
                                        continue
                                    if not all((h == 0 and px) or (h == y and py) or h in present for h in cg.bwd[t].fwd_reads):
                                        continue
                                    if base + sum(b[g] for g in present) + cg.bwd[t].out_bytes + cg.bwd[t].workspace_bytes > peak_budget:
                                        continue
                                    nxt_useful = [g for g in present if k + 1 < K and g in st.useful[k + 1] and not (g == y and py)]
                                    for ra in range(len(nxt_useful) + 1):
                                        for A2 in itertools.combinations(nxt_useful, ra):
                                            A2 = frozenset(A2)
                                            if not between_ok(t + 1, nxt_t, A2, pin):
                                                continue
                                            v = tm + rtime
                                            if v < new_states.get(A2, (math.inf,))[0]:
                                                new_states[A2] = (v, path + ((frozenset(R), A2),))
                        states = new_states
                    for v, path in states.values():
                        if fixed + v < best_total:
                            best_total = fixed + v
                            best_dec = Decisions(S, px, py, tuple(R for R, _ in path), (S,) + tuple(A for _, A in path[:-1]))
    return None if best_total == math.inf else (best_total, best_dec)


def with_in_place(graph: BlockGraph, rng) -> BlockGraph:
    """``graph`` with some nodes made in-place results (hierremat.blocks.variants.in_place's
    conditions on the graph): a node overwrites one of its inputs where that is a value of
    its own phase owning its storage, of the node's size, neither the output nor dx, with no
    views, and read by no other node (backward: by none after it); in the forward, the node's
    other inputs come before that value."""
    nodes = list(graph.nodes)
    readers: dict[str, list] = {}
    for n in nodes:
        for i in n.inputs:
            readers.setdefault(i, []).append(n.name)
    viewed = {n.alias_of for n in nodes if n.alias_of}
    position = {n.name: k for k, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    for k, n in enumerate(nodes):
        if n.alias_of or n.random or not n.inputs or rng.random() < 0.4:
            continue
        for name in n.inputs:
            a = by_name.get(name)
            if a is None or a.phase != n.phase or a.alias_of or a.in_place or a.out_bytes != n.out_bytes:
                continue
            others = [r for r in readers.get(a.name, []) if r != n.name]
            if n.phase == "forward" and others or any(position[r] > k for r in others):
                continue
            if a.name in viewed or a.name in (graph.output_name, graph.input_grad_name):
                continue
            if n.phase == "forward" and any(position[i] > position[a.name] for i in n.inputs if i in position and i != name):
                continue
            nodes[k] = GraphNode(n.name, n.op + "_", n.phase, n.inputs, 0, n.time, n.workspace_bytes, False, a.name, True)
            viewed.add(a.name)
            by_name[n.name] = nodes[k]
            break
    return BlockGraph(tuple(nodes), graph.input_name, graph.input_bytes, graph.output_name, graph.output_grad_name,
                      graph.output_grad_bytes, graph.input_grad_name)


def small_graphs(seed, count, cut_matters=False, in_place=False):
    """``count`` random graphs small enough for the exhaustive search; ``cut_matters``: only
    graphs whose cones cut at dropouts differ from the full ones (structure() as patched);
    ``in_place``: only graphs with in-place results, one in the forward at least
    (:func:`with_in_place`)."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < count:
        g = random_graph(rng)
        if in_place:
            g = with_in_place(g, rng)
            if not any(n.in_place and n.phase == "forward" for n in g.nodes):
                continue
        st = structure(compact(g))
        # keep the exhaustive search small
        if not (sum(len(c) for c in st.cone) <= 14 and len(st.useful[0]) <= 7 if st.K else True):
            continue
        if cut_matters:
            limit, formulation.FULL_CONE_LIMIT = formulation.FULL_CONE_LIMIT, 10**9
            try:
                if structure(compact(g)).cone == st.cone:
                    continue
            finally:
                formulation.FULL_CONE_LIMIT = limit
        out.append(g)
    return out


# ----------------------------------------------------------------------------- tests


@pytest.fixture(params=["full cones", "cones cut at dropouts"])
def cones(request, monkeypatch):
    """Both cone forms: the full ones, and (as for a graph over FULL_CONE_LIMIT) cut at groups
    that read a random value."""
    if request.param != "full cones":
        monkeypatch.setattr(formulation, "FULL_CONE_LIMIT", -1)
    return request.param


def test_cut_cones_stop_at_readers_of_random_values(monkeypatch):
    """x -> a -> r (random) ; a, r -> d (reads r: a dropout's output from its mask) -> e;
    a stage reading e may recompute d only from a present a: a enters its need, not its cone."""
    nodes = (
        GraphNode("a", "aten.op", "forward", ("x",), 4, 1.0),
        GraphNode("r", "aten.bits", "forward", ("a",), 1, 1.0, random=True),
        GraphNode("d", "aten.masked", "forward", ("a", "r"), 8, 1.0),
        GraphNode("e", "aten.op", "forward", ("d",), 16, 1.0),
        GraphNode("g", "aten.grad", "backward", ("dy", "e"), 4, 1.0),
    )
    graph = BlockGraph(nodes, "x", 4, "e", "dy", 16, "g")
    full = structure(compact(graph))
    monkeypatch.setattr(formulation, "FULL_CONE_LIMIT", -1)
    cut = structure(compact(graph))
    names = lambda st, groups: {st.cg.groups[g].name for g in groups}
    assert names(full, full.cone[0]) == {"a", "d", "e"}
    assert names(cut, cut.cone[0]) == {"d", "e"} and "a" in names(cut, cut.need[0])
    res = BlockIlp(graph, cut).solve(kept=5, peak=10**6, backend="highs")  # keep a and r, recompute d and e
    assert res.optimal and names(cut, res.decisions.kept) == {"a", "r"}


def test_an_unkept_value_no_forward_op_reads_is_left_to_the_backward():
    """x -> a -> y, and m = mask(a) read only by the backward (a ReLU's packed mask): kept, m is
    computed in the forward; unkept, only where the backward needs it, once."""
    nodes = (
        GraphNode("a", "aten.relu", "forward", ("x",), 32, 1.0),
        GraphNode("m", "hierremat.above_bits", "forward", ("a",), 1, 3.0),
        GraphNode("y", "aten.op", "forward", ("a",), 32, 1.0),
        GraphNode("g", "aten.grad", "backward", ("dy", "a"), 32, 1.0),
        GraphNode("dx", "hierremat.where_bits", "backward", ("g", "m"), 32, 1.0),
    )
    graph = BlockGraph(nodes, "x", 32, "y", "dy", 32, "dx")
    ilp = BlockIlp(graph)
    st = ilp.structure
    assert {st.cg.groups[g].name for g in st.deferred} == {"m"}
    unbounded = ilp.solve(backend="highs")  # keeping the 1-byte mask costs its one forward pass either way
    assert unbounded.objective == pytest.approx(7.0)
    tight = ilp.solve(kept=32, backend="highs")  # room for a only: m recomputed from it, never in the forward
    assert tight.optimal and tight.objective == pytest.approx(7.0) == brute_force(st, 32, 10**6)
    option = make_option(st, tight.decisions, "tight", optimal=True)
    assert ("compute", "m") not in option.fwd_ops and ("compute", "m") in option.bwd_ops
    sim = simulate_option(graph, option)
    assert sim.fwd_time == pytest.approx(2.0) and sim.fwd_time == pytest.approx(option.fwd_time)
    assert sim.bwd_time == pytest.approx(5.0) and sim.fwd_peak_bytes == option.fwd_peak_bytes


def _check_against_exhaustive_search(graphs):
    for graph in graphs:
        ilp = BlockIlp(graph)
        st = ilp.structure
        kmin = ilp.solve(objective="kept", backend="highs")
        assert kmin.optimal
        for K in sorted({int(kmin.objective), int(kmin.objective) + 5, 10**6}):
            pmin = ilp.solve(kept=K, objective="peak", backend="highs")
            assert pmin.optimal
            p_lo = int(pmin.objective)
            assert brute_force(st, K, p_lo - 1) is None
            assert ilp.solve(kept=K, peak=p_lo - 1, backend="highs").status == "infeasible"
            for P in (p_lo, p_lo + 3, p_lo + 10, 10**6):
                res = ilp.solve(kept=K, peak=P, backend="highs")
                bf = brute_force(st, K, P)
                assert res.optimal and bf is not None
                assert res.objective == pytest.approx(bf, rel=1e-9, abs=1e-9), (graph, K, P)
                ev = res.evaluation
                assert ev.retained_bytes <= K and max(ev.fwd_peak, ev.bwd_peak) <= P
        if int(kmin.objective) > 0:
            assert ilp.solve(kept=int(kmin.objective) - 1, backend="highs").status == "infeasible"
            assert brute_force(st, int(kmin.objective) - 1, 10**6) is None


@pytest.mark.parametrize("seed", range(4))
def test_ilp_optimum_equals_exhaustive_search(seed, cones):
    _check_against_exhaustive_search(small_graphs(seed, 5, cut_matters=cones != "full cones"))


@pytest.mark.parametrize("seed", range(2))
def test_ilp_optimum_equals_exhaustive_search_with_in_place_results(seed):
    _check_against_exhaustive_search(small_graphs(200 + seed, 5, in_place=True))


def test_infeasible_is_a_status():
    graph = small_graphs(11, 1)[0]
    ilp = BlockIlp(graph)
    res = ilp.solve(kept=0, peak=0, backend="highs")
    assert res.status == "infeasible" and res.decisions is None and res.objective is None
    res = ilp.solve(kept=-1, backend="highs")
    assert res.status == "infeasible"


def _check_simulator(graphs):
    for graph in graphs:
        menu = solve_menu(graph, backend="highs")
        for opt in menu:
            sim = simulate_option(graph, opt)
            assert sim.fwd_time == pytest.approx(opt.fwd_time, rel=1e-12)
            assert sim.bwd_time == pytest.approx(opt.bwd_time, rel=1e-12)
            assert sim.fwd_peak_bytes == opt.fwd_peak_bytes
            assert sim.bwd_peak_bytes == opt.bwd_peak_bytes
            assert sim.kept_bytes == opt.kept_bytes
            json.dumps(opt.to_dict())
            assert BlockOption.from_dict(json.loads(json.dumps(opt.to_dict()))) == opt


@pytest.mark.parametrize("seed", range(3))
def test_simulator_reproduces_predictions(seed, cones):
    _check_simulator(small_graphs(100 + seed, 6, cut_matters=cones != "full cones"))


@pytest.mark.parametrize("seed", range(2))
def test_simulator_reproduces_predictions_with_in_place_results(seed):
    """The simulator counts an in-place result in its argument's storage (GraphNode.alias_of),
    the ILP as a member of the argument's group: both give the same peaks."""
    _check_simulator(small_graphs(300 + seed, 6, in_place=True))


@pytest.mark.parametrize("seed", range(3))
def test_menu_is_pareto_and_contains_keep_all(seed):
    for graph in small_graphs(200 + seed, 6):
        menu = solve_menu(graph, backend="highs")
        st = structure(compact(graph))
        keep_all = make_option(st, keep_all_decisions(st), "keep_all", optimal=False)
        assert any(o.to_option_costs() == keep_all.to_option_costs() or o.dominates(keep_all) for o in menu)
        assert any(o.name == "keep_all" or o.dominates(keep_all) for o in menu)
        for a in menu:
            for b in menu:
                if a is not b:
                    assert not b.dominates(a), (a.name, b.name)
        # every option's costs are acceptable to the chain DP
        out = graph.node(graph.output_name).out_bytes
        ChainCosts(
            activation_bytes=(graph.input_bytes, out),
            stages=(StageCosts(1.0, out, menu.to_option_costs()),),
            input_requires_grad=bool(graph.input_grad_name),
        )
        assert BlockOptions.from_dict(json.loads(json.dumps(menu.to_dict()))) == menu


def test_trivial_options_are_in_the_family():
    for graph in small_graphs(300, 8):
        st = structure(compact(graph))
        for d in (keep_all_decisions(st), recompute_all_decisions(st)):
            ev = evaluate(st, d)
            assert ev.valid, ev.why
            opt = make_option(st, d, "t", optimal=False)
            sim = simulate_option(graph, opt)
            assert (sim.fwd_peak_bytes, sim.bwd_peak_bytes) == (opt.fwd_peak_bytes, opt.bwd_peak_bytes)


def test_selective_options_are_schedules_between_keep_all_and_recompute_all():
    """The heuristic options (the coarser formulation) keep more than recompute-all and less than
    keep-all, are schedules of the family, and replay as predicted; the ILP's menu is never worse."""
    count = 0
    for graph in small_graphs(310, 8) + [transformer_block(seq=32, d=16)]:
        st = structure(compact(graph))
        keep_all = make_option(st, keep_all_decisions(st), "keep_all", optimal=False)
        recompute_all = make_option(st, recompute_all_decisions(st), "recompute_all", optimal=False)
        heuristic = heuristic_options(st)
        for opt in heuristic:
            count += 1
            assert recompute_all.kept_bytes <= opt.kept_bytes <= keep_all.kept_bytes
            assert keep_all.total_time <= opt.total_time <= recompute_all.total_time + 1e-12
            sim = simulate_option(graph, opt)
            assert (sim.fwd_peak_bytes, sim.bwd_peak_bytes, sim.kept_bytes) == (
                opt.fwd_peak_bytes, opt.bwd_peak_bytes, opt.kept_bytes)
        if len(graph.nodes) < 60:  # (the transformer block's full sweep takes a minute)
            ilp_menu = solve_menu(graph, backend="highs")
            for opt in heuristic:  # in the menu, or dominated by an option of it
                assert any(o.dominates(opt) for o in ilp_menu), opt.name
    assert count >= 5


def test_a_block_too_large_or_out_of_time_gets_the_coarse_menu(monkeypatch):
    graph = max(small_graphs(320, 6), key=lambda g: len(g.nodes))
    full = solve_menu(graph, backend="highs", deadline=time.perf_counter() + 600)
    assert full.coarse == ""
    solves = solve_count()
    late = solve_menu(graph, backend="highs", deadline=time.perf_counter() - 1.0)
    assert solve_count() == solves and "deadline" in late.coarse
    monkeypatch.setattr(options_module, "MAX_ILP_VARIABLES", 1)
    large = solve_menu(graph, backend="highs")
    assert solve_count() == solves and "variables" in large.coarse
    for menu in (late, large):
        assert "keep_all" in {o.name for o in menu}
        for opt in menu:
            sim = simulate_option(graph, opt)
            assert (sim.fwd_peak_bytes, sim.bwd_peak_bytes) == (opt.fwd_peak_bytes, opt.bwd_peak_bytes)
        # the ILP's menu reaches the same peaks or lower, never higher
        assert min(max(o.fwd_peak_bytes, o.bwd_peak_bytes) for o in full) <= min(
            max(o.fwd_peak_bytes, o.bwd_peak_bytes) for o in menu)


def test_a_sweep_stopped_by_the_deadline_keeps_what_it_found(monkeypatch):
    """The planning deadline on a clock that each solve moves 10 s on (so that the machine's load cannot decide
    how many solves fit): two solves, a third with the 5 s left as its limit, then the deadline; the menu says
    so and keeps the ILP's options."""
    clock = [1000.0]
    monkeypatch.setattr(planning_clock, "now", lambda: clock[0])
    texts = []

    def solved(text):
        texts.append(text)
        clock[0] += 10.0

    graph = transformer_block(seq=32, d=16)
    menu = solve_menu(graph, backend="highs", ilp=BlockIlp(graph), deadline=clock[0] + 25.0, time_limit=30.0,
                      sweep_limit=100.0, progress=solved)
    assert len(texts) == 3, texts
    assert "deadline" in menu.coarse and menu.cut_by_deadline and any(o.name.startswith("ilp_") for o in menu)
    for opt in menu:
        assert opt.optimal or opt.mip_gap is None or opt.mip_gap >= 0.0


def test_a_sweep_keeps_to_its_own_time_and_solves_every_rows_fastest_schedule_first(monkeypatch):
    """MENU_SWEEP_LIMIT bounds a menu without a planning deadline: the menu says so, is cached
    (not cut by a deadline), and holds a fastest-schedule option per kept-bytes row, which are
    solved before any peak budget. On a clock each solve moves 1 s on (the machine's load cannot
    decide how many solves fit): a 6.5 s sweep stops after its seventh solve."""
    clock = [1000.0]
    monkeypatch.setattr(planning_clock, "now", lambda: clock[0])
    texts = []

    def solved(text):
        texts.append(text)
        clock[0] += 1.0

    graph = transformer_block(seq=32, d=16)
    ilp = BlockIlp(graph)
    real_solve = ilp.solve
    ilp.solve = lambda time_limit, **budgets: real_solve(time_limit=600.0, **budgets)  # (none stopped by the load)
    menu = solve_menu(graph, backend="highs", ilp=ilp, sweep_limit=6.5, time_limit=2.0, progress=solved)
    assert len(texts) == 7, texts
    assert "took its 6.5 s" in menu.coarse and not menu.cut_by_deadline
    first_peak = next((k for k, t in enumerate(texts) if "peak=" in t), len(texts))
    assert all("peak=" not in t for t in texts[:first_peak])
    assert all("peak=" in t for t in texts[first_peak:])
    assert any(o.name.startswith("ilp_") for o in menu)


def test_highs_and_gurobi_agree():
    pytest.importorskip("gurobipy")
    for graph in small_graphs(400, 6):
        ilp = BlockIlp(graph)
        kmin = ilp.solve(objective="kept", backend="highs")
        for K in (int(kmin.objective), 10**6):
            pmin = ilp.solve(kept=K, objective="peak", backend="highs")
            for P in (int(pmin.objective), int(pmin.objective) + 4, 10**6):
                h = ilp.solve(kept=K, peak=P, backend="highs")
                g = ilp.solve(kept=K, peak=P, backend="gurobi")
                assert g.backend == "gurobi"
                assert h.status == g.status == "optimal"
                assert h.objective == pytest.approx(g.objective, rel=1e-9)
            assert ilp.solve(kept=K, peak=int(pmin.objective) - 1, backend="gurobi").status == "infeasible"


def test_solve_count_counts_solver_calls():
    graph = small_graphs(500, 1)[0]
    ilp = BlockIlp(graph)
    before = solve_count()
    ilp.solve(backend="highs")
    ilp.solve(kept=0, backend="highs")
    assert solve_count() == before + 2


def test_transformer_block_menu(caplog):
    graph = transformer_block()
    n_f, n_b = len(graph.forward_nodes), len(graph.backward_nodes)
    assert 100 <= n_f <= 140 and 120 <= n_b <= 180
    t0 = time.perf_counter()
    ilp = BlockIlp(graph)
    menu = solve_menu(graph, ilp=ilp, backend="highs", time_limit=3)
    seconds = time.perf_counter() - t0
    log.warning(
        "synthetic transformer block: %d fwd / %d bwd nodes -> %d groups, %d stages, %d variables, "
        "%d constraints; menu of %d options from %d solves in %.2fs",
        n_f, n_b, ilp.compact.n, ilp.structure.K, ilp.model.n_vars, ilp.model.n_constraints,
        len(menu), menu.n_solves, seconds,
    )
    assert len(menu) >= 2
    for opt in menu:
        sim = simulate_option(graph, opt)
        assert sim.bwd_peak_bytes == opt.bwd_peak_bytes and sim.fwd_peak_bytes == opt.fwd_peak_bytes
        assert sim.bwd_time == pytest.approx(opt.bwd_time, rel=1e-9)
    assert min(o.kept_bytes for o in menu) < max(o.kept_bytes for o in menu)


@pytest.mark.parametrize("backend", ["highs", "gurobi"])
def test_solvers_write_nothing_to_stdout_or_stderr(backend, capfd, caplog, monkeypatch):
    """What a solver's native code prints during a solve reaches the log, never the terminal."""
    import os

    from hierremat.ilp import solve as solve_module

    if backend == "gurobi":
        pytest.importorskip("gurobipy")
    real = getattr(solve_module, f"_solve_{backend}")

    def noisy(*args, **kwargs):
        os.write(1, f"{backend} native stdout\n".encode())
        os.write(2, f"{backend} native stderr\n".encode())
        return real(*args, **kwargs)

    monkeypatch.setattr(solve_module, f"_solve_{backend}", noisy)
    with caplog.at_level(logging.DEBUG, logger="hierremat.ilp"):
        solve_menu(small_graphs(600, 1)[0], backend=backend, time_limit=3)
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    assert f"{backend} native stdout" in caplog.text and f"{backend} native stderr" in caplog.text


def test_native_solver_output_goes_to_logging(capfd, caplog):
    import os

    from hierremat.ilp.quiet import solver_output_to_log

    with caplog.at_level(logging.DEBUG, logger="hierremat.ilp"), solver_output_to_log(log, "HiGHS"):
        os.write(1, b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\n")
        os.write(2, b"a native warning\n")
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    assert "HiGHS: HighsMipSolverData::transformNewIntegerFeasibleSolution" in caplog.text
    assert "HiGHS: a native warning" in caplog.text


def test_ilp_does_not_import_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import hierremat.ilp, hierremat.ilp.formulation, hierremat.ilp.solve, hierremat.ilp.options\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
