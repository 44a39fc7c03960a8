"""Measuring memory: a live-tensor tracker (CPU and any device) and CUDA allocator peaks.

``LiveTensorTracker`` is a TorchDispatchMode that sees every ATen op, counts the bytes
of each *new* storage an op returns (outputs that alias an input, like views and
in-place results, are skipped through the op schema's alias info) and subtracts them
when a weakref finaliser on the storage fires, i.e. when the storage is really freed
(PyTorch preserves a storage's Python object while the storage lives). Storages that
existed before tracking started (parameters, inputs, ``.grad``) are never counted.
This is what the budget counts (see DESIGN.md, "What a budget counts").

A dispatch mode is switched off while an operator's own implementation runs, so the
tensors a ``torch.library`` operator makes inside it (hierremat's fused LM head's tile
logits) are invisible to it; such an operator hands them to :func:`track_hidden`.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from contextlib import contextmanager
from typing import Iterator

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.profiler.profiler import PROFILER_STEP_NAME
from torch.utils._python_dispatch import TorchDispatchMode


CUDA_ALLOCATION_ROUNDING_BYTES = 512


def is_abstract(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has a shape and a dtype but no memory: on the meta device, or a fake tensor
    (made under ``FakeTensorMode``, which says it is on a real device)."""
    return tensor.device.type == "meta" or is_fake(tensor)


def allocated_bytes(nbytes: int, device: torch.device | str) -> int:
    """Bytes a storage of ``nbytes`` takes from the meter that checks the budget on ``device``.

    The CUDA caching allocator rounds every block up to a multiple of 512 bytes (kMinBlockSize
    in c10/cuda/CUDACachingAllocator.cpp), which ``torch.cuda.max_memory_allocated`` counts:
    a BatchNorm's 128-byte saved mean takes 512. Elsewhere the live-tensor tracker counts
    storages exactly.
    """
    if torch.device(device).type != "cuda" or nbytes <= 0:
        return nbytes
    return -(-nbytes // CUDA_ALLOCATION_ROUNDING_BYTES) * CUDA_ALLOCATION_ROUNDING_BYTES


def owning(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it where it is a view into a larger storage.

    A gradient that outlives the backward that made it (a stage input's, a resident's sum)
    is counted at its own bytes by the cost models; cat's backward hands out slices of its
    incoming gradient, and such a slice would keep the whole of that gradient alive.
    """
    if t.untyped_storage().nbytes() <= t.numel() * t.element_size():
        return t
    return t.clone()


_ACTIVE = threading.local()  # .trackers: the LiveTensorTrackers entered on this thread


def _active_trackers() -> list:
    if not hasattr(_ACTIVE, "trackers"):
        _ACTIVE.trackers = []
    return _ACTIVE.trackers


def track_hidden(tensor: torch.Tensor) -> None:
    """Count ``tensor`` in every LiveTensorTracker active on this thread, while its storage
    lives: for a tensor an operator's implementation makes below the dispatcher, where the
    tracker's dispatch mode is off. Nothing happens without an active tracker, and a storage
    already counted is not counted twice."""
    for tracker in _active_trackers():
        tracker._track(tensor)


class LiveTensorTracker(TorchDispatchMode):
    """Live and peak bytes of the tensors created while the mode is active.

    Usage::

        with LiveTensorTracker() as tracker:
            loss = model(x).sum(); loss.backward()
        tracker.peak_bytes

    ``reset_peak()`` restarts the peak at the current live bytes; ``timeline`` (when
    ``record_timeline=True``) lists (op name, live bytes after it); ``allocations`` (when
    ``record_allocations=True``, else None) the live bytes just after each storage it counted,
    so that the peak since any moment is the largest of them since then (or the live bytes then).
    """

    def __init__(self, record_timeline: bool = False, record_allocations: bool = False):
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._tracked: dict[int, int] = {}
        self._lock = threading.Lock()
        self.record_timeline = record_timeline
        self.timeline: list[tuple[str, int]] = []
        self.allocations: list[int] | None = [] if record_allocations else None

    def __enter__(self) -> "LiveTensorTracker":
        _active_trackers().append(self)
        return super().__enter__()

    def __exit__(self, exc_type, exc_val, exc_tb):
        _active_trackers().remove(self)
        return super().__exit__(exc_type, exc_val, exc_tb)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.live_bytes

    def _release(self, key: int, nbytes: int) -> None:
        with self._lock:
            if self._tracked.pop(key, None) is not None:
                self.live_bytes -= nbytes

    def _track(self, tensor: torch.Tensor) -> None:
        if is_abstract(tensor):
            return  # no memory (fake tensors: something is traced while the mode is active)
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        try:
            key = storage.data_ptr()
        except RuntimeError:  # a functional tensor (traced inside the mode): no memory
            return
        if nbytes == 0:
            return
        with self._lock:
            if key in self._tracked:
                return
            self._tracked[key] = nbytes
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            if self.allocations is not None:
                self.allocations.append(self.live_bytes)
        weakref.finalize(storage, self._release, key, nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for idx, value in enumerate(outs):
            if not isinstance(value, torch.Tensor):
                continue
            if idx < len(returns) and returns[idx].alias_info is not None:
                continue  # a view or an in-place/out= result: no new storage
            self._track(value)
        if self.record_timeline:
            self.timeline.append((str(func), self.live_bytes))
        return out


class CudaPeakMeter:
    """Allocator-level live/peak bytes on one CUDA device, relative to when it started."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self) -> "CudaPeakMeter":
        torch.cuda.synchronize(self.device)
        self._base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize(self.device)

    @property
    def live_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device) - self._base

    @property
    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) - self._base

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)


class CpuAllocatorMeter:
    """Peak bytes the CPU allocator handed out while active, above what it held at the start,
    from ``torch.profiler``'s memory events.

    It sees what the live-tensor tracker cannot: buffers inside compiled code (Dynamo does not
    compile under a dispatch mode such as the tracker) and storages that are resized in place
    (FSDP2 frees a gathered parameter by resizing its storage to 0 and all-gathers into it
    again). It also counts kernels' internal scratch allocations, which the tracker leaves
    out. ``peak_bytes`` is read after the block.
    """

    def __enter__(self) -> "CpuAllocatorMeter":
        check_no_profiler("measure the CPU allocator's peak")
        self._session = cpu_memory_profile()
        self._profile = self._session.__enter__()
        self.peak_bytes = 0
        return self

    def __exit__(self, *exc) -> None:
        profile, self._profile = self._profile, None
        self._session.__exit__(*exc)
        self._session = None
        changes = cpu_allocator_changes(profile.profiler.kineto_results.events())
        del profile  # the profiler's results are not kept past this point
        live = 0
        for _, nbytes in changes:
            live += nbytes
            self.peak_bytes = max(self.peak_bytes, live)


def profiler_active() -> bool:
    """Whether a torch.profiler (autograd profiler) session records in this thread, or a ``torch.profiler.profile``
    is open in the process: from its construction to its ``__exit__``, its schedule's wait and warm-up steps
    included (torch's KinetoStepTracker counts its steps in that span; a session of ours started in a warm-up step,
    which has Kineto prepared but not recording, ended the caller's and crashed the process when it stopped: a
    segmentation fault). A profile started and stopped by hand (``start()``, ``stop()``) counts until its
    ``__exit__`` too: torch keeps its step count until then. What may wait for the caller's profiler (a
    RematModule's block options) waits while this holds; check_no_profiler raises only where a session of ours
    would do harm."""
    return torch._C._autograd._profiler_enabled() or _profile_open()


def _kineto_steps() -> dict:
    """torch's KinetoStepTracker step counts by requester (``torch.profiler.profile``'s: PROFILER_STEP_NAME)."""
    return getattr(torch.autograd.profiler.KinetoStepTracker, "_step_dict", {})


def _profile_open() -> bool:
    """Whether torch's KinetoStepTracker counts a ``torch.profiler.profile``'s steps (one constructed, not exited)."""
    return PROFILER_STEP_NAME in _kineto_steps()


def _profiler_warming_up() -> bool:
    """Whether a ``torch.profiler.profile`` is in a warm-up step of its schedule (Kineto prepared, not recording),
    found among the live objects (``gc.get_objects``: 0.1 s; looked for only while one is open, _profile_open).
    In a wait step a session of ours does no harm (the caller's trace came out whole); one stopped by hand in a
    warm-up step counts."""
    if not _profile_open():
        return False
    warmup = torch.profiler.ProfilerAction.WARMUP
    return any(issubclass(type(o), torch.profiler.profile) and o.current_action == warmup  # (type(): a dead weak
               for o in gc.get_objects())  # proxy among them raises on isinstance)


@contextmanager
def cpu_memory_profile() -> Iterator[torch.profiler.profile]:
    """A torch.profiler session recording the CPU allocator's events while in the block (its events read after).
    torch's KinetoStepTracker keeps one step count for every ``torch.profiler.profile``: ours, on exit (or on a
    failed start), would delete the caller's (a profile in a wait step, where a session of ours may run:
    check_no_profiler), which is put back as it was."""
    steps = _kineto_steps()
    callers = steps.get(PROFILER_STEP_NAME)
    profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    try:
        with profile:
            yield profile
    finally:
        torch.autograd.profiler.KinetoStepTracker.erase_step_count(PROFILER_STEP_NAME)
        if callers is not None:
            steps[PROFILER_STEP_NAME] = callers


def check_no_profiler(what: str) -> None:
    """Raise where a torch.profiler session records, or a scheduled one is in a warm-up step: a second one then ends
    the first (its events lost: an allocator meter around a step read 0 B where block options were built inside it;
    in a warm-up step the process crashed when the caller's stopped), so what measures the CPU allocator with one
    (``what``) cannot run then."""
    if torch._C._autograd._profiler_enabled() or _profiler_warming_up():
        raise RuntimeError(
            f"hierremat cannot {what} while a torch.profiler session records or a scheduled one is in a warm-up "
            "step (a second profiler session would end it, its events lost): plan outside it (call hierremat.plan/remat, "
            "and the model at each new input shape, before the profiler starts); a RematModule puts block options "
            "off while one is open, where the budget allows"
        )


def cpu_allocator_changes(events) -> list[tuple[int, int]]:
    """The CPU allocator's allocations (positive) and frees (negative) among a ``torch.profiler`` run's
    ``kineto_results.events()``: (start ns, bytes), in time order."""
    return sorted((e.start_ns(), e.nbytes()) for e in events
                  if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)


def allocator_peaks_in_marks(events, prefix: str) -> dict[str, tuple[int, int]]:
    """For each ``record_function`` range named ``prefix + name`` among a ``torch.profiler`` run's
    ``kineto_results.events()`` (ranges one after the other, not nested): (bytes the CPU allocator
    held when it started, the most it held until it ended), both counted from the run's start."""
    changes = cpu_allocator_changes(events)
    ranges = sorted((e.start_ns(), e.start_ns() + e.duration_ns(), e.name()[len(prefix):]) for e in events
                    if e.name().startswith(prefix))
    peaks, live, k = {}, 0, 0
    for start, end, name in ranges:
        while k < len(changes) and changes[k][0] < start:
            live += changes[k][1]
            k += 1
        base = peak = live
        while k < len(changes) and changes[k][0] <= end:
            live += changes[k][1]
            peak = max(peak, live)
            k += 1
        peaks[name] = (base, peak)
    return peaks


def _innermost_operators(events, thread: int) -> list[tuple[int, int]]:
    """(start ns, end ns) of the operators on ``thread`` that enclose no other one there, in time order."""
    ops = sorted((e.start_ns(), e.end_ns()) for e in events
                 if e.name() != "[memory]" and e.start_thread_id() == thread and e.device_type() ==
                 torch.autograd.DeviceType.CPU)
    return [(start, end) for k, (start, end) in enumerate(ops) if k + 1 == len(ops) or ops[k + 1][0] >= end]


def allocator_transients_in_marks(events, prefix: str) -> dict[str, int]:
    """For each ``record_function`` range named ``prefix + name`` (as allocator_peaks_in_marks): the most bytes
    the CPU allocator held inside one innermost operator of it above what it held at that operator's start and at
    its end, in bytes. That is what a kernel allocates and frees within one call (its scratch, which no tensor
    holds), wherever in the range it runs, not only at the tracked peak."""
    changes = cpu_allocator_changes(events)
    marks = [(e.start_ns(), e.end_ns(), e.name()[len(prefix):], e.start_thread_id()) for e in events
             if e.name().startswith(prefix)]
    innermost = {thread: _innermost_operators(events, thread) for *_, thread in marks}
    transients: dict[str, int] = {}
    for start, end, name, thread in marks:
        live, k, most = 0, 0, 0
        for op_start, op_end in innermost[thread]:
            if not start <= op_start <= end:
                continue
            while k < len(changes) and changes[k][0] < op_start:
                live += changes[k][1]
                k += 1
            before, highest = live, live
            while k < len(changes) and changes[k][0] <= op_end:
                live += changes[k][1]
                highest = max(highest, live)
                k += 1
            most = max(most, highest - max(before, live))
        transients[name] = most
    return transients


class MarkedAllocatorPeaks:
    """The CPU allocator's peak in each of several runs, each marked by name while a profile session
    records (``recording()``, around them all; ``mark(name)``, around each): what the live-tensor
    tracker sees plus the scratch kernels allocate below the dispatcher (oneDNN's convolution
    backward keeps a weight gradient per thread). Off (``enabled`` False, every peak 0) on other
    devices and where a torch.profiler session of the caller's records (check_no_profiler)."""

    PREFIX = "hierremat-run:"

    def __init__(self, device: torch.device):
        self.enabled = device.type == "cpu" and not (torch._C._autograd._profiler_enabled()
                                                     or _profiler_warming_up())
        self._peaks: dict[str, tuple[int, int]] = {}
        self._transients: dict[str, int] = {}

    @contextmanager
    def recording(self) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        with cpu_memory_profile() as profile:
            yield
        events = list(profile.profiler.kineto_results.events())
        del profile
        self._peaks = allocator_peaks_in_marks(events, self.PREFIX)
        self._transients = allocator_transients_in_marks(events, self.PREFIX)

    def mark(self, name: str):
        return torch.profiler.record_function(self.PREFIX + name) if self.enabled else contextlib.nullcontext()

    def peak(self, name: str) -> int:
        """The most bytes the allocator held during run ``name`` above what it held at its start (0 when off)."""
        base, peak = self._peaks.get(name, (0, 0))
        return peak - base

    def transient(self, name: str) -> int:
        """The most scratch one operator of run ``name`` held at once (allocator_transients_in_marks; 0 when off)."""
        return self._transients.get(name, 0)


def memory_meter(device: torch.device | str, record_allocations: bool = False):
    """The meter the budget is checked with on ``device``: allocator stats on CUDA, the tracker elsewhere
    (recording the live bytes after each allocation where ``record_allocations``: LiveTensorTracker)."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaPeakMeter(device)
    return LiveTensorTracker(record_allocations=record_allocations)


@contextmanager
def measure_peak(device: torch.device | str = "cpu") -> Iterator:
    """Context manager yielding a meter; read ``.peak_bytes`` after the block."""
    with memory_meter(device) as meter:
        yield meter


class WeightCastCounter(TorchDispatchMode):
    """Bytes of the copies made of the given parameters by ``_to_copy`` (the casts autocast
    makes of weights run as ``aten._to_copy`` below the Autocast dispatch key, so this mode,
    at the Python key, sees them); each new storage counted once."""

    def __init__(self, params):
        super().__init__()
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.bytes = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor):
            if args[0].untyped_storage().data_ptr() in self.params and not is_fake(out):
                key = out.untyped_storage().data_ptr()
                if key not in self._seen:
                    self._seen.add(key)
                    self.bytes += out.untyped_storage().nbytes()
        return out
