"""Executes a ChainSchedule on a chain of callables, inside one autograd Function.

The Function's forward runs the schedule's ops up to Loss and returns x_L; its backward
receives the output gradient and runs the rest: recomputations and per-stage backward
steps. A backward step hands the stage's output gradient to a zero-size node after its outputs
(hierremat.runtime.grad_taps.GradRelay: the engine frees it once read), and the input gradient is caught by a
zero-byte tap (hierremat.runtime.grad_taps) rather than by a leaf: the executor holds only the stage's
autograd nodes, never its input or output tensors, so x_i and x_{i+1} are freed as soon
as the schedule drops them unless the stage's own saved tensors need them (the
``pins_input``/``pins_output`` of hierremat.plans.costs). Parameter gradients are accumulated
into ``.grad`` stage by stage, as plain autograd does; a parameter several stages read (a
tied embedding and LM head) reaches its ``AccumulateGrad`` and its hooks once per step
(hierremat.runtime.tied).

Replays are exact: a stage that runs more than once restores the RNG state it first
ran with, its mutated buffers (BatchNorm running stats) are put back to their state
before the first run for the replay and to their updated state after it (so they are
updated exactly once per step). Every stage call, recomputations in backward included,
runs under the autocast setting of the step's forward (hierremat.device.autocast).

A schedule that offloads runs with a second tier (hierremat.runtime.second_tier) and its
TransferPlan (hierremat.plans.transfers): x_i's copy out starts before the ``F_ck(i)`` that begins its
forward sweep, ``Offload(i)`` waits for it and drops the chain's reference (the device memory is freed),
a prefetch starts bringing it back where the plan says it fits, and ``Fetch(i)`` takes it back. The
values a step offloads are keyed by the step, and dropped from the tier if the step ends without its
backward. ``Offload_kept(i)`` sends what the tape of stage i's block option keeps (hierremat.runtime.kept_offload),
waiting for the copies, and ``Fetch_kept(i)`` puts it back before ``B(i)``, prefetched as x_i is.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch.autograd.function import once_differentiable
from torch.autograd.graph import get_gradient_edge

from ..budget import format_bytes
from ..errors import UnsupportedModelError
from ..plans.schedule import Backward, ChainSchedule, FAll, FCk, Fetch, FetchKept, FNone, Offload, OffloadKept
from ..plans.transfers import TransferPlan
from ..device.autocast import AutocastState
from .residents import collect_reads, keep_made, keep_sums, pop_seeds, read_roots, split_output, stage_shared, tap_read
from ..device.rng import RngState, cuda_devices_of
from .block_exec import OptionExecutor, OptionTape
from .kept_offload import bring_back_kept, prefetch_kept, send_kept
from .tapeless import tapeless
from .tied import TiedParameters
from .grad_taps import GradRelay, eager_only, tap_input
from .step_times import StepTimes


def stage_buffers(stage: Callable, names: Sequence[str]) -> list[torch.Tensor]:
    if not names:
        return []
    buffers = dict(stage.named_buffers()) if isinstance(stage, torch.nn.Module) else {}
    return [buffers[n] for n in names]


def check_stage_output(index: int, stage: Callable, out, last: bool = False):
    """A stage returns one tensor; the last stage (``last``), or one that makes residents, may
    return a tuple of tensors."""
    if isinstance(out, torch.Tensor):
        return out
    if last and isinstance(out, (tuple, list)) and out and all(isinstance(o, torch.Tensor) for o in out):
        return tuple(out)
    raise UnsupportedModelError(
        f"stage {index} ({type(stage).__name__}) returned {type(out).__name__}; every stage must map one "
        "tensor to one tensor (the last may return a tuple of tensors): wrap multi-output stages in a module."
    )


def as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


@dataclass(frozen=True)
class OutputUse:
    """How the caller uses the chain's output during the backward.

    held_bytes: bytes of the output the caller keeps alive through the backward (all of
        it with ``y = chain(x)`` still referenced; only the loss with
        ``loss = model(x).loss``).
    grad_mask: per output of the last stage, whether a gradient arrives for it (a model
        returning (loss, logits) trained with ``.loss.backward()``: (True, False)).
    """

    held_bytes: int
    grad_mask: tuple[bool, ...]

    def describe(self) -> str:
        """In words, for logs: "4 B of the output held through the backward, gradients for outputs [1] of 2"."""
        with_grad = [i for i, g in enumerate(self.grad_mask) if g]
        return (f"{format_bytes(self.held_bytes)} of the output held through the backward, gradients for "
                f"outputs {with_grad} of {len(self.grad_mask)}")


class OutputWatch:
    """Watches the chain's outputs from the end of its forward; ``use(grads)``, called when their
    gradients arrive, says how the caller used them (bytes still alive, which got a gradient)."""

    def __init__(self, outputs: tuple):
        self.freed, self.output_bytes = watch_storages(outputs)

    def use(self, grads: tuple) -> OutputUse:
        return OutputUse(held_bytes=self.output_bytes - sum(self.freed), grad_mask=tuple(g is not None for g in grads))


def backward_autocast(grads: tuple) -> bool | None:
    """Whether autocast is on, for the gradients' device, in the backward now running (the autograd engine runs it
    under the autocast state of the ``backward()`` call); None without a gradient."""
    device = next((g.device for g in grads if isinstance(g, torch.Tensor)), None)
    return None if device is None else torch.is_autocast_enabled(device.type)


def default_grad_mask(out) -> tuple[bool, ...]:
    """Which outputs to expect gradients for: the scalar losses among several outputs, else all that require grad."""
    outputs = as_tuple(out)
    differentiable = [o.requires_grad and o.is_floating_point() for o in outputs]
    losses = [d and o.numel() == 1 for d, o in zip(differentiable, outputs)]
    return tuple(losses) if len(outputs) > 1 and any(losses) else tuple(differentiable)


def watch_storages(value) -> tuple[list, int]:
    """Watch the distinct storages behind a tensor or tuple of tensors without keeping them alive.

    Returns (a list that receives the bytes of each storage when it is freed, their total bytes).
    """
    found = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in as_tuple(value)}
    freed: list[int] = []
    for storage in found.values():
        weakref.finalize(storage, freed.append, storage.nbytes())
    return freed, sum(s.nbytes() for s in found.values())


def gradient_edges(out) -> list:
    """Gradient edges of the outputs that require grad (None for the others)."""
    return [get_gradient_edge(o) if o.requires_grad else None for o in as_tuple(out)]


def detach_output(out):
    return tuple(o.detach() for o in out) if isinstance(out, tuple) else out.detach()


def run_plainly(stages: Sequence[Callable], x, shared: tuple = ()):
    """Call the stages one after the other, as plain PyTorch would."""
    for stage in stages:
        x = stage(x, *shared)
    return x


class ChainRunner:
    """A chain of stages bound to one schedule; ``run(x)`` executes one training step's forward."""

    def __init__(
        self, stages: Sequence[Callable], schedule: ChainSchedule, mutated_buffers: Sequence[Sequence[str]],
        option_executors: Sequence[Sequence] | None = None, sharded=None,
        forward_executors: Sequence | None = None, residents=None, tier=None, transfers: TransferPlan | None = None,
    ):
        """option_executors[i][k]: runs option k >= 1 of stage i (hierremat.runtime.block_exec);
        option 0 is always the stage itself under autograd. forward_executors[i]: runs stage i's
        forward without grad (F_none / F_ck) as generated code (block_exec.ForwardExecutor); None
        there, or no list: the stage itself is called. sharded: a
        hierremat.runtime.fsdp.ShardedChain through which stages are called (FSDP2). residents: the
        values carried beside the activation (hierremat.plans.stage_info.ResidentLayout), or None; the
        stages that make them run as option 0. tier: the second tier (hierremat.runtime.second_tier) a
        schedule that offloads runs with, or a callable giving the one for each step
        (hierremat.runtime.offload.Offloading.tier_for); transfers: its TransferPlan (module docstring)."""
        if len(stages) != schedule.length:
            raise ValueError(f"schedule is for {schedule.length} stages, got {len(stages)}")
        if any(isinstance(op, (Offload, OffloadKept)) for op in schedule.ops) and (tier is None or transfers is None):
            raise ValueError("the schedule offloads, but no second tier was given: plan and run with offload=True "
                             "(or a directory)")
        self._tier = tier
        self.transfers = transfers or TransferPlan()
        self.prefetches = self.transfers.prefetches_before()
        self.option_executors = option_executors or [()] * len(stages)
        options = {}  # stage -> option of its latest F_all
        for op in schedule.ops:
            if isinstance(op, FAll):
                options[op.stage] = op.option
            elif isinstance(op, OffloadKept) and options.get(op.stage, 0) == 0:
                raise ValueError(f"{op}: only a block option's kept values can be offloaded, and stage {op.stage} "
                                 "runs option 0 (autograd's saved tensors)")
            if isinstance(op, FAll) and op.option != 0:
                executors = self.option_executors[op.stage]
                if op.option >= len(executors) or executors[op.option] is None:
                    raise UnsupportedModelError(
                        f"{op}: stage {op.stage} has no executor for option {op.option}; only option 0 (keep what "
                        "autograd keeps) runs on a chain of callables"
                    )
        self.stages = list(stages)
        self.sharded = sharded
        self.forward_executors = list(forward_executors or [None] * len(stages))
        self.schedule = schedule
        self.residents = residents
        # under FSDP2 a shared parameter is reduced once per step by its module's hooks already
        forms = [[stage, *(getattr(e, "stage", None) for e in executors if e is not None)]
                 for stage, executors in zip(self.stages, self.option_executors)]
        self.tied = TiedParameters(forms if sharded is None else ())
        #: How the caller used the output in the latest backward this runner executed (None before).
        self.observed_output_use: OutputUse | None = None
        #: Whether autocast was on in the latest backward this runner executed (the caller's recipe: one autocast
        #: context around forward and backward, or the forward's alone), None before.
        self.observed_backward_autocast: bool | None = None
        #: Where set, the steps on CPU record their stages' times there while it is recording (its module docstring)
        self.step_times: StepTimes | None = None
        self.loss_index = schedule.loss_index
        self.forward_counts = schedule.forward_counts()
        self.buffers = [
            stage_buffers(stage, names) if count > 1 else []
            for stage, names, count in zip(self.stages, mutated_buffers, self.forward_counts)
        ]

    @property
    def tier(self):
        """The second tier the next step offloads to (None where the schedule offloads nothing)."""
        return self._tier() if callable(self._tier) else self._tier

    def run(self, x: torch.Tensor, shared: tuple = ()):
        """Run the chain on x; every stage is called as ``stage(x_i, *shared)``.

        Without grad, or when the schedule keeps everything, the stages are simply called:
        plain autograd then does exactly what the schedule says, at no runner overhead (in
        the latter case an identity node on the output records how the caller used it).
        (A step timed there, ``step_times``, records its stages' forwards: one backward call
        times no stage.) Except where stages share a parameter (hierremat.runtime.tied): one
        backward call sums its gradient terms before accumulating them, holding the later
        readers' terms through the earlier readers' backward (a tied LM head's whole weight
        gradient through the whole chain), which the stages' costs, measured one backward at a
        time, do not count; the schedule then runs op by op.
        """
        autocast = AutocastState.capture((x.device.type,))
        if not torch.is_grad_enabled() or (self.schedule.keeps_everything and not self.tied):
            values: dict[int, torch.Tensor] = {}
            seconds = {} if torch.is_grad_enabled() and self.times_step(x) else None  # (the forwards alone)
            for i in range(len(self.stages)):
                started = time.perf_counter()
                with autocast.stage_scope():
                    out = self.call_stage(i, x, stage_shared(shared, values, self.residents))
                if seconds is not None:
                    seconds["forward", i] = [time.perf_counter() - started]
                x, made = split_output(out, self.residents, i)
                keep_made(values, self.residents, i, made, attached=True)
            if seconds is not None:
                self.step_times.record(seconds)
            out = x if not torch.is_grad_enabled() else self._observed(x)
            exported = self.exported(values)
            return (*as_tuple(out), *exported) if exported else out
        return self.run_schedule(x, shared)

    def times_step(self, x: torch.Tensor) -> bool:
        """Whether a step with grad on ``x`` records its stages' times (``step_times`` set and recording, on CPU)."""
        return self.step_times is not None and self.step_times.recording and x.device.type == "cpu"

    def exported(self, values: dict) -> tuple:
        """The residents the model returns (the chain returns them after the last stage's outputs)."""
        return () if self.residents is None else tuple(values[r] for r in self.residents.exported)

    def call_stage(self, i: int, x: torch.Tensor, shared: tuple):
        """Stage i on x: the stage itself, or through its FSDP2 module (``sharded``)."""
        if self.sharded is not None:
            return self.sharded.call(i, x, *shared)
        return self.stages[i](x, *shared)

    def observe(self, watch: OutputWatch, grads: tuple) -> None:
        """Record, as the chain's backward starts (its output's gradients ``grads``), how the caller used the
        output (``watch``) and whether that backward runs under autocast."""
        self.observed_output_use = watch.use(grads)
        self.observed_backward_autocast = backward_autocast(grads)

    def _observed(self, out):
        """``out`` through an identity autograd node whose backward records the OutputUse."""
        outputs = as_tuple(out)
        if not any(isinstance(o, torch.Tensor) and o.requires_grad for o in outputs):
            return out
        observed = _ObserveOutputUse.apply(self, *outputs)
        return tuple(observed) if isinstance(out, (tuple, list)) else observed[0]

    def run_schedule(self, x: torch.Tensor, shared: tuple = ()):
        """Execute the schedule op by op through the chain's autograd Function, even if it keeps everything."""
        anchor = torch.empty(0, requires_grad=True)  # makes autograd call our backward
        outputs = _ChainFunction.apply(_Step(self, x, tuple(shared)), x, anchor)
        return outputs if len(outputs) > 1 else outputs[0]


@dataclass(frozen=True)
class _AutogradTape:
    """What F_all(i) under autograd (option 0) leaves for B(i): the relay its output gradients are handed to, its
    input's sink (None where x_i needs no gradient) and the taps of the residents it read."""

    relay: GradRelay
    sink: torch.Tensor | None
    taps: tuple


@dataclass(frozen=True)
class _OptionRun:
    """What F_all(i, k), k > 0, leaves for B(i): option k's executor and the tape of its forward."""

    executor: OptionExecutor
    tape: OptionTape


class _Step:
    """State of one forward+backward of the chain."""

    def __init__(self, runner: ChainRunner, x0: torch.Tensor, shared: tuple):
        self.runner = runner
        self.shared = shared
        self.x: dict[int, torch.Tensor] = {0: x0.detach()}
        self.grad: dict[int, torch.Tensor | None] = {}
        self.tape: dict[int, _AutogradTape | _OptionRun] = {}
        self.rng: dict[int, RngState] = {}
        self.buffers_before: dict[int, list[torch.Tensor]] = {}
        self.runs = [0] * len(runner.stages)
        self.input_requires_grad = x0.requires_grad
        self.tap_anchor = torch.empty(0, device=x0.device, requires_grad=True)
        self.layout = runner.residents
        self.resident_values: dict[int, torch.Tensor] = {}
        self.resident_grads: dict[int, torch.Tensor] = {}
        self.cuda_devices = cuda_devices_of(x0)
        self.autocast = AutocastState.capture((x0.device.type,))
        self.stand_ins = runner.tied.stand_ins() if runner.tied else {}
        self.serial = next(_STEPS)  # (keys this step's values in the second tier)
        self.offloaded: set = set()
        self.versions: dict[int, int] = {}  # x_i -> its version counter when its copy out started
        self.kept_away: dict[int, tuple] = {}  # stage -> its tape's kept storages in the tier (kept_offload)
        self.tier = runner.tier if runner.transfers.moves_anything else None
        if self.tier is not None:  # a step freed before its backward leaves nothing in the tier
            weakref.finalize(self, self.tier.abandon, self.offloaded)
        #: seconds of each op timed, by (kind, stage) (hierremat.runtime.step_times), where the step is timed
        self.seconds: dict[tuple[str, int], list[float]] | None = {} if runner.times_step(x0) else None

    def run_forward(self) -> tuple:
        with self._dropping_offloaded_on_error():
            for index, op in enumerate(self.runner.schedule.ops[: self.runner.loss_index]):
                self._execute(op, index)
        outputs = as_tuple(self.x.pop(len(self.runner.stages)))
        self.output_watch = OutputWatch(outputs)
        return outputs + tuple(e.detach() for e in self.runner.exported(self.resident_values))

    def run_backward(self, grad_outputs: tuple) -> torch.Tensor | None:
        if self.layout is not None and self.layout.exported:
            count = len(grad_outputs) - len(self.layout.exported)
            for r, g in zip(self.layout.exported, grad_outputs[count:]):
                if g is not None:
                    self.resident_grads[r] = g
            grad_outputs = grad_outputs[:count]
        self.runner.observe(self.output_watch, grad_outputs)
        self.grad[len(self.runner.stages)] = grad_outputs
        # the caller's RNG state, restored after the replays (held only where some stage is
        # replayed: the plan reserves its bytes then, sequential._replay_reserve)
        replays = any(c > 1 for c in self.runner.forward_counts)
        outer_rng = RngState.capture(self.cuda_devices) if replays else None
        try:
            with self._dropping_offloaded_on_error():
                self._start_fetches(self.runner.loss_index)
                first = self.runner.loss_index + 1
                for index, op in enumerate(self.runner.schedule.ops[first:], first):
                    self._execute(op, index)
        finally:
            if outer_rng is not None:
                outer_rng.restore()
        if self.seconds is not None:  # (a complete step)
            self.runner.step_times.record(self.seconds)
        return self.grad.pop(0)

    @contextlib.contextmanager
    def _dropping_offloaded_on_error(self):
        """A step that fails leaves nothing in the second tier."""
        try:
            yield
        except BaseException:
            for key in list(self.offloaded):
                self.tier.discard(key)
            self.offloaded.clear()
            raise

    def _start_fetches(self, index: int) -> None:
        """Start bringing back the values the plan prefetches before op ``index``."""
        for stage, kept in self.runner.prefetches.get(index, ()):
            if kept:
                prefetch_kept(self.tier, self.kept_away[stage])
            else:
                self.tier.prefetch((self.serial, stage))

    def _execute(self, op, index: int) -> None:
        self._start_fetches(index)
        if index in self.runner.transfers.copy_starts:  # the copy out runs beside the forward sweep
            x = self.x[op.stage]
            self.tier.offload((self.serial, op.stage), x)
            self.offloaded.add((self.serial, op.stage))
            self.versions[op.stage] = x._version
            del x
        kind = self._timed_kind(op) if self.seconds is not None else None
        if kind is None:
            self._run(op)
            return
        started = time.perf_counter()
        self._run(op)
        self.seconds.setdefault((kind, op.stage), []).append(time.perf_counter() - started)

    def _timed_kind(self, op) -> str | None:
        """What ``op`` times as (hierremat.runtime.step_times.StepTimes): the stage's own no-grad forward
        (``"nograd"``), its forward with grad under autograd (option 0, ``"forward"``) and that forward's backward
        (``"backward"``); None for other ops (a block option, generated code, a transfer)."""
        if isinstance(op, FAll):
            return "forward" if op.option == 0 else None
        if isinstance(op, (FNone, FCk)):
            return "nograd" if self.runner.forward_executors[op.stage] is None else None
        if isinstance(op, Backward):
            return "backward" if isinstance(self.tape[op.stage], _AutogradTape) else None
        return None

    def _run(self, op) -> None:
        if isinstance(op, (FNone, FCk, FAll)):
            i = op.stage
            x = self.x[i] if isinstance(op, FCk) else self.x.pop(i)
            if isinstance(op, FAll) and op.option > 0:
                executor = self.runner.option_executors[i][op.option]
                with self.runner.tied.forward(i, self.stand_ins):
                    y, tape = self._forward(i, lambda: executor.forward(x, self._shared()))
                del x
                self.tape[i] = _OptionRun(executor, tape)
            elif isinstance(op, FAll):
                inp, sink = tap_input(x, self._input_anchor(i))
                del x
                shared, taps = tap_read(self._shared(), self.layout, i, self.tap_anchor)
                with torch.enable_grad(), self.runner.tied.forward(i, self.stand_ins):
                    out = self._forward(i, lambda: self._call(i, inp, shared))
                del inp, shared
                self.tape[i] = _AutogradTape(GradRelay(out), sink, taps)
                y, made = split_output(detach_output(out), self.layout, i)
                keep_made(self.resident_values, self.layout, i, made, replace=True)
                del out, made
            else:
                forward = self.runner.forward_executors[i]
                if forward is not None:
                    with torch.no_grad():
                        y = self._forward(i, lambda: forward(x, self._shared()))
                else:  # the stage itself, its kernels chosen as in its forward with grad (runtime/tapeless):
                    with tapeless():  # its input and residents tapped as there, so they require a gradient
                        inp = tap_input(x, self._input_anchor(i))[0]
                        shared = tap_read(self._shared(), self.layout, i, self.tap_anchor)[0]
                        y = detach_output(self._forward(i, lambda: self._call(i, inp, shared)))
                    del inp, shared
                del x
                y, made = split_output(y, self.layout, i)
                keep_made(self.resident_values, self.layout, i, made)
                del made
            if (i + 1) not in self.grad:
                self.x[i + 1] = y
        elif isinstance(op, Backward):
            with self.runner.tied.backward(op.stage, self.stand_ins):
                self._backward(op.stage)
        elif isinstance(op, Offload):
            x = self.x.pop(op.stage)
            self.tier.wait_offloaded((self.serial, op.stage))
            if x._version != self.versions.pop(op.stage):
                raise RuntimeError(
                    f"hierremat: x_{op.stage}, the input of stage {op.stage}, was modified in place while it was "
                    f"being offloaded (by stage {op.stage} or a later one): the copy may be torn. Make the stage "
                    "leave its input unchanged (no in-place op on it), or plan without offload="
                )
            del x
        elif isinstance(op, Fetch):
            key = (self.serial, op.stage)
            self.x[op.stage] = self.tier.fetch(key)
            self.offloaded.discard(key)
        elif isinstance(op, OffloadKept):
            i = op.stage
            executor, tape = self.tape[i].executor, self.tape[i].tape
            # (x_i itself: F_all(i) took it from the chain; the tape holds it where the option pins it)
            others = [tape.y, self.x.get(i + 1), *executor.binding.args(executor.program.forward_inputs, None,
                                                                         self._shared())]
            if not op.with_input:
                others.append(tape.x)
            away = send_kept(self.tier, (self.serial, i, "kept"), tape, others, op.with_input)
            del others
            self.kept_away[i] = away
            self.offloaded.update(stored.key for stored in away)
        elif isinstance(op, FetchKept):
            away = self.kept_away.pop(op.stage)
            bring_back_kept(self.tier, away, self.tape[op.stage].tape)
            self.offloaded.difference_update(stored.key for stored in away)
        else:
            raise TypeError(f"unexpected op {op!r}")

    def _backward(self, i: int) -> None:
        record = self.tape.pop(i)
        if isinstance(record, _AutogradTape):  # option 0: the stage's relay, its input's and residents' sinks
            sink, taps, relay = record.sink, record.taps, record.relay
            made = self.layout.produced_by(i) if self.layout is not None else ()
            relay.grads.extend(as_tuple(self.grad.pop(i + 1)))  # (the only references: freed once read)
            relay.grads.extend(self.resident_grads.pop(r, None) for r in made)
            edges, grads = read_roots(taps, self.resident_grads)
            relay.backward(edges, grads)
            del edges, grads, relay
            self.grad[i] = sink.grad if sink is not None else None
            collect_reads(taps, self.resident_grads)
            for r in made:  # every reader's backward has run
                del self.resident_values[r]
            del sink, taps
        else:  # a block option: its executor and the tape of its forward
            executor, tape, grad = record.executor, record.tape, self.grad.pop(i + 1)
            dx = None
            if i == len(self.runner.stages) - 1:  # the chain's output gradients: its one output's
                (grad,) = grad
            if grad is not None and self.layout is not None and self.layout.read_by(i):
                dx, sums = executor.backward_with_sums(  # (handing over the only reference to the seeds)
                    tape, grad, self._shared(), pop_seeds(self.layout, i, self.resident_grads))
                keep_sums(self.layout, sums, self.resident_grads)
                del sums
            elif grad is not None:
                dx = executor.backward(tape, grad, self._shared())
            self.grad[i] = dx if i > 0 or self.input_requires_grad else None
            del executor, tape, grad
        del record

    def _input_anchor(self, i: int) -> torch.Tensor | None:
        """The anchor that makes stage i's input require a gradient in a forward with grad (None
        where it needs none: the first stage's input, unless the caller's requires one)."""
        return self.tap_anchor if i > 0 or self.input_requires_grad else None

    def _shared(self) -> tuple:
        """What the stages are called with after x: the shared values, then the residents."""
        return stage_shared(self.shared, self.resident_values, self.layout)

    def _call(self, i: int, x: torch.Tensor, shared: tuple):
        out = self.runner.call_stage(i, x, shared)
        tuple_ok = i == len(self.runner.stages) - 1 or (self.layout is not None and bool(self.layout.produced_by(i)))
        return check_stage_output(i, self.runner.stages[i], out, tuple_ok)

    def _forward(self, i: int, run: Callable):
        """Run stage i's forward (``run()``) under the step's autocast setting; a replay gets the
        RNG state and buffers of the first run."""
        with self.autocast.stage_scope():
            return self._replayed(i, run)

    def _replayed(self, i: int, run: Callable):
        replay = self.runs[i] > 0
        self.runs[i] += 1
        if self.runner.forward_counts[i] == 1:
            return run()
        buffers = self.runner.buffers[i]
        if not replay:
            self.rng[i] = RngState.capture(self.cuda_devices)
            self.buffers_before[i] = [b.clone() for b in buffers]
            return run()
        self.rng[i].restore()
        updated = [b.clone() for b in buffers]
        # Through .data, so that the version counters that autograd checks on saved
        # buffers (BatchNorm saves its running stats) do not move.
        for b, before in zip(buffers, self.buffers_before[i]):
            b.data.copy_(before)
        try:
            return run()
        finally:
            for b, after in zip(buffers, updated):
                b.data.copy_(after)


_STEPS = itertools.count()


class _ObserveOutputUse(torch.autograd.Function):
    """Identity on the chain's outputs; its backward records how the caller used them, as the
    chain Function's backward does (the outputs' storages still alive, which got a gradient)."""

    @staticmethod
    def forward(ctx, runner: ChainRunner, *outputs: torch.Tensor) -> tuple:
        ctx.runner = runner
        ctx.set_materialize_grads(False)
        ctx.output_watch = OutputWatch(outputs)
        return outputs

    @staticmethod
    @eager_only
    @once_differentiable
    def backward(ctx, *grads):
        ctx.runner.observe(ctx.output_watch, grads)
        return (None, *grads)


class _ChainFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, step: _Step, x0: torch.Tensor, anchor: torch.Tensor) -> tuple:
        ctx.step = step
        ctx.set_materialize_grads(False)
        return step.run_forward()

    @staticmethod
    @eager_only
    @once_differentiable
    def backward(ctx, *grad_outputs: torch.Tensor):
        step, ctx.step = ctx.step, None
        if step is None:
            raise RuntimeError("hierremat: the chain's backward ran twice; call backward once per forward")
        return None, step.run_backward(grad_outputs), None
