"""Block options: the values a block's ILP produces and the planner and runtime consume. No torch.

A block option is one way to run a block's forward (with grad) and backward, as explicit op
lists over the block's graph (hierremat.plans.block_graph): which forward results are kept,
which are freed and recomputed, and when. hierremat.ilp solves for them (Checkmate's
formulation, backward-staged; see hierremat.ilp.formulation); hierremat.runtime runs them as
generated code; the chain DP sees each as an OptionCosts (hierremat.plans.costs).
"""

from __future__ import annotations

from dataclasses import dataclass

from .costs import OptionCosts

#: The two kinds of op in an option's op lists: ("compute", node name) and ("free", node name).
COMPUTE = "compute"
FREE = "free"


@dataclass(frozen=True)
class BlockOption:
    """One way to run a block's forward (with grad) and backward.

    fwd_ops / bwd_ops: ("compute" | "free", node name) in execution order. The forward
        phase starts with x in memory; the backward phase starts with dy, the kept
        values, x if pins_input and y (and its names) if pins_output.
    fwd_time / bwd_time: seconds (bwd includes recomputation).
    kept_bytes: retained from the end of the forward to the end of the backward, x and y
        not counted. fwd_peak_bytes: peak of the forward above its entry (x).
    bwd_peak_bytes: peak of the backward above its entry (pinned x, kept, pinned y, dy).
    input_grad_bytes: bytes of dx as the chain DP counts it (0 without dx).
    optimal: proven optimal by the ILP for (kept_budget, peak_budget); False for the
        trivial options and for solves stopped by the time limit.
    mip_gap: for an ILP option a solve's time limit stopped, the solver's relative MIP gap
        (how far from proven optimal its time may be; None where the solver did not say);
        0.0 for proven and trivial options.
    """

    name: str
    fwd_ops: tuple
    bwd_ops: tuple
    fwd_time: float
    bwd_time: float
    kept_bytes: int
    fwd_peak_bytes: int
    bwd_peak_bytes: int
    pins_input: bool
    pins_output: bool
    optimal: bool
    input_grad_bytes: int = 0
    kept_budget: int | None = None
    peak_budget: int | None = None
    mip_gap: float | None = 0.0

    @property
    def total_time(self) -> float:
        return self.fwd_time + self.bwd_time

    def to_option_costs(self) -> OptionCosts:
        return OptionCosts(
            fwd_time=self.fwd_time,
            bwd_time=self.bwd_time,
            kept_bytes=self.kept_bytes,
            fwd_overhead_bytes=self.fwd_peak_bytes,
            bwd_overhead_bytes=max(self.bwd_peak_bytes, self.input_grad_bytes),
            pins_output=self.pins_output,
            pins_input=self.pins_input,
            name=self.name,
            mip_gap=self.mip_gap,
            offloadable=True,
        )

    def dominates(self, other: "BlockOption") -> bool:
        """No worse in time, kept bytes, both DP overheads, and pins (fewer is better)."""
        a, b = self.to_option_costs(), other.to_option_costs()
        return (
            a.fwd_time + a.bwd_time <= b.fwd_time + b.bwd_time
            and a.kept_bytes <= b.kept_bytes
            and a.fwd_overhead_bytes <= b.fwd_overhead_bytes
            and a.bwd_overhead_bytes <= b.bwd_overhead_bytes
            and a.pins_input <= b.pins_input
            and a.pins_output <= b.pins_output
        )

    def to_dict(self) -> dict:
        """As JSON (the op lists as they are: tuples of pairs, written as arrays; shared, not copied, so that every
        plan holding a menu's dict of options re-costed from one solve holds one copy of their op lists)."""
        return {
            "name": self.name,
            "fwd_ops": self.fwd_ops,
            "bwd_ops": self.bwd_ops,
            "fwd_time": self.fwd_time,
            "bwd_time": self.bwd_time,
            "kept_bytes": self.kept_bytes,
            "fwd_peak_bytes": self.fwd_peak_bytes,
            "bwd_peak_bytes": self.bwd_peak_bytes,
            "pins_input": self.pins_input,
            "pins_output": self.pins_output,
            "optimal": self.optimal,
            "input_grad_bytes": self.input_grad_bytes,
            "kept_budget": self.kept_budget,
            "peak_budget": self.peak_budget,
            "mip_gap": self.mip_gap,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "BlockOption":
        return cls(
            name=d["name"],
            fwd_ops=tuple((str(a), str(b)) for a, b in d["fwd_ops"]),
            bwd_ops=tuple((str(a), str(b)) for a, b in d["bwd_ops"]),
            fwd_time=float(d["fwd_time"]),
            bwd_time=float(d["bwd_time"]),
            kept_bytes=int(d["kept_bytes"]),
            fwd_peak_bytes=int(d["fwd_peak_bytes"]),
            bwd_peak_bytes=int(d["bwd_peak_bytes"]),
            pins_input=bool(d["pins_input"]),
            pins_output=bool(d["pins_output"]),
            optimal=bool(d["optimal"]),
            input_grad_bytes=int(d.get("input_grad_bytes", 0)),
            kept_budget=None if d.get("kept_budget") is None else int(d["kept_budget"]),
            peak_budget=None if d.get("peak_budget") is None else int(d["peak_budget"]),
            mip_gap=None if d.get("mip_gap", 0.0) is None else float(d.get("mip_gap", 0.0)),
        )


@dataclass(frozen=True)
class BlockOptions:
    """The Pareto-pruned menu of one block graph.

    coarse: why the menu is not the ILP sweep's ("" when it is): the ILP was too large, or
        the planning deadline came before (part of) the sweep. Its options are then the
        trivial and heuristic ones, with whatever the ILP found in time.
    cut_by_deadline: the planning deadline stopped it (a later plan with more time would
        find more: such a menu is not cached).
    """

    options: tuple
    solve_seconds: float = 0.0
    n_solves: int = 0
    n_variables: int = 0
    n_constraints: int = 0
    coarse: str = ""
    cut_by_deadline: bool = False

    def __len__(self) -> int:
        return len(self.options)

    def __iter__(self):
        return iter(self.options)

    def by_name(self, name: str) -> BlockOption:
        for o in self.options:
            if o.name == name:
                return o
        raise KeyError(name)

    def to_option_costs(self) -> tuple:
        return tuple(o.to_option_costs() for o in self.options)

    def to_dict(self) -> dict:
        return {
            "options": [o.to_dict() for o in self.options],
            "solve_seconds": self.solve_seconds,
            "n_solves": self.n_solves,
            "n_variables": self.n_variables,
            "n_constraints": self.n_constraints,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "BlockOptions":
        return cls(
            options=tuple(BlockOption.from_dict(o) for o in d["options"]),
            solve_seconds=float(d.get("solve_seconds", 0.0)),
            n_solves=int(d.get("n_solves", 0)),
            n_variables=int(d.get("n_variables", 0)),
            n_constraints=int(d.get("n_constraints", 0)),
        )


@dataclass(frozen=True)
class ForwardOnly:
    """A block's forward without grad (the chain's F_none / F_ck): compute what the output
    needs, keep nothing.

    ops: ("compute" | "free", node name) in execution order; every value but the output is
        freed at its last use, the input x never (its holder, the chain runner, decides).
    time: seconds, the sum of the computed nodes' profiled times.
    peak_bytes: peak above the entry (x), the output included.
    """

    ops: tuple
    time: float
    peak_bytes: int

    def to_dict(self) -> dict:
        return {"ops": [list(op) for op in self.ops], "time": self.time, "peak_bytes": self.peak_bytes}

    @classmethod
    def from_dict(cls, d: dict) -> "ForwardOnly":
        return cls(tuple((str(a), str(b)) for a, b in d["ops"]), float(d["time"]), int(d["peak_bytes"]))
