"""``ModelPlan``: the plan of a whole model cut into a chain. No torch."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .block_options import BlockOption
from .stage_info import StageInfo
from ..budget import format_bytes
from .sequential_plan import SequentialPlan


@dataclass(frozen=True)
class ModelPlan:
    """A whole-model plan: the chain's plan, where each stage comes from, and resident bytes.

    shared_bytes: bytes of the values computed once before the chain and held during it
    (attention masks, position ids); predicted_peak_bytes includes them.
    menus: stage signature -> its block-option menu as a mapping (hierremat.planning.menus.
    StageMenu.to_dict's entries: a plan made here reads them from the menu, hierremat.planning.chain_menus.PlanMenu; one
    loaded holds them), so that a saved plan runs without solving again; options k >= 1 of a
    stage in ``chain.costs`` are that menu's options in order.
    options_seconds, options_solves: time spent building the menus (trace, profile, ILP)
    and the number of ILP solves (0 when every menu came from the cache).
    segmentation: how the model was cut ('blocks' or 'none'; see hierremat.plan).
    variants: whether operators ran as hierremat's variants (see hierremat.plan).
    gathered_stage_bytes: under FSDP2, per stage, the unsharded parameters FSDP2 gathers
        while it runs (counted in the chain's costs); empty without FSDP2.
    sharded_reserve_bytes: under FSDP2, what it holds beside the chain's schedule (the root
        module's gathered parameters and gradients, a group prefetched for its backward,
        reduce-scatter buffers); predicted_peak_bytes includes it (hierremat.runtime.fsdp).
    compiled: block options run compiled by Inductor, at costs measured so (hierremat.planning.compiled).
    compile_seconds: of planning, the seconds spent compiling block options (or loading them
        from Inductor's cache).
    outputs: the names of the outputs the module returns (the others are None), as asked with
        ``outputs=``; None: every output the model returns.
    capture_kind: how the model's graph at this shape was made: "exported" (traced at this
        shape) or "specialized" (the model's symbolic capture, made once for every shape, at this
        shape's sizes: hierremat.blocks.symbolic).
    times: "measured" (with how, where the times are of one run each until the training steps time the shape, or
        from its training steps: hierremat.remat on CPU), or what was fitted from shapes measured before: the
        times, and the memory where it fits them to the byte (else measured at this shape):
        hierremat.planning.shape_fit; then, where the
        plan runs without block options not built or not re-costed at this shape yet (hierremat.remat's
        ``defer_block_options``), why (e.g. "measured; block options not built yet (...)").
    lent_weight_bytes: for a model planned without its weights (on meta), the bytes of the real
        weights lent to it while planning, one copy per distinct stage (hierremat.runtime.lent_weights);
        0 for a model planned with its own.
    backward_autocast: under autocast, the caller's recipe its block options were traced for (True: the backward
        inside the autocast context, False: after it closed; hierremat.planning.autocast_exactness.exact_under_autocast), None
        where not known or without autocast.
    output_copies_bytes: bytes of the fp32 copies the caller makes of the model's fp16 and bf16 outputs
        (accelerate's mixed precision, as the Trainer's ``bf16=True`` runs it: hierremat.blocks.hf.upcasts_outputs),
        held beside the chain for the whole step (made at the forward's end, they may be held through the
        backward); predicted_peak_bytes includes them. 0 where the caller makes none.
    cost_model: the versions of the measurements and formulations the plan's costs come from (block nodes' times,
        stage costs, the block ILP, the costs fitted at shapes not measured) and torch's, as hierremat.planning.menu_store.cost_model_version gives them: a saved
        plan loaded where they differ is warned about. "" for a plan saved by a hierremat that did not record them.
    The chain's residents, values carried along it beside the activation (an encoder's
    output, a position bias, skip tensors) and their gradients, are in its costs
    (hierremat.plans.costs.ResidentCosts), counted while they are live.
    """

    chain: SequentialPlan
    stages: tuple[StageInfo, ...]
    shared_bytes: int
    capture_seconds: float
    menus: dict = field(default_factory=dict)
    options_seconds: float = 0.0
    options_solves: int = 0
    segmentation: str = "blocks"
    variants: bool = True
    gathered_stage_bytes: tuple[int, ...] = ()
    sharded_reserve_bytes: int = 0
    compiled: bool = False
    compile_seconds: float = 0.0
    outputs: tuple[str, ...] | None = None
    capture_kind: str = "exported"
    times: str = "measured"
    lent_weight_bytes: int = 0
    backward_autocast: bool | None = None
    output_copies_bytes: int = 0
    cost_model: str = ""
    #: what planning left out because its time limit ran out (hierremat.plans.clock): stages timed from one run,
    #: node costs modelled rather than measured (the heuristic menus are the menus' own ``coarse``)
    time_limit_cuts: tuple[str, ...] = ()

    @property
    def beside_chain_bytes(self) -> int:
        """What is held beside the chain's schedule: shared values, FSDP2's root group, the caller's fp32 copies of
        the outputs."""
        return self.shared_bytes + self.sharded_reserve_bytes + self.output_copies_bytes

    @property
    def resident_peak_bytes(self) -> int:
        """The most the residents (values and gradient sums) hold at once, in the chain's peak where live."""
        costs = self.chain.costs
        return max((costs.residents_after_backward(b) for b in range(costs.length + 1)), default=0)

    @property
    def budget_bytes(self) -> int:
        """The model's budget: the chain's plus what is held beside it."""
        return self.chain.budget_bytes + self.beside_chain_bytes

    @property
    def predicted_peak_bytes(self) -> int:
        return self.chain.predicted_peak_bytes + self.beside_chain_bytes

    @property
    def predicted_step_time(self) -> float:
        """Seconds of one forward+backward under this plan (profiled op times)."""
        return self.chain.predicted_step_time

    @property
    def signatures(self) -> tuple[str, ...]:
        return tuple(s.signature for s in self.stages)

    def summary(self) -> str:
        c = self.chain
        unique = len(set(self.signatures))
        lines = [
            f"hierremat model plan: {len(self.stages)} stages ({unique} distinct), budget {format_bytes(self.budget_bytes)}"
            + (", segmentation='none' (one ILP over everything before the output stage)" if self.segmentation == "none" else "")
            + ("" if self.variants else ", operator variants off")
            + (", block options compiled" if self.compiled else "")
            + (f", returns {' and '.join(self.outputs)} only (outputs=)" if self.outputs is not None else ""),
            f"  predicted peak {format_bytes(self.predicted_peak_bytes)} (chain {format_bytes(c.predicted_peak_bytes)}"
            f" + shared inputs {format_bytes(self.shared_bytes)}"
            + (f" + the caller's fp32 copies of the outputs {format_bytes(self.output_copies_bytes)}"
               if self.output_copies_bytes else "") + ")"
            + (f"; residents: {len(self.chain.costs.residents)} values beside the activation, up to "
               f"{format_bytes(self.resident_peak_bytes)} with their gradients, in the chain while live"
               if self.chain.costs.residents else ""),
            f"  predicted step {c.predicted_step_time * 1e3:.2f} ms vs {c.no_remat_step_time * 1e3:.2f} ms keeping everything",
            f"  {c.autocast_line()}",
            *([f"  {c.offload_line()}"] if c.costs.tier is not None else []),
            *(
                [f"  FSDP2: gathers up to {format_bytes(max(self.gathered_stage_bytes))} of parameters per stage "
                 f"(in the stage costs) and holds {format_bytes(self.sharded_reserve_bytes)} beside the chain (the root "
                 "module's group, a prefetched group, reduce-scatter buffers); block options off"]
                if self.gathered_stage_bytes else []
            ),
            f"  planning: capture {self.capture_seconds:.2f} s ({self.capture_line()}), profile {c.profile_seconds:.2f} s, block options "
            f"{self.options_seconds:.2f} s ({len(self.menus)} menus, {self.options_solves} ILP solves), "
            f"chain DP {c.solve_seconds:.3f} s"
            + (f", compiling block options {self.compile_seconds:.1f} s" if self.compiled else ""),
            "",
            f"  {'stage':>5}  {'module':<28} {'signature':<16} {'nodes':>5} {'output':>11} {'kept':>11} {'fwd ms':>8} {'bwd ms':>8} "
            f"{'peak':>11}  forwards",
        ]
        actions = c.stage_actions()
        peaks = c.stage_peaks()
        for i, (info, st) in enumerate(zip(self.stages, c.costs.stages)):
            op = st.options[0]
            lines.append(
                f"  {i:>5}  {info.name[:28]:<28} {info.signature:<16} {info.node_count:>5} "
                f"{format_bytes(c.costs.activation_bytes[i + 1]):>11} {format_bytes(op.kept_bytes):>11} "
                f"{op.fwd_time * 1e3:>8.3f} {op.bwd_time * 1e3:>8.3f} {format_bytes(peaks[i]):>11}  {actions[i]}"
            )
        lines += [f"  ({c.ACTIONS_LEGEND}; peak = the most the chain holds during the stage's ops, predicted)",
                  *c.unproven_lines()]
        coarse = {sig: m.get("coarse", "") for sig, m in self.menus.items() if m.get("coarse")}
        lines += [f"  heuristic block options for {sig}: {why}" for sig, why in coarse.items()]
        recosted = [sig for sig, m in self.menus.items() if m.get("recosted")]
        if self.times != "measured":
            lines.append(f"  {self.times}")
        if self.time_limit_cuts:
            lines.append(f"  the time limit ran out while planning: {'; '.join(self.time_limit_cuts)}")
        if self.lent_weight_bytes:
            lines.append(f"  planned without its weights (meta or fake): {format_bytes(self.lent_weight_bytes)} of weights lent while planning, "
                         "one copy per distinct stage (the model's own are used once materialized)")
        if recosted:
            lines.append(f"  block options of {', '.join(recosted)}: solved at other input sizes, re-costed at these "
                         "(not proven optimal here)")
        lines += ["", f"  schedule: {c.schedule}"]
        return "\n".join(lines)

    def capture_line(self) -> str:
        if self.capture_kind == "specialized":
            return "the symbolic capture specialized to this shape"
        return "exported at this shape"

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": "hierremat.ModelPlan/1",
                "chain": json.loads(self.chain.to_json()),
                "stages": [s.__dict__ for s in self.stages],
                "shared_bytes": self.shared_bytes,
                "capture_seconds": self.capture_seconds,
                "menus": {signature: dict(menu) for signature, menu in self.menus.items()},
                "options_seconds": self.options_seconds,
                "options_solves": self.options_solves,
                "segmentation": self.segmentation,
                "variants": self.variants,
                "gathered_stage_bytes": list(self.gathered_stage_bytes),
                "sharded_reserve_bytes": self.sharded_reserve_bytes,
                "compiled": self.compiled,
                "compile_seconds": self.compile_seconds,
                "outputs": None if self.outputs is None else list(self.outputs),
                "capture_kind": self.capture_kind,
                "times": self.times,
                "lent_weight_bytes": self.lent_weight_bytes,
                "backward_autocast": self.backward_autocast,
                "output_copies_bytes": self.output_copies_bytes,
                "cost_model": self.cost_model,
                "time_limit_cuts": list(self.time_limit_cuts),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> "ModelPlan":
        d = json.loads(text)
        if d.get("format") != "hierremat.ModelPlan/1":
            raise ValueError(f"not a hierremat ModelPlan JSON (format={d.get('format')!r})")
        if d.get("resident_bytes") and not d["chain"]["costs"].get("residents"):
            raise ValueError("this plan was made by an older hierremat, which set its residents' bytes aside for the "
                             "whole step: plan again (hierremat.plan) and save the new plan")
        return cls(
            chain=SequentialPlan.from_json(json.dumps(d["chain"])),
            stages=tuple(StageInfo(**s) for s in d["stages"]),
            shared_bytes=int(d["shared_bytes"]),
            capture_seconds=float(d["capture_seconds"]),
            menus={signature: _as_made(menu) for signature, menu in d.get("menus", {}).items()},
            options_seconds=float(d.get("options_seconds", 0.0)),
            options_solves=int(d.get("options_solves", 0)),
            segmentation=str(d.get("segmentation", "blocks")),
            variants=bool(d.get("variants", True)),
            gathered_stage_bytes=tuple(int(b) for b in d.get("gathered_stage_bytes", ())),
            sharded_reserve_bytes=int(d.get("sharded_reserve_bytes", 0)),
            compiled=bool(d.get("compiled", False)),
            compile_seconds=float(d.get("compile_seconds", 0.0)),
            outputs=None if d.get("outputs") is None else tuple(str(n) for n in d["outputs"]),
            capture_kind=str(d.get("capture_kind", "exported")),
            times=str(d.get("times", "measured")),
            lent_weight_bytes=int(d.get("lent_weight_bytes", 0)),
            backward_autocast=None if d.get("backward_autocast") is None else bool(d["backward_autocast"]),
            output_copies_bytes=int(d.get("output_copies_bytes", 0)),
            cost_model=str(d.get("cost_model") or ""),
            time_limit_cuts=tuple(str(c) for c in d.get("time_limit_cuts", ())),
        )


def _as_made(menu: dict) -> dict:
    """A menu's dict read from JSON as a plan made in this process holds it: each option's op lists tuples of
    pairs (BlockOption.to_dict), where JSON gives lists."""
    return {**menu, "options": [BlockOption.from_dict(option).to_dict() for option in menu.get("options", ())]}
