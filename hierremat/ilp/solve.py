"""Solving the block ILP: HiGHS through ``scipy.optimize.milp`` (default), or Gurobi.

The matrices are built once per graph (``BlockIlp``); every solve only changes the
objective vector and the bounds of the budget columns (see ``formulation.IlpModel``).

Infeasible budgets are a status ('infeasible'), never an exception. A solve that hits
its time limit keeps its best incumbent and is marked suboptimal ('time_limit'); with
no incumbent its decisions are None.

Gurobi is used when ``gurobipy`` is importable and the model fits the size-limited
license of the pip wheel (2000 variables and 2000 constraints, counted after splitting
two-sided rows); a Gurobi error (license, size, a broken install) falls back to HiGHS with
one warning, and Gurobi is not tried again in this process.

A decoded solution that is not a schedule of the formulation's family (a solver or
formulation bug) is never returned as one: the result has status 'rejected' and says why.

Neither solver writes to the terminal: what their native code prints goes to this
module's logger at DEBUG (hierremat.ilp.quiet).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np

from ..plans.block_graph import BlockGraph
from ..session import current_session
from .formulation import (
    CompactGraph, Decisions, Evaluation, IlpModel, Structure, build_model, compact, evaluate, structure,
)
from .quiet import solver_output_to_log

log = logging.getLogger("hierremat.ilp")

GUROBI_SIZE_LIMIT = 2000
DEFAULT_TIME_LIMIT = 30.0


def solve_count() -> int:
    """Number of solver invocations in the current planner session (any backend; hierremat.session)."""
    return current_session().ilp_solves


@dataclass(frozen=True)
class IlpResult:
    """Outcome of one solve.

    status: 'optimal' | 'time_limit' | 'infeasible' | 'rejected' (the solver's point is not a
        schedule of the family: a bug, explained by ``problem``; no decisions).
    objective: value of the chosen objective from the decoded schedule, exactly:
        total time in seconds (forward + recomputation + backward) for 'time', bytes for
        'peak' / 'kept'; None without a solution.
    gap: relative MIP gap reported by the solver (0 when proven optimal, None if unknown).
    decisions / evaluation: the solved schedule and its exact costs (None without one).
    """

    status: str
    objective: float | None
    gap: float | None
    solve_seconds: float
    backend: str
    decisions: Decisions | None = None
    evaluation: Evaluation | None = None
    problem: str | None = None

    @property
    def optimal(self) -> bool:
        return self.status == "optimal"

    @property
    def has_solution(self) -> bool:
        return self.decisions is not None


def _gap(m) -> float:
    """Gurobi's relative MIP gap; 0 for a model Gurobi solved without branching (it then
    has no MIPGap attribute, e.g. after presolve turned it into an LP)."""
    try:
        return float(m.MIPGap)
    except AttributeError:
        return 0.0


def _gurobi_available() -> bool:
    try:
        import gurobipy  # noqa: F401
    except Exception:  # ImportError, or a broken install
        return False
    return True


def _gurobi_rows(model: IlpModel) -> int:
    lb, ub = model.row_lb, model.row_ub
    return int(np.sum(np.isfinite(lb)) + np.sum(np.isfinite(ub)) - np.sum(np.isfinite(lb) & np.isfinite(ub) & (lb == ub)))


def _solve_highs(model: IlpModel, c, lb, ub, time_limit, mip_rel_gap):
    from scipy.optimize import Bounds, LinearConstraint, milp

    res = milp(
        c,
        integrality=model.integrality(),
        bounds=Bounds(lb, ub),
        constraints=LinearConstraint(model.A, model.row_lb, model.row_ub),
        options={"time_limit": float(time_limit), "mip_rel_gap": mip_rel_gap, "presolve": True},
    )
    gap = getattr(res, "mip_gap", None)
    if res.status == 0:
        return "optimal", res.x, gap
    if res.status == 2:
        return "infeasible", None, None
    if res.status == 1:
        return "time_limit", res.x, gap
    raise RuntimeError(f"HiGHS failed on the block ILP: status {res.status}, {res.message}")


def _solve_gurobi(model: IlpModel, c, lb, ub, time_limit, mip_rel_gap):
    import gurobipy as gp
    from gurobipy import GRB

    env = gp.Env(empty=True)
    env.setParam("OutputFlag", 0)
    env.start()
    try:
        m = gp.Model(env=env)
        m.Params.TimeLimit = float(time_limit)
        m.Params.MIPGap = mip_rel_gap
        m.Params.Threads = 1
        vtype = np.where(model.integrality() == 1, GRB.BINARY, GRB.CONTINUOUS)
        ub_g = np.where(np.isinf(ub), GRB.INFINITY, ub)
        x = m.addMVar(model.n_vars, lb=lb, ub=ub_g, vtype=vtype)
        A = model.A.tocsr()
        fin_ub = np.isfinite(model.row_ub)
        fin_lb = np.isfinite(model.row_lb)
        eq = fin_ub & fin_lb & (model.row_lb == model.row_ub)
        if np.any(fin_ub & ~eq):
            idx = np.flatnonzero(fin_ub & ~eq)
            m.addMConstr(A[idx], x, "<", model.row_ub[idx])
        if np.any(fin_lb & ~eq):
            idx = np.flatnonzero(fin_lb & ~eq)
            m.addMConstr(A[idx], x, ">", model.row_lb[idx])
        if np.any(eq):
            idx = np.flatnonzero(eq)
            m.addMConstr(A[idx], x, "=", model.row_ub[idx])
        m.setObjective(c @ x, GRB.MINIMIZE)
        m.optimize()
        st = m.Status
        if st == GRB.OPTIMAL:
            return "optimal", np.array(x.X), _gap(m)
        if st in (GRB.INFEASIBLE, GRB.INF_OR_UNBD):
            return "infeasible", None, None
        if st == GRB.TIME_LIMIT:
            if m.SolCount > 0:
                return "time_limit", np.array(x.X), _gap(m)
            return "time_limit", None, None
        raise RuntimeError(f"Gurobi ended with status {st}")
    finally:
        try:
            m.dispose()
        except Exception:
            pass
        env.dispose()


def solve_model(
    model: IlpModel,
    *,
    kept: float | None = None,
    peak: float | None = None,
    recompute_time: float | None = None,
    objective: str = "time",
    time_limit: float = DEFAULT_TIME_LIMIT,
    backend: str = "auto",
    mip_rel_gap: float = 1e-9,
) -> IlpResult:
    """One solve of ``model`` under the budgets (bytes, bytes, seconds; None = unbounded).

    backend: 'auto' (Gurobi if installed and the model fits its license, else HiGHS),
    'highs' or 'gurobi' (falls back to HiGHS, logged, when Gurobi cannot solve it).
    """
    session = current_session()
    if backend not in ("auto", "highs", "gurobi"):
        raise ValueError(f"unknown backend {backend!r}")
    c = model.objective(objective)
    lb, ub = model.bounds(kept=kept, peak=peak, recompute_time=recompute_time)
    if any(v is not None and v < 0 for v in (kept, peak, recompute_time)):
        return IlpResult("infeasible", None, None, 0.0, "none")
    use = "highs"
    if backend in ("auto", "gurobi"):
        if not _gurobi_available():
            if backend == "gurobi":
                log.info("gurobipy is not installed; solving with HiGHS")
        elif session.gurobi_failure is not None:
            log.debug("Gurobi failed earlier in this session (%s); solving with HiGHS", session.gurobi_failure)
        elif model.n_vars > GUROBI_SIZE_LIMIT or _gurobi_rows(model) > GUROBI_SIZE_LIMIT:
            if backend == "gurobi":
                log.info(
                    "block ILP has %d variables / %d constraints, over the restricted Gurobi license (%d); using HiGHS",
                    model.n_vars,
                    _gurobi_rows(model),
                    GUROBI_SIZE_LIMIT,
                )
        else:
            use = "gurobi"
    t0 = time.perf_counter()
    session.ilp_solves += 1
    if use == "gurobi":
        try:
            with solver_output_to_log(log, "Gurobi"):
                status, xs, gap = _solve_gurobi(model, c, lb, ub, time_limit, mip_rel_gap)
        except Exception as err:  # license / size errors are GurobiError; anything else too
            session.gurobi_failure = f"{type(err).__name__}: {err}"
            log.warning("Gurobi could not solve the block ILP (%s); using HiGHS for every block ILP of this "
                        "planner session", session.gurobi_failure)
            use = "highs"
            t0 = time.perf_counter()
    if use == "highs":
        with solver_output_to_log(log, "HiGHS"):
            status, xs, gap = _solve_highs(model, c, lb, ub, time_limit, mip_rel_gap)
    seconds = time.perf_counter() - t0
    if status == "optimal":
        gap = 0.0 if gap is None or not math.isfinite(gap) else float(gap)
    if xs is None:
        log.debug("block ILP: %s after %.3fs (%s)", status, seconds, use)
        return IlpResult(status, None, gap, seconds, use)
    dec = model.decode(xs)
    ev = evaluate(model.structure, dec)
    if not ev.valid:  # the decoded point must be in the family; anything else is a bug
        return IlpResult("rejected", None, gap, seconds, use, problem=f"the {use} solution is not a schedule: {ev.why}")
    value = {
        "time": ev.fwd_time + ev.bwd_time,
        "peak": max(ev.fwd_peak, ev.bwd_peak),
        "kept": ev.retained_bytes,
    }[objective]
    log.debug("block ILP: %s objective=%s in %.3fs (%s)", status, value, seconds, use)
    return IlpResult(status, float(value), gap, seconds, use, dec, ev)


class BlockIlp:
    """A BlockGraph compacted and turned into its ILP, ready for many solves.

    st: the graph's Structure, if already derived (``structure(compact(graph))``)."""

    def __init__(self, graph: BlockGraph, st: Structure | None = None):
        t0 = time.perf_counter()
        self.graph = graph
        self.structure: Structure = st if st is not None else structure(compact(graph))
        self.compact: CompactGraph = self.structure.cg
        self.model: IlpModel = build_model(self.structure)
        self.build_seconds = time.perf_counter() - t0
        log.debug(
            "block ILP for %d forward / %d backward nodes: %d groups, %d stages, %d variables, %d constraints (%.3fs)",
            len(graph.forward_nodes),
            len(graph.backward_nodes),
            self.compact.n,
            self.structure.K,
            self.model.n_vars,
            self.model.n_constraints,
            self.build_seconds,
        )

    def solve(self, kept: float | None = None, peak: float | None = None, **kw) -> IlpResult:
        """Fastest schedule with retained bytes <= kept and peak <= peak (see formulation)."""
        return solve_model(self.model, kept=kept, peak=peak, **kw)


def solve_block(graph: BlockGraph, kept: float | None = None, peak: float | None = None, **kw) -> IlpResult:
    """Build the ILP of ``graph`` and solve it once (see ``BlockIlp`` to reuse the model)."""
    return BlockIlp(graph).solve(kept, peak, **kw)
