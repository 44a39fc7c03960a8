"""Measuring a chain's stage costs on the device it runs on.

For each stage, with the real input it receives, we measure: the no-grad forward's time
and peak; the grad forward's time, peak, the bytes autograd keeps for backward (live
bytes after the forward, less the output) and whether those keep the input's or the
output's storage (weakref finalisers on them); the backward's time and peak. Times are the least of
``repeats`` runs (run_seconds) after the runs that measure memory, which warm them up (``time.perf_counter`` on CPU,
CUDA events on GPU);
a stage whose no-grad forward takes over SLOW_STAGE_SECONDS keeps the times of the runs
that measure its memory (one each; its one-off costs are a small share of such a run): a
128k-vocabulary LM head at seq 2048 takes 2 s a run on a 2-core CPU, and 15 runs to profile
otherwise. Memory comes from the meter the budget is checked with (hierremat.device.memory).

Profiling leaves no trace: RNG states, buffers (BatchNorm running stats) and parameter
``.grad`` are restored afterwards. Parameters without ``.grad`` get a zero one while
profiling, so backward peaks are measured as in any step after the first (DESIGN.md).
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Sequence

import torch

from ..plans import clock
from ..plans.costs import ChainCosts, OptionCosts, ResidentCosts, StageCosts
from ..plans.memory_trace import MemoryTrace, stage_trace
from .executor import (
    as_tuple, check_stage_output, default_grad_mask, detach_output, watch_storages,
)
from .grad_taps import GradRelay, tap_input
from ..device.autocast import AutocastState
from ..device.memory import MarkedAllocatorPeaks, WeightCastCounter, allocated_bytes, memory_meter
from .residents import keep_made, split_output, stage_shared, tap_read
from ..device.rng import cuda_devices_of
from .stage_cost_cache import StageCostCache
from .tapeless import tapeless

#: Timed runs of each of a stage's no-grad forward, forward and backward whose least are its times.
PROFILE_REPEATS = 3
#: Seconds of a stage's no-grad forward (measured with its memory) above which its times are
#: those of the memory runs: one run each, its one-off costs a small share of it.
SLOW_STAGE_SECONDS = 0.5


@dataclass(frozen=True)
class ChainProfile:
    """Measured costs plus what the runtime needs to replay stages exactly.

    mutated_buffers[i]: names of stage i's buffers that its forward updates in place.
    output_grad_mask: per output of the last stage, whether it was profiled as receiving
        a gradient (costs.output_grad_bytes counts those).
    loss_bytes: bytes of the outputs that are scalar losses receiving a gradient: a caller
        holds each while it calls ``backward()`` on it, whatever else it releases.
    The chain's residents (values carried beside the activation) are in ``costs.residents``,
    counted by the chain DP while they are live.
    """

    costs: ChainCosts
    mutated_buffers: tuple[tuple[str, ...], ...]
    output_grad_mask: tuple[bool, ...]
    loss_bytes: int = 0
    memory_trace: MemoryTrace | None = None
    #: the fewest timed runs a stage profiled here took its times from (0: those of its memory runs,
    #: profile_chain's ``timed`` False); a stage's costs found in the cache or taken from ``known`` count as timed in
    #: full (PROFILE_REPEATS)
    repeats: int = PROFILE_REPEATS
    #: stages timed from one run, not PROFILE_REPEATS, because the planning deadline had passed (profile_chain)
    timed_once: int = 0


def storage_bytes(value) -> int:
    """Bytes of the distinct storages behind a tensor or a tuple of tensors, as the device's
    allocator counts them (rounded up to its block size on CUDA)."""
    return sum(_storages(as_tuple(value)).values())


def _storages(values) -> dict[int, int]:
    """The distinct storages of the tensors among ``values``: data pointer -> bytes, as the device's
    allocator counts them."""
    return {t.untyped_storage().data_ptr(): allocated_bytes(t.untyped_storage().nbytes(), t.device)
            for t in values if isinstance(t, torch.Tensor)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_seconds(samples) -> float:
    """A stage's time from the seconds of its timed runs: their least, as Python's ``timeit`` advises (other
    processes only ever add time to a run; benchmarks/bench_busy_plans.py compares it with their median)."""
    return min(samples)


def timed_seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """The time of ``fn()`` from ``repeats`` runs (run_seconds of their seconds; CUDA events on a GPU)."""
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return run_seconds(samples)


def _modules_state(stages: Sequence[Callable]):
    params, buffers = {}, {}
    for stage in stages:
        if isinstance(stage, torch.nn.Module):
            for p in stage.parameters():
                params[id(p)] = p
            for b in stage.buffers():
                buffers[id(b)] = b
    return list(params.values()), list(buffers.values())


@contextmanager
def no_side_effects(stages: Sequence[Callable], x0: torch.Tensor) -> Iterator[None]:
    """Restore RNG states and buffers after profiling."""
    _, buffers = _modules_state(stages)
    saved_buffers = [b.clone() for b in buffers]
    try:
        with torch.random.fork_rng(devices=list(cuda_devices_of(x0)), device_type="cuda"):
            yield
    finally:
        with torch.no_grad():
            for b, saved in zip(buffers, saved_buffers):
                b.copy_(saved)


@contextmanager
def scratch_grads(stage: Callable) -> Iterator[None]:
    """Give the stage's parameters zero ``.grad`` while profiling it, then put theirs back."""
    params, _ = _modules_state([stage])
    saved = [p.grad for p in params]
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    try:
        yield
    finally:
        for p, g in zip(params, saved):
            p.grad = g


def _mutated_buffer_names(stage: Callable, run: Callable[[], object]) -> tuple[str, ...]:
    """Run the stage once and name the buffers it changed.

    Native kernels may update a buffer without bumping its version counter (BatchNorm's
    running statistics), so values are compared as well.
    """
    if not isinstance(stage, torch.nn.Module):
        run()
        return ()
    before = {name: (b._version, b.clone()) for name, b in stage.named_buffers()}
    run()
    return tuple(
        name
        for name, b in stage.named_buffers()
        if name not in before or b._version != before[name][0] or not torch.equal(b, before[name][1])
    )


def _relay_with_ones(out, mask: tuple[bool, ...] | None, held: bool) -> tuple[GradRelay, tuple]:
    """The relay of a stage's outputs fed ones where a gradient is expected (mask), and those gradients where
    ``held`` (for the caller to hold through the backward, as the chain's caller holds the last stage's: else they
    are handed over, as the runner hands over the others': hierremat.runtime.grad_taps.GradRelay)."""
    relay = GradRelay(out)
    ones = _ones_for(out, mask)
    relay.grads.extend(ones)
    return relay, ones if held else ()


def _ones_for(out, mask: tuple[bool, ...] | None = None) -> tuple:
    """Output gradients for a profiling backward: ones where a gradient is expected (mask), else None."""
    outputs = as_tuple(out)
    mask = tuple(o.requires_grad for o in outputs) if mask is None else mask
    return tuple(torch.ones_like(o) if o.requires_grad and m else None for o, m in zip(outputs, mask))


def profile_chain(
    stages: Sequence[Callable],
    x0: torch.Tensor,
    *,
    shared: tuple = (),
    repeats: int = PROFILE_REPEATS,
    signatures: Sequence[str] | None = None,
    output_grad_mask: tuple[bool, ...] | None = None,
    cost_cache: StageCostCache | None = None,
    residents=None,
    timed: bool = True,
    known: ChainProfile | None = None,
    measure: frozenset[int] = frozenset(),
    deadline: float | None = None,
) -> ChainProfile:
    """Measure ChainCosts of ``stages`` applied in sequence to ``x0`` (``stage(x, *shared)``).

    Stages with equal ``signatures`` (same graph, shapes and dtypes) are measured once, and run once: a
    later one that makes no residents and updates no buffers passes on the first one's output (the
    same shape; its values only matter to sizes that depend on the data), so that a 32-layer model
    runs one layer, not 32.
    output_grad_mask: which outputs of the last stage receive a gradient (default:
    hierremat.runtime.executor.default_grad_mask). The costs assume the caller holds the
    whole output through the backward (``output_held_bytes``); planning may relax that.
    cost_cache: where the costs of stages with a signature are looked up before measuring,
    and stored after. residents: the values carried beside the activation
    (hierremat.plans.stage_info.ResidentLayout), or None; their bytes and their gradients' are the
    costs' ``residents`` (hierremat.plans.costs.ResidentCosts).
    timed: False measures memory only (the times are those of the single memory runs, for the
    caller to replace: hierremat.planning.shape_fit); such costs are not cached, nor are those timed with fewer
    ``repeats`` than PROFILE_REPEATS.
    known, measure: where ``known`` is given, only the stages in ``measure`` are measured, the others
    take their costs and buffer updates from ``known`` (fitted: hierremat.planning.shape_fit) and are
    only run without grad, for the next stage's input. The chain's sizes are measured.
    deadline: the planning deadline (hierremat.plans.clock); a stage measured after it is timed from one run
    (``ChainProfile.timed_once`` counts them; their costs are not cached). Its memory is measured in full.
    """
    run = _ChainProfiling(stages, x0, shared, signatures, output_grad_mask, cost_cache or StageCostCache(None),
                          residents, deadline)
    with no_side_effects(stages, x0):
        x = x0.detach()
        for i, stage in enumerate(stages):
            if known is not None and i not in measure:
                x = run.take_known(run.stage_run(i, stage), x, known)
            else:
                x = run.profile(run.stage_run(i, stage), x, repeats, timed)
    return run.result(x)


@dataclass(frozen=True)
class _StageRun:
    """One stage of a chain being profiled, with how it is called and what it is measured as."""

    i: int
    stage: Callable
    call: Callable  # the stage on its input, with its shared values and residents (_call_stage)
    inputs: tuple  # the values it is called with beside its input
    signature: str | None
    requires_grad: bool  # whether its input requires a gradient
    wanted_mask: tuple[bool, ...] | None  # which outputs get a gradient (the last stage's; None elsewhere)
    produced: int  # how many residents it makes
    last: bool

    @property
    def measured_as(self) -> tuple[str | None, bool, bool]:
        # (a first stage without an input gradient costs less; the last one's output gradients are held)
        return (self.signature, self.requires_grad, self.last)


class _ChainProfiling:
    """One :func:`profile_chain` call: the costs, traces and buffer updates of the stages profiled so far."""

    def __init__(self, stages, x0: torch.Tensor, shared: tuple, signatures, output_grad_mask,
                 cost_cache: StageCostCache, residents, deadline: float | None):
        self.stages, self.x0, self.shared, self.signatures = stages, x0, shared, signatures
        self.output_grad_mask, self.cost_cache, self.residents = output_grad_mask, cost_cache, residents
        self.autocast = AutocastState.capture((x0.device.type,))
        self.activation_bytes = [storage_bytes(x0)]
        self.stage_costs: list[StageCosts] = []
        self.mutated: list[tuple] = []
        self.traces: list[MemoryTrace | None] = []
        self.fewest = PROFILE_REPEATS  # (the fewest timed runs of a stage profiled here)
        self.measured: dict[tuple[str | None, bool, bool], int] = {}  # StageRun.measured_as -> the first stage measured so
        self.outputs_of: dict[str, object] = {}  # signature -> the output of its first stage (the others' next input)
        self.values: dict[int, torch.Tensor] = {}
        self.deadline = deadline
        self.timed_once = 0  # stages timed from one run because the deadline had passed

    def stage_run(self, i: int, stage) -> _StageRun:
        last = i == len(self.stages) - 1
        produced = len(self.residents.produced_by(i)) if self.residents is not None else 0
        inputs = stage_shared(self.shared, self.values, self.residents)
        call = functools.partial(_call_stage, stage, inputs, last or produced > 0, i, self.autocast,
                                 residents=self.residents)
        signature = self.signatures[i] if self.signatures is not None else None
        return _StageRun(i, stage, call, inputs, signature, i > 0 or self.x0.requires_grad,
                         self.output_grad_mask if last else None, produced, last)

    def take_known(self, run: _StageRun, x, known: ChainProfile):
        """Stage ``run.i``'s costs and buffer updates from ``known``, run without grad; returns its output."""
        with torch.no_grad():
            y = run.call(x)
        if run.last:
            self.output_grad_mask = known.output_grad_mask
        return self._record(run.i, known.costs.stages[run.i], known.mutated_buffers[run.i], None, y)

    def profile(self, run: _StageRun, x, repeats: int, timed: bool):
        """Stage ``run.i``'s costs, measured or taken from an identical stage or the cache; returns its output."""
        cached = None
        if run.signature is None or run.measured_as not in self.measured:
            if self.x0.device.type == "cuda":  # measured or cached, this process' threads need the kernels warm
                with scratch_grads(run.stage):
                    in_backward_thread(functools.partial(
                        _run_forward_and_backward, run.call, x, run.requires_grad, run.wanted_mask), self.x0.device)
            if run.signature is not None:
                cached = self.cost_cache.get_stage(run.signature, x, run.requires_grad, run.wanted_mask, run.last)
        if run.signature is not None and (run.measured_as in self.measured or cached is not None):
            cost, names, y, trace = self._reuse(run, x, cached)
        else:
            cost, names, y, trace = self._measure(run, x, repeats, timed)
        if run.signature is not None:
            self.outputs_of.setdefault(run.signature, y)
        return self._record(run.i, cost, names, trace, y)

    def _reuse(self, run: _StageRun, x, cached):
        """Costs of the first stage measured with ``run``'s signature, or ``cached`` ones; the stage runs
        without grad, or passes on the first one's output where it makes no residents and updates no buffers."""
        first = self.measured.get(run.measured_as)
        if first is not None and not run.produced and not self.mutated[first] and run.signature in self.outputs_of:
            y, names = self.outputs_of[run.signature], ()  # an identical stage: its first one's output will do
        else:
            outputs = []
            with torch.no_grad():
                names = _mutated_buffer_names(run.stage, lambda: outputs.append(run.call(x)))
            y = outputs[0]
        if first is not None:
            return replace(self.stage_costs[first], name=_stage_name(run.i, run.stage)), names, y, self.traces[first]
        cost, mask, trace = cached
        if run.last:
            self.output_grad_mask = mask
        self.measured[run.measured_as] = run.i
        return replace(cost, name=_stage_name(run.i, run.stage)), names, y, trace

    def _measure(self, run: _StageRun, x, repeats: int, timed: bool):
        """Measure the stage (:func:`_profile_stage`) and cache costs timed in full."""
        if timed and repeats > 1 and clock.passed(self.deadline):
            repeats, self.timed_once = 1, self.timed_once + 1
        with scratch_grads(run.stage):
            cost, names, y, mask, trace = _profile_stage(
                run.i, run.stage, run.call, x, run.requires_grad, repeats, self.x0.device, run.wanted_mask, run.produced,
                timed, run.inputs, run.last,
            )
        self.fewest = min(self.fewest, repeats if timed else 0)
        if run.last:
            self.output_grad_mask = mask
        if run.signature is not None:
            self.measured[run.measured_as] = run.i
            if timed and repeats >= PROFILE_REPEATS:  # (costs timed in full alone are cached)
                self.cost_cache.put_stage(
                    run.signature, x, run.requires_grad, run.wanted_mask, cost, mask if run.last else None, trace,
                    run.last,
                )
        return cost, names, y, trace

    def _record(self, i: int, cost: StageCosts, names: tuple, trace: MemoryTrace | None, y):
        """Record stage i's costs; returns its output's activation: the next stage's input."""
        self.stage_costs.append(cost)
        self.traces.append(trace)
        self.mutated.append(names)
        y, made = split_output(y, self.residents, i)
        keep_made(self.values, self.residents, i, made)
        self.activation_bytes.append(storage_bytes(y))
        return y

    def result(self, x) -> ChainProfile:
        """The chain's profile, ``x`` the last stage's output."""
        output_grad_mask = self.output_grad_mask
        if output_grad_mask is None:  # the last stage shared a signature with an earlier one: one output
            output_grad_mask = (True,)
        with_grad = [o for o, m in zip(as_tuple(x), output_grad_mask) if m]
        losses = tuple(o for o in with_grad if o.numel() == 1)
        costs = ChainCosts(
            tuple(self.activation_bytes), tuple(self.stage_costs), input_requires_grad=self.x0.requires_grad,
            output_grad_bytes=storage_bytes(tuple(with_grad)),
            residents=_resident_costs(self.residents, self.values),
        )
        loss_bytes = storage_bytes(losses) if losses else 0
        return ChainProfile(
            costs, tuple(self.mutated), output_grad_mask, loss_bytes, _chain_trace(costs, self.traces, loss_bytes),
            self.fewest, self.timed_once,
        )


def _chain_trace(costs: ChainCosts, traces: list[MemoryTrace | None], loss_bytes: int) -> MemoryTrace | None:
    """The chain's MemoryTrace: its stages' (None where one has none) and its sizes, each its own candidate."""
    if any(t is None for t in traces):
        return None
    sizes = [(f"activation{j}", (b,)) for j, b in enumerate(costs.activation_bytes)]
    sizes += [("output_grad", (costs.output_grad_bytes,)), ("loss", (loss_bytes,))]
    for r, resident in enumerate(costs.residents):
        sizes += [(f"resident{r}.value", (resident.value_bytes,)), (f"resident{r}.grad", (resident.grad_bytes,))]
    chain = MemoryTrace(tuple(sizes))
    for i, trace in enumerate(traces):
        chain = chain.plus(trace.prefixed(f"stage{i}."))
    return chain


def _resident_costs(layout, values: dict[int, torch.Tensor]) -> tuple[ResidentCosts, ...]:
    """Each resident's bytes and its gradient's (a floating value's, as the readers' taps give it)."""
    if layout is None:
        return ()
    costs = []
    for r, (producer, readers) in enumerate(zip(layout.producers, layout.readers)):
        nbytes = storage_bytes(values[r])
        costs.append(ResidentCosts(producer, readers, nbytes, nbytes if values[r].is_floating_point() else 0,
                                   r in layout.exported))
    return tuple(costs)


def profile_stage(
    index: int, stage: Callable, x: torch.Tensor, shared: tuple, *, last: bool, requires_grad: bool,
    grad_mask: tuple[bool, ...] | None = None, repeats: int = 3,
) -> tuple[StageCosts, tuple[bool, ...]]:
    """The costs of one stage on its input ``x``, measured as profile_chain measures a stage
    (the stage called as the runtime calls it; RNG, buffers and ``.grad`` left as they were),
    and the output gradient mask used. For a stage in another form (hierremat.planning.output_stage)."""
    autocast = AutocastState.capture((x.device.type,))
    call = functools.partial(_call_stage, stage, shared, last, index, autocast)
    with no_side_effects([stage], x), scratch_grads(stage):
        cost, _, _, mask, _ = _profile_stage(index, stage, call, x.detach(), requires_grad, repeats, x.device, grad_mask,
                                             last=last)
    return cost, mask


def _call_stage(
    stage: Callable, shared: tuple, last: bool, index: int, autocast: AutocastState, x: torch.Tensor,
    residents=None,
):
    """The stage called as the runtime calls it (in the autocast stage scope). In grad mode, the
    floating residents it reads (``residents``: a ResidentLayout) are tapped as the runner taps
    them, so that its backward computes their gradients."""
    if residents is not None and torch.is_grad_enabled():
        shared, _ = tap_read(shared, residents, index, torch.empty(0, device=x.device, requires_grad=True))
    with autocast.stage_scope():
        out = stage(x, *shared)
    return check_stage_output(index, stage, out, last)


class _CallInBackward(torch.autograd.Function):
    """Identity on an anchor whose backward calls ``fn`` (on the autograd engine's thread)."""

    @staticmethod
    def forward(ctx, anchor, fn):
        ctx.fn = fn
        return anchor.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.fn()
        return None, None


def in_backward_thread(fn: Callable[[], object], device: torch.device) -> None:
    """Call ``fn`` where the autograd engine runs backward functions for ``device``.

    On CUDA that is a thread of its own, and cuBLAS/cuBLASLt give each thread its own handle,
    whose workspace (about 1 MiB to 32 MiB) the caching allocator hands out on first use and
    keeps for good. Recomputations run on that thread, so profile_chain warms every distinct
    stage's kernels there before measuring it (or taking its costs from the cache): otherwise
    the first training step would allocate workspaces that no profiled cost contains and
    overshoot the budget once.
    """
    anchor = torch.zeros((), device=device, requires_grad=True)
    _CallInBackward.apply(anchor, fn).backward()


def _grad_forward(call: Callable, x: torch.Tensor, requires_grad: bool):
    """The stage's forward with grad on x, its input gradient (if ``requires_grad``) caught by a tap."""
    anchor = torch.empty(0, device=x.device, requires_grad=True) if requires_grad else None
    with torch.enable_grad():
        return call(tap_input(x, anchor)[0])


def _run_forward_and_backward(call: Callable, x: torch.Tensor, requires_grad: bool, grad_mask) -> None:
    with torch.no_grad():
        call(x)
    out = _grad_forward(call, x, requires_grad)
    relay, _ = _relay_with_ones(out, default_grad_mask(out) if grad_mask is None else grad_mask, held=False)
    del out
    relay.backward()


class _PeakRun:
    """A peak on ``meter`` from now on: ``end()`` sets ``peak``, the most bytes live until then above
    those live now, and ``candidates``, the live bytes above them after each storage allocated
    meanwhile (with 0: their largest is the peak), where the meter records allocations (the
    live-tensor tracker), else None (hierremat.plans.memory_trace). With ``allocator``, the run is
    marked ``name`` there, and ``scratch()`` gives what the allocator saw above the peak."""

    def __init__(self, meter, allocator: MarkedAllocatorPeaks | None = None, name: str = ""):
        meter.reset_peak()
        self.meter, self.base = meter, meter.live_bytes
        allocations = getattr(meter, "allocations", None)
        self._start = None if allocations is None else len(allocations)
        self.candidates: tuple[int, ...] | None = None
        self.peak = 0
        self._allocator, self._name = allocator, name
        self._mark = allocator.mark(name) if allocator is not None else None
        if self._mark is not None:
            self._mark.__enter__()

    def end(self) -> int:
        if self._mark is not None:
            self._mark.__exit__(None, None, None)
            self._mark = None
        if self._start is not None:
            self.candidates = (0, *(a - self.base for a in self.meter.allocations[self._start:]))
        self.peak = self.meter.peak_bytes - self.base
        return self.peak

    def scratch(self) -> int:
        """The kernels' scratch on top of this run's tracked peak, in bytes, once the allocator's session ended
        (0 without one): the allocator's peak above the tracked one, or the most one operator held at once
        where more (an operator's scratch outside the tracked peak meets a higher tracked level in a chain
        whose other stages hold more there)."""
        if self._allocator is None or not self._allocator.enabled:
            return 0
        return max(0, self._allocator.peak(self._name) - self.peak, self._allocator.transient(self._name))


def _with_floor(run: _PeakRun | None, *floors: int) -> tuple[int, ...] | None:
    """The candidates of a peak that is at least ``floors`` (None without the run's candidates)."""
    if run is None:
        return (0, *floors)
    return None if run.candidates is None else run.candidates + floors


def _profile_stage(
    i: int, stage: Callable, call: Callable, x: torch.Tensor, requires_grad: bool, repeats: int, device: torch.device,
    grad_mask: tuple[bool, ...] | None, produced: int = 0, timed: bool = True, existing: tuple = (), last: bool = False,
):
    """Costs of one stage on input x, its backward fed gradients for the outputs in ``grad_mask``
    (None: hierremat.runtime.executor.default_grad_mask). ``produced``: how many residents it
    makes (outputs after x_{i+1}, each fed a gradient; their bytes are the plan's resident
    reserve, not the stage's: storages they hold are neither kept nor pinned by it). ``timed``
    False: memory only, the times of the single runs. ``existing``: the values it is called with
    beside x (a resident that is a view of one of them allocated nothing here). ``last``: the chain's last stage,
    whose output gradients its caller holds through the backward (the runner hands the others' over).
    Returns (StageCosts, mutated buffer names, output, the mask used, the costs' MemoryTrace or None
    where the meter records no allocations)."""
    params, buffers = _modules_state([stage])
    with torch.no_grad(), WeightCastCounter(params) as casts:
        mutated = _mutated_buffer_names(stage, lambda: call(x))  # also the warm-up
    meter = memory_meter(device, record_allocations=True)
    allocator = MarkedAllocatorPeaks(device)  # (the tracker does not see the kernels' scratch: CPU allocator)
    with allocator.recording(), meter:
        nograd = _PeakRun(meter, allocator, "nograd")
        started = time.perf_counter()
        with tapeless():  # as the runner runs F_none / F_ck of the stage itself
            y = detach_output(call(x))
        _sync(device)
        nograd_time = time.perf_counter() - started
        nograd_peak = nograd.end()
        out_bytes = storage_bytes(y[0] if produced else y)
        tape = _tape_runs(meter, allocator, call, x, requires_grad, grad_mask, produced, (*params, *buffers),
                          existing, out_bytes, device, last)
        new_grads = _bwd_run_with_new_grads(call, x, requires_grad, tape.grad_mask, params, meter, produced, allocator,
                                            last)
    times = (nograd_time, tape.fwd_time, tape.bwd_time)
    if timed and nograd_time <= SLOW_STAGE_SECONDS:  # (a slow stage keeps the single runs' times: one-offs are a small share)
        times = _timed_runs(call, x, requires_grad, repeats, device, tape.grad_mask)
    grad_bytes = storage_bytes(x) if requires_grad else 0
    cost, trace = _stage_costs(_stage_name(i, stage), times, casts.bytes, nograd, nograd_peak, tape, new_grads,
                               out_bytes, grad_bytes)
    return cost, mutated, y, tape.grad_mask, trace


@dataclass(frozen=True)
class _TapeRuns:
    """A stage's forward under autograd and its backward, as :func:`_tape_runs` measured them."""

    grad_mask: tuple[bool, ...]
    fwd_time: float  # seconds
    fwd_peak: int  # bytes over the run's base
    fwd_run: "_PeakRun"
    held: int  # bytes the forward left: its output and tape
    kept: int  # bytes of tape (held less the output)
    pins_input: bool
    pins_output: bool
    bwd_time: float = 0.0
    bwd_peak: int = 0
    bwd_run: "_PeakRun | None" = None


def _tape_runs(meter, allocator, call, x, requires_grad, grad_mask, produced, state, existing, out_bytes,
               device, last: bool) -> _TapeRuns:
    """Run the stage's forward under autograd on a copy of ``x``, then its backward, under ``meter``: their times,
    peaks, the tape kept and whether it pins the stage's input or output storages. ``state``: its parameters and
    buffers (a resident made as a view of one allocated nothing). ``last``: the output gradients are held through
    the backward, as the chain's caller holds them, else handed over."""
    anchor = torch.empty(0, device=device, requires_grad=True) if requires_grad else None
    x_copy = x.detach().clone()  # a storage of its own, to see whether the tape keeps it
    inp, sink = tap_input(x_copy, anchor)
    run = _PeakRun(meter, allocator, "forward")
    started = time.perf_counter()
    with torch.enable_grad():
        out = call(inp)
    _sync(device)
    fwd_time = time.perf_counter() - started
    fwd_peak, fwd_run = run.end(), run
    grad_mask = default_grad_mask(out) if grad_mask is None else grad_mask
    held = meter.live_bytes - run.base  # what the forward left: its output, residents and tape
    relay, held_grads = _relay_with_ones(out, grad_mask, held=last)
    made = _residents_made(out, produced)
    resident_storages = _storages(made)
    if produced:  # the residents it made are the plan's resident reserve (ChainCosts.resident_values_of), not kept
        out = out[0]
        before = _storages((out, x_copy, *state, *as_tuple(existing)))
        held -= sum(n for ptr, n in resident_storages.items() if ptr not in before)
    # pins: storages the tape keeps of x_i and x_{i+1}, those a resident holds left out (its reserve's)
    input_freed, input_watched = watch_storages(
        () if x_copy.untyped_storage().data_ptr() in resident_storages else x_copy)
    outputs_freed, output_storage_bytes = watch_storages(
        tuple(t for t in as_tuple(out) if t.untyped_storage().data_ptr() not in resident_storages))
    del out, inp, x_copy
    _sync(device)
    runs = _TapeRuns(grad_mask, fwd_time, fwd_peak, fwd_run, held, max(0, held - out_bytes),
                     sum(input_freed) < input_watched, sum(outputs_freed) < output_storage_bytes)
    if relay.root is not None:
        run = _PeakRun(meter, allocator, "backward")
        started = time.perf_counter()
        relay.backward()
        _sync(device)
        runs = replace(runs, bwd_time=time.perf_counter() - started, bwd_peak=run.end(), bwd_run=run)
    del relay, held_grads, sink, made
    return runs


def _stage_costs(name: str, times: tuple[float, float, float], cast_bytes: int, nograd: "_PeakRun", nograd_peak: int,
                 tape: _TapeRuns, new_grads: "_PeakRun | None", out_bytes: int, grad_bytes: int):
    """The StageCosts of a stage's measured runs (``times``: its no-grad forward, forward and backward, seconds)
    and their MemoryTrace (None where the meter records no allocations)."""
    scratch = {  # (the kernels' scratch, on top of each figure: hierremat.plans.memory_trace.SCRATCH)
        "nograd_fwd_overhead_bytes": nograd.scratch(), "fwd_overhead_bytes": tape.fwd_run.scratch(),
        "bwd_overhead_bytes": tape.bwd_run.scratch() if tape.bwd_run is not None else 0,
        "bwd_overhead_new_grads_bytes": new_grads.scratch() if new_grads is not None else 0,
    }
    nograd_time, fwd_time, bwd_time = times
    option = OptionCosts(
        fwd_time=fwd_time,
        bwd_time=bwd_time,
        kept_bytes=tape.kept,
        fwd_overhead_bytes=max(tape.fwd_peak, tape.kept + out_bytes) + scratch["fwd_overhead_bytes"],
        bwd_overhead_bytes=max(tape.bwd_peak, grad_bytes) + scratch["bwd_overhead_bytes"],
        pins_output=tape.pins_output,
        pins_input=tape.pins_input,
        bwd_overhead_new_grads_bytes=None if new_grads is None
        else max(new_grads.peak, grad_bytes) + scratch["bwd_overhead_new_grads_bytes"],
    )
    cost = StageCosts(
        nograd_fwd_time=nograd_time,
        nograd_fwd_overhead_bytes=max(nograd_peak, out_bytes) + scratch["nograd_fwd_overhead_bytes"],
        options=(option,),
        name=name,
        weight_cast_bytes=cast_bytes,
    )
    trace = None
    if nograd.candidates is not None:  # kept + out_bytes = max(out_bytes, held)
        trace = stage_trace(
            nograd_fwd_overhead_bytes=_with_floor(nograd, out_bytes),
            kept_bytes=(0, tape.held - out_bytes),
            fwd_overhead_bytes=_with_floor(tape.fwd_run, out_bytes, tape.held),
            bwd_overhead_bytes=_with_floor(tape.bwd_run, grad_bytes),
            bwd_overhead_new_grads_bytes=None if new_grads is None else _with_floor(new_grads, grad_bytes),
            scratch=scratch,
        )
    return cost, trace


def _residents_made(out, produced: int) -> tuple:
    """The residents among a stage's outputs (after x_{i+1}): the runner holds them through the
    stage's backward (hierremat.runtime.executor: freed after it), so its profile does too; the
    storages its tape saved of them are then not freed by that backward."""
    return tuple(as_tuple(out)[1:]) if produced else ()


def _bwd_run_with_new_grads(call: Callable, x: torch.Tensor, requires_grad: bool, grad_mask, params: list,
                            meter, produced: int = 0, allocator: MarkedAllocatorPeaks | None = None,
                            last: bool = False) -> _PeakRun | None:
    """The stage's backward run when its parameters' ``.grad`` is None (PyTorch's default
    ``zero_grad(set_to_none=True)``): the gradients it makes stay instead of being added into ``.grad``
    and freed (its peak: OptionCosts.bwd_overhead_new_grads_bytes). None where the stage has no
    trainable parameter or no backward. The parameters' ``.grad`` are put back after."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        return None
    saved = [p.grad for p in trainable]
    try:
        for p in trainable:
            p.grad = None
        out = _grad_forward(call, x, requires_grad)
        (relay, held_grads), made = _relay_with_ones(out, grad_mask, held=last), _residents_made(out, produced)
        del out
        if relay.root is None:
            return None
        run = _PeakRun(meter, allocator, "backward with new gradients")
        relay.backward()
        run.end()
        del made, held_grads  # (held through the backward, as the runner holds a stage's residents)
        return run
    finally:
        for p, g in zip(trainable, saved):
            p.grad = g


def _timed_runs(call: Callable, x: torch.Tensor, requires_grad: bool, repeats: int, device: torch.device,
                grad_mask) -> tuple[float, float, float]:
    """Seconds of the no-grad forward, the grad forward and the backward (run_seconds of their runs). No warm-up of their own: the
    caller (_profile_stage) ran each of them just before, for memory, which paid their one-off costs."""
    with torch.no_grad():
        nograd_time = timed_seconds(lambda: call(x), repeats, device)

    grad_forward = functools.partial(_grad_forward, call, x, requires_grad)
    fwd_samples, bwd_samples = [], []
    for _ in range(repeats):  # each timed forward's backward is the timed backward (a forward less per sample)
        made = []
        fwd_samples.append(timed_seconds(lambda: made.append(grad_forward()), 1, device))
        relay, _ = _relay_with_ones(made.pop(), grad_mask, held=False)
        if relay.root is not None:
            bwd_samples.append(timed_seconds(relay.backward, 1, device))
        del relay
    return nograd_time, run_seconds(fwd_samples), run_seconds(bwd_samples) if bwd_samples else 0.0


def _stage_name(i: int, stage: Callable) -> str:
    if isinstance(stage, torch.nn.Module):
        return type(stage).__name__
    return getattr(stage, "__name__", type(stage).__name__)
