"""``SequentialPlan``: a solved chain (costs + schedule) and its readable summary. No torch."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..budget import format_bytes
from .costs import ChainCosts
from .schedule import Backward, ChainSchedule, FAll, FCk, FNone, Offload, OffloadKept
from .simulate import SimulationResult, simulate
from .transfers import transfer_plan


#: Options a summary names rather than numbers: stages in another form (hierremat.planning.output_stage).
NAMED_OPTIONS = ("fused_head",)


@dataclass(frozen=True)
class SequentialPlan:
    """A plan for a chain of stages under a budget.

    reserved_bytes: memory the runtime needs beyond the schedule's model (RNG states and
    buffer snapshots of recomputed stages); predicted_peak_bytes includes it.
    profile_seconds, solve_seconds: planning cost.
    output_grad_mask: per output of the last stage, whether the plan expects a gradient
        for it; with ``costs.output_held_bytes``, what the plan assumes of how the caller uses
        the output (the runtime checks it on every backward and re-plans if it differs).
    autocast: the autocast setting the chain was profiled and planned under ('off', or e.g.
        'bf16 on cpu'); the casts it makes, weights included, are in the stages' costs.
    """

    costs: ChainCosts
    schedule: ChainSchedule
    mutated_buffers: tuple[tuple[str, ...], ...]
    reserved_bytes: int
    profile_seconds: float
    solve_seconds: float
    output_grad_mask: tuple[bool, ...] = (True,)
    autocast: str = "off"

    @property
    def budget_bytes(self) -> int:
        return self.schedule.budget_bytes

    @property
    def predicted_peak_bytes(self) -> int:
        return self.schedule.predicted_peak_bytes + self.reserved_bytes

    @property
    def predicted_step_time(self) -> float:
        """Seconds of one forward+backward of the chain under this plan (profiled op times)."""
        return self.schedule.predicted_time

    @property
    def no_remat_step_time(self) -> float:
        """Seconds of one forward+backward keeping everything (each stage's option 0)."""
        return sum(st.options[0].fwd_time + st.options[0].bwd_time for st in self.costs.stages)

    @property
    def offloads(self) -> bool:
        """Whether the schedule offloads checkpoints or kept values to a second tier (it then runs with one)."""
        return any(isinstance(op, (Offload, OffloadKept)) for op in self.schedule.ops)

    def simulate(self) -> SimulationResult:
        """The simulator's replay of this plan as the runtime executes it.

        A schedule that keeps everything runs as plain autograd (see ChainRunner.run), which
        frees the output gradient after its last use.
        """
        return simulate(self.costs, self.schedule, output_grad_persists=not self.schedule.keeps_everything)

    #: What stage_actions' words mean, for summaries.
    ACTIONS_LEGEND = (
        "forwards: none/ck = without grad (ck keeps the input; * as generated code, + compiled; ck(off): the "
        "input then offloaded to the second tier), all = with "
        "grad, keeping what autograd keeps, all[k] = block option k, all[fused_head] = the LM head fused with the loss; "
        "all[k](off): what option k keeps then offloaded to the second tier until its backward"
    )

    def stage_peaks(self) -> list[int]:
        """Per stage, the most bytes the simulator has in use during any of its ops (its forwards,
        recomputations and backward): which stages make the plan's peak."""
        peaks = [0] * self.schedule.length
        for event in self.simulate().timeline:
            stage = getattr(self.schedule.ops[event.op_index], "stage", None)
            if stage is not None:
                peaks[stage] = max(peaks[stage], event.peak_bytes)
        return peaks

    def stage_actions(self) -> list[str]:
        """Per stage, what the schedule does with it, e.g. 'ck, all' (forward kinds in order;
        'ck*' where the forward without grad runs as generated code, 'ck+' compiled)."""
        kinds: list[list[str]] = [[] for _ in range(self.schedule.length)]
        marks = [{"generated": "*", "compiled": "+"}.get(st.nograd_form, "") for st in self.costs.stages]
        offloaded = transfer_plan(self.costs, self.schedule).copy_starts if self.costs.tier is not None else ()
        for index, op in enumerate(self.schedule.ops):
            if isinstance(op, FNone):
                kinds[op.stage].append("none" + marks[op.stage])
            elif isinstance(op, FCk):
                kinds[op.stage].append("ck" + marks[op.stage] + ("(off)" if index in offloaded else ""))
            elif isinstance(op, FAll):
                name = self.costs.stages[op.stage].options[op.option].name
                label = "" if op.option == 0 else name if name in NAMED_OPTIONS else str(op.option)
                kinds[op.stage].append(f"all[{label}]" if label else "all")
            elif isinstance(op, OffloadKept):
                kinds[op.stage][-1] += "(off)"
        return [", ".join(k) for k in kinds]

    def unproven_lines(self) -> list[str]:
        """Summary lines for the block options the schedule runs that their ILP solve did not prove
        optimal (it stopped at its time limit): which, and the solver's MIP gap."""
        shown = []
        for op in self.schedule.ops:
            if isinstance(op, FAll) and op.option > 0:
                option = self.costs.stages[op.stage].options[op.option]
                gap = option.mip_gap
                if gap is None or gap > 0:
                    entry = f"stage {op.stage} all[{op.option}] ({'gap unknown' if gap is None else f'MIP gap {gap:.1%}'})"
                    if entry not in shown:
                        shown.append(entry)
        if not shown:
            return []
        return [f"  not proven optimal (solves stopped at their time limit): {', '.join(shown)}"]

    def autocast_line(self) -> str:
        """What autocast adds to a step, for summaries."""
        if self.autocast == "off":
            return "autocast: off"
        casts = sum(st.weight_cast_bytes for st in self.costs.stages)
        return (
            f"autocast: {self.autocast}; weight casts {format_bytes(casts)} per forward "
            "(counted in the stage costs)"
        )

    def offload_line(self) -> str:
        """What the plan offloads (plans.transfers), and the second tier's measured bandwidths."""
        tier = self.costs.tier
        if tier is None:
            return "offloading: off"
        return (f"{transfer_plan(self.costs, self.schedule).describe()} ({tier.kind} tier: "
                f"{tier.offload_bytes_per_second / 1e6:.0f} MB/s out, {tier.fetch_bytes_per_second / 1e6:.0f} MB/s back)")

    def step_grads_line(self) -> str:
        """What the plan assumes of the parameter gradients (ChainCosts.step_grad_bytes)."""
        made = sum(self.costs.step_grad_bytes)
        if not made:
            return "parameter gradients: allocated before the step (.grad kept), not counted"
        return (f"parameter gradients: {format_bytes(made)} allocated in the step (.grad None at its start), "
                "counted from each stage's backward on")

    def summary(self) -> str:
        s = self.schedule
        overhead = s.predicted_time / self.no_remat_step_time - 1 if self.no_remat_step_time > 0 else 0.0
        lines = [
            f"hierremat plan: {s.length} stages, budget {format_bytes(self.budget_bytes)}",
            f"  predicted peak {format_bytes(self.predicted_peak_bytes)} "
            f"(schedule {format_bytes(s.predicted_peak_bytes)} + reserved {format_bytes(self.reserved_bytes)})",
            f"  predicted step {s.predicted_time * 1e3:.2f} ms, {overhead:+.1%} vs keeping everything "
            f"({self.no_remat_step_time * 1e3:.2f} ms)",
            f"  planning: profile {self.profile_seconds:.2f} s, solve {self.solve_seconds:.3f} s, "
            f"memory unit {format_bytes(s.memory_unit_bytes)}",
            f"  assumes the caller holds {format_bytes(self.costs.held_output)} of the "
            f"{format_bytes(self.costs.activation_bytes[-1])} output during backward; "
            f"output gradient {format_bytes(self.costs.output_grad)}",
            f"  {self.step_grads_line()}",
            f"  {self.autocast_line()}",
            *([f"  {self.offload_line()}"] if self.costs.tier is not None else []),
            "",
            f"  {'stage':>5}  {'module':<18} {'output':>11} {'kept':>11} {'fwd ms':>8} {'bwd ms':>8}  forwards",
        ]
        actions = self.stage_actions()
        for i, st in enumerate(self.costs.stages):
            op = st.options[0]
            lines.append(
                f"  {i:>5}  {st.name[:18]:<18} {format_bytes(self.costs.activation_bytes[i + 1]):>11} "
                f"{format_bytes(op.kept_bytes):>11} {op.fwd_time * 1e3:>8.3f} {op.bwd_time * 1e3:>8.3f}  {actions[i]}"
            )
        n_back = sum(isinstance(op, Backward) for op in s.ops)
        lines.append(f"  ({self.ACTIONS_LEGEND})")
        lines += self.unproven_lines()
        lines.append("")
        lines.append(f"  schedule ({len(s.ops)} ops, {n_back} backward): {s}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": "hierremat.SequentialPlan/1",
                "costs": self.costs.to_dict(),
                "schedule": json.loads(self.schedule.to_json()),
                "mutated_buffers": [list(b) for b in self.mutated_buffers],
                "reserved_bytes": self.reserved_bytes,
                "profile_seconds": self.profile_seconds,
                "solve_seconds": self.solve_seconds,
                "output_grad_mask": list(self.output_grad_mask),
                "autocast": self.autocast,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> "SequentialPlan":
        d = json.loads(text)
        if d.get("format") != "hierremat.SequentialPlan/1":
            raise ValueError(f"not a hierremat SequentialPlan JSON (format={d.get('format')!r})")
        return cls(
            costs=ChainCosts.from_dict(d["costs"]),
            schedule=ChainSchedule.from_json(json.dumps(d["schedule"])),
            mutated_buffers=tuple(tuple(b) for b in d["mutated_buffers"]),
            reserved_bytes=int(d["reserved_bytes"]),
            profile_seconds=float(d["profile_seconds"]),
            solve_seconds=float(d["solve_seconds"]),
            output_grad_mask=tuple(bool(m) for m in d.get("output_grad_mask", (True,))),
            autocast=str(d.get("autocast", "off")),
        )
