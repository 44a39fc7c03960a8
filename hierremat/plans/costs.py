"""Cost values of a chain of stages: what the chain DP and the simulator consume.

The memory model is Rotor's (Beaumont et al., "Optimal checkpointing for heterogeneous
chains", 2019) with per-stage options as in "Hierarchical rematerialization" (Zhao et
al., HiRemate, 2023). Stage i maps x_i to x_{i+1}; x_0 is the step's input (not counted
in the budget), x_L the chain output. All sizes are bytes, all times seconds.

Overheads are *peaks above the memory in use just before the operation*, and include
what the operation produces (its output, kept tensors, the input gradient), so the peak
of an op is simply ``memory_before + overhead``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Sequence


@dataclass(frozen=True)
class OptionCosts:
    """One way of running a stage with grad (F_all) and its backward (B).

    fwd_time, bwd_time: seconds for F_all and for B.
    kept_bytes: bytes the option retains from the end of F_all until the end of B,
        not counting the stage input x_i or output x_{i+1} (the chain tracks those).
    fwd_overhead_bytes: peak during F_all above the memory before it; at least
        kept_bytes + bytes(x_{i+1}).
    bwd_overhead_bytes: peak during B above the memory before it (which holds x_i,
        the kept bytes and the output gradient); at least bytes(grad x_i).
    pins_output: True when the kept tensors share x_{i+1}'s storage (e.g. ReLU saves its
        result), so x_{i+1} stays allocated until B(i).
    pins_input: True when the kept tensors share x_i's storage (e.g. Linear saves its
        input), so x_i stays allocated until B(i); otherwise F_all frees x_i.
    bwd_overhead_new_grads_bytes: the peak of B above the memory before it when the stage's
        parameters' ``.grad`` is None at the start of the step, so that the gradients B makes stay
        (measured for a stage run under autograd); None where not measured (ChainCosts.bwd_overhead
        then bounds it by bwd_overhead_bytes plus the gradients the step allocates in B).
    offloadable: the values the option keeps are explicit (a block option's generated program returns them:
        hierremat.runtime.block_exec.OptionTape), so that a plan may move them to the second tier after F_all and
        bring them back before B; autograd's saved tensors (option 0) are not.
    name, mip_gap: what the option is, for summaries (not used by the DP): an ILP option
        whose solve stopped at its time limit has the solver's relative MIP gap there
        (None: not reported), every other option 0.0.
    """

    fwd_time: float
    bwd_time: float
    kept_bytes: int
    fwd_overhead_bytes: int
    bwd_overhead_bytes: int
    pins_output: bool = False
    pins_input: bool = True
    name: str = "autograd"
    mip_gap: float | None = 0.0  # a block option's MIP gap where its solve stopped at a time limit
    bwd_overhead_new_grads_bytes: int | None = None
    offloadable: bool = False

    @property
    def kept_offloadable(self) -> bool:
        """Whether moving the kept values to the second tier frees anything: offloadable, with kept bytes."""
        return self.offloadable and self.kept_bytes > 0


@dataclass(frozen=True)
class StageCosts:
    """Costs of one stage: its no-grad forward (for F_none/F_ck) and its options.

    nograd_fwd_time: seconds; nograd_fwd_overhead_bytes: peak above the memory before,
    at least bytes(x_{i+1}).
    weight_cast_bytes: bytes of the low-precision copies of parameters that autocast makes
        in one forward of the stage. They are created in the step, so they are already in
        the overheads and kept bytes above; this says how much of those they are.
    nograd_form: how F_none / F_ck run the stage: "autograd" (the stage called without
        grad), "generated" (its joint graph's forward as generated code,
        hierremat.runtime.block_exec.ForwardExecutor) or "compiled" (that code compiled by
        Inductor); the nograd figures are that form's.
    autograd_nograd: (seconds, overhead bytes) of the stage called without grad, when
        nograd_form is another form: what plans that must call the stage itself use (FSDP2).
    leaner_nograd: (form, seconds, overhead bytes) of a no-grad form that peaks lower than
        nograd_form but runs slower, or None: what a plan uses where the faster form does not
        fit (:meth:`with_leaner_forward`). The figures above are the fastest form's.
    """

    nograd_fwd_time: float
    nograd_fwd_overhead_bytes: int
    options: tuple[OptionCosts, ...]
    name: str = ""
    weight_cast_bytes: int = 0
    nograd_form: str = "autograd"
    autograd_nograd: tuple[float, int] | None = None
    leaner_nograd: tuple[str, float, int] | None = None

    @property
    def option_0_times(self) -> tuple[float, float, float]:
        """(no-grad forward in the form F_none / F_ck run, forward, backward) seconds of option 0: what the
        training steps' times are compared with (hierremat.runtime.step_times)."""
        return self.nograd_fwd_time, self.options[0].fwd_time, self.options[0].bwd_time

    def with_leaner_forward(self) -> "StageCosts":
        """These costs with F_none / F_ck in the leaner no-grad form, where there is one."""
        if self.leaner_nograd is None:
            return self
        form, seconds, overhead = self.leaner_nograd  # (never "autograd": the fastest form peaks no higher)
        autograd = (
            (self.nograd_fwd_time, self.nograd_fwd_overhead_bytes) if self.nograd_form == "autograd"
            else self.autograd_nograd
        )
        return replace(
            self, nograd_fwd_time=seconds, nograd_fwd_overhead_bytes=overhead, nograd_form=form,
            autograd_nograd=autograd, leaner_nograd=None,
        )

    def called_as_module(self) -> "StageCosts":
        """These costs with the stage itself for every forward: option 0, autograd's no-grad forward."""
        time, overhead = (
            self.autograd_nograd if self.autograd_nograd is not None
            else (self.nograd_fwd_time, self.nograd_fwd_overhead_bytes)
        )
        return StageCosts(time, overhead, self.options[:1], self.name, self.weight_cast_bytes)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "nograd_fwd_time": self.nograd_fwd_time,
            "nograd_fwd_overhead_bytes": self.nograd_fwd_overhead_bytes,
            "options": [op.__dict__.copy() for op in self.options],
            "weight_cast_bytes": self.weight_cast_bytes,
            "nograd_form": self.nograd_form,
            "autograd_nograd": None if self.autograd_nograd is None else list(self.autograd_nograd),
            "leaner_nograd": None if self.leaner_nograd is None else list(self.leaner_nograd),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "StageCosts":
        autograd_nograd, leaner = d.get("autograd_nograd"), d.get("leaner_nograd")
        return cls(
            nograd_fwd_time=float(d["nograd_fwd_time"]),
            nograd_fwd_overhead_bytes=int(d["nograd_fwd_overhead_bytes"]),
            options=tuple(OptionCosts(**op) for op in d["options"]),
            name=d.get("name", ""),
            weight_cast_bytes=int(d.get("weight_cast_bytes", 0)),
            nograd_form=d.get("nograd_form", "autograd"),
            autograd_nograd=None if autograd_nograd is None else (float(autograd_nograd[0]), int(autograd_nograd[1])),
            leaner_nograd=None if leaner is None else (str(leaner[0]), float(leaner[1]), int(leaner[2])),
        )


@dataclass(frozen=True)
class ResidentCosts:
    """A value carried along the chain beside its activation (hierremat.plans.stage_info.ResidentLayout).

    producer: the stage whose forward makes it, or -1 for a value made before the chain (an
        encoder's output where the chain is the decoder): that value is the caller's, as x_0
        is, and not counted (value_bytes 0), and its gradient sum stays to the end of the
        backward; readers: the later stages that read it (none for a value only the model
        returns, such as a key/value cache).
    value_bytes: its bytes, held from the producer's first forward until the producer's
        backward (to the end of the step when ``exported``: the caller holds it as an output).
        A forward with grad that recomputes the producer makes another copy, which its option's
        kept bytes count where its tape keeps it (they are measured with it).
    grad_bytes: bytes of its gradient (0 for integer values): the sum of the readers'
        contributions, held from the backward of its last reader until the producer's
        backward (from the Loss when ``exported``: the caller's gradient is its first term).
    """

    producer: int
    readers: tuple[int, ...]
    value_bytes: int
    grad_bytes: int
    exported: bool = False

    @property
    def last_reader(self) -> int:
        """The last stage that reads it (its producer when none does)."""
        return max(self.readers, default=self.producer)

    def to_dict(self) -> dict:
        return {**self.__dict__, "readers": list(self.readers)}

    @classmethod
    def from_dict(cls, d: dict) -> "ResidentCosts":
        return cls(int(d["producer"]), tuple(int(r) for r in d["readers"]), int(d["value_bytes"]),
                   int(d["grad_bytes"]), bool(d.get("exported", False)))


@dataclass(frozen=True)
class ChainCosts:
    """A chain of L stages.

    activation_bytes: L + 1 sizes, bytes of x_0 .. x_L (a gradient has its tensor's size).
    input_requires_grad: whether B(0) produces a gradient for x_0 (else it costs 0 bytes).
    output_held_bytes: bytes of x_L that the caller keeps alive through the whole
        backward (None: all of it, as with ``y = chain(x); loss_fn(y).backward()`` and
        ``y`` still referenced; 0 when released; a model returning (loss, logits) trained
        with ``.loss.backward()`` keeps only the loss). The rest of x_L is freed at the
        Loss (once its gradient exists), unless the last stage's option pins it.
    output_grad_bytes: bytes of the gradient that arrives for x_L (None: x_L's size).
        Smaller when only part of a tuple output is differentiated, e.g. a model that
        returns (loss, logits) and is trained with ``.loss.backward()``.
    residents: values carried beside the activation, each counted while it is live
        (ResidentCosts; none for a plain chain).
    step_grad_bytes: per stage, bytes of the parameter gradients its backward allocates and the
        step keeps to its end (empty: none). A parameter whose ``.grad`` is None when the step
        starts (PyTorch's default ``zero_grad(set_to_none=True)``) gets its ``.grad`` in the
        backward of the last stage that reads it, the first backward to reach it. Overheads are
        measured with ``.grad`` allocated, where a new gradient is added into it and freed; with
        ``.grad`` None it stays instead, so B(i) peaks at most ``step_grad_bytes[i]`` above its
        measured overhead (:meth:`bwd_overhead`), and holds them after.
    tier: the second tier checkpoints may be offloaded to (its measured bandwidths), or None: the DP
        then never offloads (hierremat.dp.kernel).
    """

    activation_bytes: tuple[int, ...]
    stages: tuple[StageCosts, ...]
    input_requires_grad: bool = True
    output_held_bytes: int | None = None
    output_grad_bytes: int | None = None
    residents: tuple[ResidentCosts, ...] = ()
    step_grad_bytes: tuple[int, ...] = ()
    tier: TierBandwidth | None = None

    def __post_init__(self) -> None:
        L = len(self.stages)
        if self.step_grad_bytes and (len(self.step_grad_bytes) != L or min(self.step_grad_bytes) < 0):
            raise ValueError(f"step_grad_bytes needs L = {L} sizes >= 0 (or none), got {self.step_grad_bytes}")
        for r in self.residents:
            if not (-1 <= r.producer < L and (r.readers or r.exported) and all(r.producer < j < L for j in r.readers)):
                raise ValueError(f"resident {r}: its producer must be a stage (or -1), its readers later stages (or it exported)")
            if r.producer < 0 and (r.value_bytes or r.exported):
                raise ValueError(f"resident {r}: a value made before the chain is the caller's: value_bytes 0, not exported")
            if min(r.value_bytes, r.grad_bytes) < 0:
                raise ValueError(f"resident {r}: negative bytes")
        if L == 0:
            raise ValueError("a chain needs at least one stage")
        if len(self.activation_bytes) != L + 1:
            raise ValueError(f"activation_bytes needs L + 1 = {L + 1} sizes, got {len(self.activation_bytes)}")
        if any(a < 0 for a in self.activation_bytes):
            raise ValueError("activation_bytes must be >= 0")
        if self.output_grad_bytes is not None and self.output_grad_bytes < 0:
            raise ValueError("output_grad_bytes must be >= 0")
        if self.output_held_bytes is not None and not 0 <= self.output_held_bytes <= self.activation_bytes[-1]:
            raise ValueError("output_held_bytes must be between 0 and the bytes of the output")
        for i, st in enumerate(self.stages):
            out = self.activation_bytes[i + 1]
            if not st.options:
                raise ValueError(f"stage {i} has no option")
            if st.nograd_fwd_overhead_bytes < out:
                raise ValueError(f"stage {i}: nograd_fwd_overhead_bytes < bytes of its output")
            for k, op in enumerate(st.options):
                if min(op.kept_bytes, op.fwd_time, op.bwd_time) < 0:
                    raise ValueError(f"stage {i} option {k}: negative cost")
                if op.fwd_overhead_bytes < op.kept_bytes + out:
                    raise ValueError(f"stage {i} option {k}: fwd_overhead_bytes < kept_bytes + output bytes")
                if op.bwd_overhead_bytes < self.grad_bytes(i):
                    raise ValueError(f"stage {i} option {k}: bwd_overhead_bytes < bytes of the input gradient")

    @property
    def length(self) -> int:
        return len(self.stages)

    def with_autograd_times(self, stage_times: Sequence[tuple[float, float, float]]) -> "ChainCosts":
        """These costs with each stage's times under autograd replaced: ``stage_times[i]`` is stage i's
        (no-grad forward, forward, backward) seconds of option 0 (fitted over shapes, or observed in the
        training steps); block options' times and every byte count are kept."""
        if len(stage_times) != len(self.stages):
            raise ValueError(f"stage_times needs {len(self.stages)} stages' times, got {len(stage_times)}")
        stages = tuple(
            replace(st, nograd_fwd_time=nograd, options=(replace(st.options[0], fwd_time=fwd, bwd_time=bwd),
                                                          *st.options[1:]))
            for st, (nograd, fwd, bwd) in zip(self.stages, stage_times)
        )
        return replace(self, stages=stages)

    def with_step_times(self, stage_times: Sequence[tuple[float, float, float]]) -> "ChainCosts":
        """These costs with each stage's option-0 times as the training steps observed them (``stage_times[i]``:
        stage i's no-grad forward, forward and backward seconds: hierremat.runtime.step_times), and every other time
        scaled by how much slower the steps ran option 0 than these costs have it (:func:`step_time_ratios`, one
        ratio per kind of time: :meth:`with_times_scaled`). Block options are priced from the profile's node times,
        which the steps do not time; a host that runs the steps slower (or faster) than the profile ran runs the
        generated code so too, and the DP prices the options against option 0 as the profile did (replacing option
        0's times alone made the options look cheaper by that ratio). Byte counts are kept."""
        if len(stage_times) != len(self.stages):
            raise ValueError(f"stage_times needs {len(self.stages)} stages' times, got {len(stage_times)}")
        ratios = step_time_ratios(stage_times, [stage.option_0_times for stage in self.stages])
        return self.with_times_scaled(ratios).with_autograd_times(stage_times)

    def with_times_scaled(self, ratios: tuple[float, float, float]) -> "ChainCosts":
        """These costs with every time scaled by ``ratios`` (no-grad forward, forward, backward factors): every
        option's forward by the second and backward by the third, each stage's no-grad forward and its other forms
        (autograd_nograd, leaner_nograd) by the first. Byte counts are kept."""
        n, f, b = ratios
        stages = tuple(replace(
            st, nograd_fwd_time=st.nograd_fwd_time * n,
            options=tuple(replace(o, fwd_time=o.fwd_time * f, bwd_time=o.bwd_time * b) for o in st.options),
            autograd_nograd=None if st.autograd_nograd is None else (st.autograd_nograd[0] * n, st.autograd_nograd[1]),
            leaner_nograd=None if st.leaner_nograd is None else (
                st.leaner_nograd[0], st.leaner_nograd[1] * n, st.leaner_nograd[2]),
        ) for st in self.stages)
        return replace(self, stages=stages)

    def with_leaner_forwards(self) -> "ChainCosts":
        """These costs with every stage's F_none / F_ck in its leaner no-grad form, where it has
        one (StageCosts.leaner_nograd); ``self`` where none has."""
        if all(st.leaner_nograd is None for st in self.stages):
            return self
        return replace(self, stages=tuple(st.with_leaner_forward() for st in self.stages))

    def grad_bytes(self, i: int) -> int:
        """Bytes of the gradient of x_i."""
        if i == 0 and not self.input_requires_grad:
            return 0
        return self.activation_bytes[i]

    @property
    def output_grad(self) -> int:
        """Bytes of the gradient of x_L."""
        return self.activation_bytes[-1] if self.output_grad_bytes is None else self.output_grad_bytes

    @property
    def held_output(self) -> int:
        """Bytes of x_L the caller holds through the backward."""
        return self.activation_bytes[-1] if self.output_held_bytes is None else self.output_held_bytes

    def step_grad(self, stage: int) -> int:
        """Bytes of the parameter gradients B(stage) allocates and the step keeps (step_grad_bytes)."""
        return self.step_grad_bytes[stage] if self.step_grad_bytes else 0

    def bwd_overhead(self, stage: int, option: OptionCosts) -> int:
        """Peak of B(stage) run with ``option`` above the memory before it. Where B allocates parameter
        gradients that stay (step_grad_bytes), at most the overhead measured with ``.grad`` allocated
        plus those bytes (each gradient, added into ``.grad`` and freed there, stays here instead), and
        at most the overhead measured with every ``.grad`` of the stage None
        (OptionCosts.bwd_overhead_new_grads_bytes: gradients that already exist only lower it).
        The last stage's, where its tape pins x_L and the caller holds some of it, is the overhead plus
        x_L's bytes: measured alone, the tape's release freed x_L during the backward, which the
        caller's reference keeps alive here (the peak after that release is higher by them)."""
        held = self.activation_bytes[-1] if (stage == len(self.stages) - 1 and option.pins_output
                                             and self.held_output) else 0
        new_grads = self.step_grad(stage)
        if not new_grads:
            return option.bwd_overhead_bytes + held
        bound = option.bwd_overhead_bytes + new_grads
        measured = option.bwd_overhead_new_grads_bytes
        return held + (bound if measured is None else min(bound, max(option.bwd_overhead_bytes, measured)))

    def held_after_backward(self, stage: int) -> int:
        """Bytes that the step holds beside the chain once the backward of stages ``stage``..L-1 has
        run: the residents' (:meth:`residents_after_backward`) and the parameter gradients allocated."""
        return self.residents_after_backward(stage) + sum(self.step_grad_bytes[stage:])

    def resident_values_of(self, stage: int) -> int:
        """Bytes of the residents ``stage`` makes (held after its first forward)."""
        return sum(r.value_bytes for r in self.residents if r.producer == stage)

    def residents_made_before(self, stage: int) -> int:
        """Bytes residents hold in the first forward sweep once stages 0..stage-1 have run."""
        return sum(r.value_bytes for r in self.residents if r.producer < stage)

    def residents_after_backward(self, stage: int) -> int:
        """Bytes residents hold once the backward of stages ``stage``..L-1 has run (``stage`` = L:
        just after the Loss): values whose producer's backward is still to come (or exported) and
        the gradient sums begun (by the Loss or a reader's backward) and not yet consumed."""
        total = 0
        for r in self.residents:
            pending = r.producer < stage
            total += r.value_bytes * (pending or r.exported)
            total += r.grad_bytes * (pending and (r.exported or r.last_reader >= stage))
        return total

    @property
    def output_resident(self) -> int:
        """Bytes that stay from the Loss to the end of the backward: the held output and its gradient."""
        return self.held_output + self.output_grad

    def to_dict(self) -> dict:
        return {
            "activation_bytes": list(self.activation_bytes),
            "input_requires_grad": self.input_requires_grad,
            "output_held_bytes": self.output_held_bytes,
            "output_grad_bytes": self.output_grad_bytes,
            "stages": [st.to_dict() for st in self.stages],
            "residents": [r.to_dict() for r in self.residents],
            "step_grad_bytes": list(self.step_grad_bytes),
            "tier": None if self.tier is None else self.tier.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "ChainCosts":
        stages = tuple(StageCosts.from_dict(st) for st in d["stages"])
        return cls(
            activation_bytes=tuple(int(a) for a in d["activation_bytes"]),
            stages=stages,
            input_requires_grad=bool(d.get("input_requires_grad", True)),
            output_held_bytes=None if d.get("output_held_bytes") is None else int(d["output_held_bytes"]),
            output_grad_bytes=None if d.get("output_grad_bytes") is None else int(d["output_grad_bytes"]),
            residents=tuple(ResidentCosts.from_dict(r) for r in d.get("residents", ())),
            step_grad_bytes=tuple(int(b) for b in d.get("step_grad_bytes", ())),
            tier=None if d.get("tier") is None else TierBandwidth.from_dict(d["tier"]),
        )


@dataclass(frozen=True)
class TierBandwidth:
    """How fast a second tier moves values (hierremat.runtime.second_tier), measured on the machine.

    kind: the tier ('disk', 'host memory'). offload_bytes_per_second: from the device out to it, until the
    copy is done; fetch_bytes_per_second: back onto the device. An offload of b bytes takes
    b / offload_bytes_per_second seconds (Beaumont, Eyraud-Dubois and Shilova, NeurIPS 2021: transfers
    priced by their bytes and the link's bandwidth, overlapping the stages' compute).
    """

    kind: str
    offload_bytes_per_second: float
    fetch_bytes_per_second: float

    def __post_init__(self) -> None:
        for name in ("offload_bytes_per_second", "fetch_bytes_per_second"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"TierBandwidth.{name} must be a positive finite number of bytes per second, got {value!r}")

    def offload_seconds(self, nbytes: int) -> float:
        return nbytes / self.offload_bytes_per_second

    def fetch_seconds(self, nbytes: int) -> float:
        return nbytes / self.fetch_bytes_per_second

    def round_trip_seconds(self, nbytes: int) -> float:
        """Seconds to send ``nbytes`` out and fetch them back, both waited for (the offload first: every caller adds
        in this one order, so the DP kernel, its reference and the expander agree to the last bit)."""
        return self.offload_seconds(nbytes) + self.fetch_seconds(nbytes)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "offload_bytes_per_second": self.offload_bytes_per_second,
                "fetch_bytes_per_second": self.fetch_bytes_per_second}

    @classmethod
    def from_dict(cls, d: dict) -> "TierBandwidth":
        return cls(str(d["kind"]), float(d["offload_bytes_per_second"]), float(d["fetch_bytes_per_second"]))


def timed_in_steps(observed: tuple[float, float, float], profiled: tuple[float, float, float]) -> bool:
    """Whether a stage's times from the training steps (``observed``) were timed there: a stage whose forward the
    steps never ran under autograd (a block option ran it) carries the plan's own times, equal to ``profiled``
    (hierremat.runtime.step_times.StepTimes.stage_times)."""
    return tuple(observed) != tuple(profiled)


def step_time_ratios(observed: Sequence[tuple[float, float, float]],
                     profiled: Sequence[tuple[float, float, float]]) -> tuple[float, float, float]:
    """How much slower the training steps ran option 0 than a profile did: per kind of time (no-grad forward,
    forward, backward), the median over the stages of each stage's ``observed`` seconds over its ``profiled``
    ones (1.0 where no stage is left). Left out: pairs where either is 0, and stages the steps did not time
    (:func:`timed_in_steps`). One ratio for every stage, not each stage's own: a
    profile timed from one run each has single-stage outliers (a 4-layer GPT-2's first stage's backward at 2.8x its
    median-profiled time in one run, where the steps and a median profile of the blocks agreed within 5%), and a
    block option scaled by such a stage's ratio is mispriced by it for the shape's whole run."""
    timed = [(o, p) for o, p in zip(observed, profiled) if timed_in_steps(o, p)]
    ratios = []
    for kind in range(3):
        pairs = [o[kind] / p[kind] for o, p in timed if o[kind] > 0 and p[kind] > 0]
        ratios.append(statistics.median(pairs) if pairs else 1.0)
    return tuple(ratios)
