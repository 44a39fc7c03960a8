"""Where offloaded values wait for their backward: the second tier of storage.

Beaumont, Eyraud-Dubois and Shilova (NeurIPS 2021, "Efficient Combination of Rematerialization and
Offloading for Training DNNs") send a checkpointed activation off the device while the next stages
compute, and bring it back before the backward that reads it. The tiers it goes to share one
interface, :class:`SecondTier`:

- :class:`HostMemoryTier` (CUDA): one host pool of ``limit_bytes`` (the plan's most offloaded bytes),
  allocated when the tier is made and reused across steps (pinning per tensor costs about 3 ms per
  ``cudaHostAlloc`` and blocks overlap), pinned on CUDA; copies run on one side stream ordered with the
  compute stream by events, and a prefetch starts the copy back ahead of the backward. On a CPU device it
  copies synchronously (its bookkeeping is the same: how it is tested here).
- :class:`DiskTier` (CPU): one file per value in a directory of its own (POET's paging, Patil et al.,
  ICML 2022): the process's RAM is freed. Each file is unlinked as soon as it is opened and kept by its
  descriptor, so the space returns on any exit, a killed process's included; the directory is removed
  on close, on error and at exit. Writes and read-ahead run in order on one background thread.

Every tier: ``offload(key, tensor)`` starts moving a value out and holds it until the copy is done (the
caller drops its own reference: the device memory is freed then; ``wait_offloaded(key)`` waits for that,
the host memory tier on CUDA by making the compute stream wait, not the host; the caller must not change
the value in place before); ``prefetch(key)`` starts bringing it back; ``fetch(key)`` returns it on the
device with its strides (a channels-last value stays one), waiting for the copy. A write or read that
does not move every byte raises :class:`OffloadError` (a step never goes on with a partial value).
``close()`` drops what the tier holds. ``held_bytes`` and ``peak_bytes`` are the tier's own use (for the disk,
:attr:`DiskTier.file_bytes` are the files' sizes).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false

from ..errors import OffloadError

log = logging.getLogger(__name__)

#: Offsets in the host pool are multiples of this (every dtype's view of a slot is aligned).
POOL_ALIGNMENT = 64
#: File systems whose files are memory: a disk tier there frees no RAM.
MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs")


@dataclass(frozen=True)
class _Stored:
    """What a tier needs to rebuild a value: shape, strides (a dense layout: the bytes are in memory order),
    dtype and bytes."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int

    def rebuild(self, data: torch.Tensor) -> torch.Tensor:
        """The value from its bytes (``data``: uint8, on the device it is wanted on, a storage of its own),
        viewing them (no copy: a fetch holds the value's bytes once)."""
        if not self.nbytes:
            return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=data.device)
        return data.view(self.dtype).as_strided(self.shape, self.stride)


def _bytes_of(tensor: torch.Tensor) -> tuple[torch.Tensor, _Stored]:
    """``tensor``'s bytes as a flat uint8 tensor in memory order (a view where its layout is dense), and
    what rebuilds it."""
    if tensor.layout != torch.strided or type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        raise OffloadError(f"a {tensor.layout} {type(tensor).__name__} cannot be offloaded: only dense tensors")
    value = tensor.detach().resolve_conj().resolve_neg()
    if not is_non_overlapping_and_dense_or_false(value):  # (its elements fill a block of memory of its size)
        value = value.contiguous()
    nbytes = value.numel() * value.element_size()
    stored = _Stored(tuple(value.shape), tuple(value.stride()), value.dtype, nbytes)
    if not nbytes:
        return torch.empty(0, dtype=torch.uint8, device=value.device), stored
    flat = value.as_strided((value.numel(),), (1,), value.storage_offset())
    return flat.view(torch.uint8), stored


class SecondTier:
    """The interface of a second tier (module docstring). ``limit_bytes``: the most it may hold at once."""

    kind = "none"

    def __init__(self, limit_bytes: int):
        if limit_bytes <= 0:
            raise ValueError(f"offload_limit={limit_bytes} bytes: give the second tier a positive size")
        self.limit_bytes = limit_bytes
        self.held_bytes = 0
        self.peak_bytes = 0
        self._stored: dict[object, _Stored] = {}
        self._abandoned: collections.deque = collections.deque()  # keys to drop, from any thread (abandon)
        self.closed = False

    def offload(self, key, tensor: torch.Tensor) -> None:
        if self.closed:
            raise OffloadError(f"offload: the {self.kind} tier is closed")
        self._drop_abandoned()
        if key in self._stored:
            raise KeyError(f"offload: {key!r} is already in the {self.kind} tier")
        data, stored = _bytes_of(tensor)
        if self.held_bytes + stored.nbytes > self.limit_bytes:
            raise OffloadError(
                f"the {self.kind} tier would hold {self.held_bytes + stored.nbytes} bytes, over the {self.limit_bytes} "
                "it may hold (offload_limit, or the pool sized for the plan; steps that overlap, as several chains "
                "run before one backward, share it): raise offload_limit"
            )
        self._start_offload(key, data, stored)  # (registered only once started: a failure leaves no trace)
        self._stored[key] = stored
        self.held_bytes += stored.nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def wait_offloaded(self, key) -> None:
        """Order what follows after ``key``'s copy out (its device memory is free then, if nobody else holds it):
        it returns once the copy is done, except the host memory tier's on CUDA, where the compute stream waits
        for it instead of the host."""
        self._stored[key]  # (a KeyError for a key the tier does not hold)
        self._finish_offload(key)

    def prefetch(self, key) -> None:
        self._drop_abandoned()
        self._start_fetch(key, self._stored[key])

    def fetch(self, key) -> torch.Tensor:
        stored = self._stored[key]
        try:
            return self._finish_fetch(key, stored)
        finally:
            self.discard(key)

    def discard(self, key) -> None:
        """Drop ``key``'s value without fetching it (a step that failed); nothing if absent."""
        stored = self._stored.pop(key, None)
        if stored is not None:
            self.held_bytes -= stored.nbytes
            self._forget(key)

    def abandon(self, keys) -> None:
        """Mark ``keys`` to be dropped (a step freed before its backward ran): safe from any thread, a garbage
        collector's finalizer included; they are dropped by the next offload, prefetch or close (on the
        thread that uses the tier)."""
        self._abandoned.extend(keys)

    def _drop_abandoned(self) -> None:
        while self._abandoned:
            self.discard(self._abandoned.popleft())

    def __contains__(self, key) -> bool:
        return key in self._stored

    def __enter__(self) -> "SecondTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._abandoned.clear()
        for key in list(self._stored):
            self._forget(key)
        self._stored.clear()
        self.held_bytes = 0
        self.closed = True

    # what a tier implements
    def _start_offload(self, key, data: torch.Tensor, stored: _Stored) -> None:
        raise NotImplementedError

    def _finish_offload(self, key) -> None:
        raise NotImplementedError

    def _start_fetch(self, key, stored: _Stored) -> None:
        raise NotImplementedError

    def _finish_fetch(self, key, stored: _Stored) -> torch.Tensor:
        raise NotImplementedError

    def _forget(self, key) -> None:
        """Drop whatever the tier keeps for ``key`` (after its fetch, or at close)."""
        raise NotImplementedError


def file_system(path: str | os.PathLike) -> tuple[str, str]:
    """(mount point, file system type) that ``path`` is on, from /proc/mounts (('', '') where unknown)."""
    path = os.path.realpath(path)
    best = ("", "")
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) >= 3:
                    point = fields[1].replace("\\040", " ")
                    inside = path == point or path.startswith(point.rstrip("/") + "/")
                    if inside and len(point) > len(best[0]):
                        best = (point, fields[2])
    except OSError:
        pass
    return best


def _remove_directory(path: str, pool: concurrent.futures.ThreadPoolExecutor, descriptors: dict) -> None:
    try:
        pool.shutdown(wait=True, cancel_futures=True)
    except RuntimeError:  # (collected on the worker thread itself: it cannot join itself)
        pool.shutdown(wait=False, cancel_futures=True)
    finally:
        for fd in list(descriptors.values()):
            try:
                os.close(fd)
            except OSError:
                pass
        descriptors.clear()
        shutil.rmtree(path, ignore_errors=True)


class DiskTier(SecondTier):
    """Values in files, one per value, under a directory this tier makes (in ``directory``, default the
    system's temporary directory) and removes. Checked when it is made, before training: the directory
    can be made and written, and its file system has ``limit_bytes`` free; one whose files are memory
    (tmpfs) is named in a warning, as offloading there frees no RAM. ``durable``: each write is synced
    to the disk and dropped from the page cache, so that a read comes from the disk (bandwidths measured
    so are the disk's, hierremat.runtime.tier_bandwidth)."""

    kind = "disk"

    def __init__(self, limit_bytes: int, directory: str | os.PathLike | None = None,
                 device: torch.device | str = "cpu", durable: bool = False):
        super().__init__(limit_bytes)
        self.device = torch.device(device)
        self.durable = durable
        parent = Path(directory) if directory is not None else Path(tempfile.gettempdir())
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self.directory = Path(tempfile.mkdtemp(prefix="hierremat-offload-", dir=parent))
        except OSError as err:
            raise OffloadError(f"offload={str(parent)!r}: cannot make a directory there ({err}); give a writable one") from err
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hierremat-offload")
        self._descriptors: dict[object, int] = {}
        self._cleanup = weakref.finalize(self, _remove_directory, str(self.directory), self._pool, self._descriptors)
        self._writes: dict[object, concurrent.futures.Future] = {}
        self._reads: dict[object, concurrent.futures.Future] = {}
        try:
            fd = _open_unlinked(self.directory)
            try:
                _write(fd, [torch.zeros(1, dtype=torch.uint8)], 1, False)
            finally:
                os.close(fd)
        except OSError as err:
            self.close()
            raise OffloadError(f"offload={str(parent)!r}: cannot write there ({err}); give a writable directory") from err
        free = shutil.disk_usage(self.directory).free
        if free < limit_bytes:
            self.close()
            raise OffloadError(
                f"offload={str(parent)!r}: {free} bytes free there, less than offload_limit={limit_bytes}: free space, "
                "lower offload_limit or give another directory"
            )
        #: (mount point, type) of the file system its files are on
        self.file_system = file_system(self.directory)
        mount, kind = self.file_system
        if kind in MEMORY_FILE_SYSTEMS:
            log.warning("offload directory %s is on %s (%s): its files are memory; give a directory on a disk",
                        self.directory, kind, mount)

    def _start_offload(self, key, data: torch.Tensor, stored: _Stored) -> None:
        if data.device.type != "cpu":
            data = data.to("cpu")
        try:
            fd = _open_unlinked(self.directory)
        except OSError as err:
            raise OffloadError(f"offloading to {self.directory} failed ({err})") from err
        self._descriptors[key] = fd
        self._writes[key] = self._pool.submit(_write, fd, [data], stored.nbytes, self.durable)

    def _finish_offload(self, key) -> None:
        written = self._writes.get(key)
        if written is not None:
            written.result()

    def _start_fetch(self, key, stored: _Stored) -> None:
        if key not in self._reads:
            # (its buffer allocated here, on the caller's thread: the memory meters, which watch that thread, count it)
            data = torch.empty(stored.nbytes, dtype=torch.uint8)
            self._reads[key] = self._pool.submit(_read, self._descriptors[key], data, self._writes.get(key))

    def _finish_fetch(self, key, stored: _Stored) -> torch.Tensor:
        self._start_fetch(key, stored)
        return stored.rebuild(self._reads[key].result().to(self.device))

    def _forget(self, key) -> None:
        pending = [f for f in (self._writes.pop(key, None), self._reads.pop(key, None)) if f is not None]
        fd = self._descriptors.pop(key, None)
        if fd is not None:
            concurrent.futures.wait(pending)  # (never close a descriptor a write or read is using)
            os.close(fd)

    @property
    def file_bytes(self) -> int:
        """The bytes of the tier's files now (what it holds on disk)."""
        return sum(os.fstat(fd).st_size for fd in self._descriptors.values())

    def close(self) -> None:
        super().close()
        self._cleanup()


def _open_unlinked(directory: Path) -> int:
    """A new file in ``directory``, already unlinked: its descriptor is all that keeps it."""
    fd, path = tempfile.mkstemp(suffix=".bin", dir=directory)
    os.unlink(path)
    return fd


def _write(fd: int, box: list, nbytes: int, durable: bool) -> None:
    """Write the one value in ``box`` to ``fd`` (taken out of it: once this returns, or raises, nothing here
    holds it; the pool's work item keeps its arguments a moment longer)."""
    data = box.pop()
    try:
        with memoryview(data.numpy()) as view:
            done = 0
            while done < nbytes:
                written = os.pwrite(fd, view[done:], done)
                if written <= 0:
                    raise OffloadError(f"offloading wrote {done} of {nbytes} bytes")
                done += written
        if durable:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError as err:
        raise OffloadError(f"offloading {nbytes} bytes failed ({err}): free space or give another directory") from err
    finally:
        del data


def _read(fd: int, data: torch.Tensor, written: concurrent.futures.Future | None) -> torch.Tensor:
    """Read the value's bytes into ``data`` (uint8, its size) once its write is done."""
    if written is not None:
        written.result()  # (its error, if any, is this read's)
    nbytes = data.numel()
    done = 0
    try:
        with memoryview(data.numpy()) as view:
            while done < nbytes:
                read = os.preadv(fd, [view[done:]], done)
                if read <= 0:
                    break
                done += read
    except OSError as err:
        raise OffloadError(f"reading an offloaded value back failed ({err})") from err
    if done != nbytes:
        raise OffloadError(f"reading an offloaded value back gave {done} of {nbytes} bytes")
    return data


class HostMemoryTier(SecondTier):
    """Values in one host pool of ``limit_bytes`` (pinned where the device is CUDA), allocated when the tier
    is made and reused. Slots are bump-allocated at POOL_ALIGNMENT; fetching the topmost slot moves the top
    back (a backward fetches in the reverse order of the forward's offloads), an empty tier starts at 0.
    On CUDA every copy, out and back, runs on the one side stream: out after the compute stream's work that
    made the value, back ahead of the backward, which waits for its copy's event; a slot is reused only by
    a copy queued after the one reading it, on that stream (so the reuse is safe). Nothing in a step waits
    on the host: ``wait_offloaded`` makes the stream the value was offloaded from wait for its copy out
    before the value is freed (so the host keeps queueing work ahead of the GPU). That orders the value's
    reuse where it was made on that stream, as the runner's stage outputs are; a value another stream made
    must be recorded there by its maker (``record_stream``) or still be held by it."""

    kind = "host memory"

    def __init__(self, limit_bytes: int, device: torch.device | str):
        super().__init__(limit_bytes)
        device = torch.device(device)
        self._cuda = device.type == "cuda"
        if self._cuda and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        try:
            self._pool = torch.empty(limit_bytes, dtype=torch.uint8, pin_memory=self._cuda)
        except RuntimeError as err:
            raise OffloadError(f"the host memory tier could not allocate its pool of {limit_bytes} bytes ({err}): "
                               "lower offload_limit") from err
        self._slots: dict[object, tuple[int, int]] = {}
        self._events: dict[object, object] = {}
        self._fetched: dict[object, tuple[torch.Tensor, object]] = {}
        self._sources: dict[object, torch.Tensor] = {}  # values whose copy out may still run (CUDA)
        self._compute_streams: dict[object, object] = {}  # the stream each of them was offloaded from (CUDA)
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None

    def _slot(self, nbytes: int) -> tuple[int, int]:
        top = max((end for _, end in self._slots.values()), default=0)
        start = -(-top // POOL_ALIGNMENT) * POOL_ALIGNMENT
        if start + nbytes > self.limit_bytes:
            raise OffloadError(
                f"the host memory pool ({self.limit_bytes} bytes) has no room for {nbytes} bytes above its top slot "
                f"({top} bytes; values are fetched back in another order than last in, first out): raise offload_limit"
            )
        return start, start + nbytes

    def _start_offload(self, key, data: torch.Tensor, stored: _Stored) -> None:
        if data.device != self.device and not (data.device.type == "cpu" and not self._cuda):
            raise OffloadError(f"offload: a value on {data.device} given to the {self.kind} tier of {self.device}")
        start, end = self._slot(stored.nbytes)
        slot = self._pool[start:end]
        if not self._cuda:
            slot.copy_(data)
        else:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                slot.copy_(data, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            self._events[key] = event
            # the source is held until the compute stream waits for its copy (wait_offloaded), not recorded on the
            # side stream: record_stream would delay its reuse past later copies queued there, beyond the plan's peak
            self._sources[key] = data
            self._compute_streams[key] = torch.cuda.current_stream(self.device)
        self._slots[key] = (start, end)

    def _finish_offload(self, key) -> None:
        event = self._events.get(key)  # (a later prefetch's event: after the copy out on the same stream)
        if event is not None:
            # the stream the value was made on waits for its copy, not the host: the allocator hands its memory,
            # freed below, only to work queued after this wait on that stream, so the copy has read it by then
            stream = self._compute_streams.pop(key, None) or torch.cuda.current_stream(self.device)
            stream.wait_event(event)
        self._sources.pop(key, None)

    def _start_fetch(self, key, stored: _Stored) -> None:
        if key in self._fetched:
            return
        start, end = self._slots[key]
        slot = self._pool[start:end]
        if not self._cuda:
            self._fetched[key] = (slot.clone(), None)
            return
        current = torch.cuda.current_stream(self.device)
        data = torch.empty(stored.nbytes, dtype=torch.uint8, device=self.device)  # (allocated on `current`)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):  # (the compute stream waits for it before using or freeing it)
            data.copy_(slot, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._events[key] = event
        self._fetched[key] = (data, current)

    def _finish_fetch(self, key, stored: _Stored) -> torch.Tensor:
        self._start_fetch(key, stored)
        data, allocated_on = self._fetched.pop(key)
        event = self._events.pop(key, None)
        if self._cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)  # (the compute stream then orders every later use and free after the copy)
            if current != allocated_on:
                data.record_stream(current)
        return stored.rebuild(data)

    def _forget(self, key) -> None:
        event = self._events.pop(key, None)
        if event is not None and (key in self._fetched or key in self._sources):
            event.synchronize()  # (a copy still writing a buffer, or reading a source, that is dropped here)
        self._slots.pop(key, None)
        self._fetched.pop(key, None)
        self._sources.pop(key, None)
        self._compute_streams.pop(key, None)

    def close(self) -> None:
        if self._cuda and self._stream is not None:
            self._stream.synchronize()
        super().close()
        self._pool = None
