"""Where offloaded values wait for their backward: the second tier of storage (issue 34).

Beaumont, Eyraud-Dubois and Shilova (NeurIPS 2021, "Efficient Combination of Rematerialization and
Offloading for Training DNNs") send a checkpointed activation off the device while the next stages
compute, and bring it back before the backward that reads it. The tiers it goes to share one
interface, :class:`SecondTier`:

- :class:`HostMemoryTier` (CUDA): a pinned host pool allocated once and reused across steps (pinning
  per tensor costs about 3 ms per ``cudaHostAlloc`` and blocks overlap), bump-allocated and reset when
  empty; copies run on a side stream ordered with the compute stream by events, a prefetch starts the
  copy back ahead of the backward. On a CPU device it copies synchronously (its bookkeeping is the same:
  how it is tested here).
- :class:`DiskTier` (CPU): one file per value in a directory of its own (POET's paging, Patil et al.,
  ICML 2022): the process's RAM is freed. Writes and read-ahead run in order on one background thread.

Every tier: ``offload(key, tensor)`` starts moving a value out and holds it until the copy is done (the
caller drops its own reference: the device memory is freed then; ``wait_offloaded(key)`` waits for
that); ``prefetch(key)`` starts bringing it
back; ``fetch(key)`` returns it on the device, waiting for the copy. A write or read that does not move
every byte raises :class:`OffloadError` (a step never goes on with a partial value). ``close()`` removes
what the tier holds, files and directory included; it also runs at exit and when the tier is collected.
``held_bytes`` and ``peak_bytes`` are the tier's own use (for the disk, the files' sizes).
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch


class OffloadError(RuntimeError):
    """A second tier that cannot be written or read back whole (no room, no permission, a short read)."""


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a flat uint8 tensor (a view where it is contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=flat.device)


def _from_bytes(data: torch.Tensor, like: "_Stored") -> torch.Tensor:
    return data.view(like.dtype).reshape(like.shape) if like.nbytes else torch.empty(like.shape, dtype=like.dtype, device=data.device)


@dataclass(frozen=True)
class _Stored:
    """What a tier needs to rebuild a value: its shape, dtype and bytes."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "_Stored":
        return cls(tuple(tensor.shape), tensor.dtype, tensor.numel() * tensor.element_size())


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

    def offload(self, key, tensor: torch.Tensor) -> None:
        if key in self._stored:
            raise KeyError(f"offload: {key!r} is already in the {self.kind} tier")
        stored = _Stored.of(tensor)
        if self.held_bytes + stored.nbytes > self.limit_bytes:
            raise OffloadError(
                f"the {self.kind} tier would hold {self.held_bytes + stored.nbytes} bytes, over its offload_limit of "
                f"{self.limit_bytes}: raise offload_limit"
            )
        self._stored[key] = stored
        self.held_bytes += stored.nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        self._start_offload(key, tensor, stored)

    def wait_offloaded(self, key) -> None:
        """Return once ``key``'s copy out is done (its device memory is free then, if nobody else holds it)."""
        self._stored[key]  # (a KeyError for a key the tier does not hold)
        self._finish_offload(key)

    def prefetch(self, key) -> None:
        self._start_fetch(key, self._stored[key])

    def fetch(self, key) -> torch.Tensor:
        stored = self._stored[key]
        try:
            return self._finish_fetch(key, stored)
        finally:
            del self._stored[key]
            self.held_bytes -= stored.nbytes

    def __contains__(self, key) -> bool:
        return key in self._stored

    def __enter__(self) -> "SecondTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stored.clear()
        self.held_bytes = 0

    # what a tier implements
    def _start_offload(self, key, tensor: torch.Tensor, stored: _Stored) -> None:
        raise NotImplementedError

    def _finish_offload(self, key) -> None:
        raise NotImplementedError

    def _start_fetch(self, key, stored: _Stored) -> None:
        raise NotImplementedError

    def _finish_fetch(self, key, stored: _Stored) -> torch.Tensor:
        raise NotImplementedError


def _remove_directory(path: str, pool: concurrent.futures.ThreadPoolExecutor) -> None:
    pool.shutdown(wait=True, cancel_futures=True)
    shutil.rmtree(path, ignore_errors=True)


class DiskTier(SecondTier):
    """Values in files, one per value, under a directory this tier makes (in ``directory``, default the
    system's temporary directory) and removes. Checked when it is made, before training: the directory
    can be made and written, and its file system has ``limit_bytes`` free."""

    kind = "disk"

    def __init__(self, limit_bytes: int, directory: str | os.PathLike | None = None, device: torch.device | str = "cpu"):
        super().__init__(limit_bytes)
        self.device = torch.device(device)
        parent = Path(directory) if directory is not None else Path(tempfile.gettempdir())
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self.directory = Path(tempfile.mkdtemp(prefix="hierremat-offload-", dir=parent))
        except OSError as err:
            raise OffloadError(f"offload={str(parent)!r}: cannot make a directory there ({err}); give a writable one") from err
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hierremat-offload")
        self._cleanup = weakref.finalize(self, _remove_directory, str(self.directory), self._pool)
        self._files: dict[object, Path] = {}
        self._writes: dict[object, concurrent.futures.Future] = {}
        self._reads: dict[object, concurrent.futures.Future] = {}
        self._count = 0
        try:
            _write_file(self.directory / "probe.bin", [torch.zeros(1, dtype=torch.uint8)], 1)
            (self.directory / "probe.bin").unlink()
        except OffloadError as err:
            self.close()
            raise OffloadError(f"offload={str(parent)!r}: cannot write there ({err.__cause__ or err}); give a writable directory") from err
        free = shutil.disk_usage(self.directory).free
        if free < limit_bytes:
            self.close()
            raise OffloadError(
                f"offload={str(parent)!r}: {free} bytes free there, less than offload_limit={limit_bytes}: free space, "
                "lower offload_limit or give another directory"
            )

    def _start_offload(self, key, tensor: torch.Tensor, stored: _Stored) -> None:
        self._count += 1
        path = self._files[key] = self.directory / f"{self._count}.bin"
        data = _as_bytes(tensor.to("cpu") if tensor.device.type != "cpu" else tensor)
        self._writes[key] = self._pool.submit(_write_file, path, [data], stored.nbytes)

    def _finish_offload(self, key) -> None:
        written = self._writes.get(key)
        if written is not None:
            written.result()

    def _start_fetch(self, key, stored: _Stored) -> None:
        if key not in self._reads:
            self._reads[key] = self._pool.submit(_read_file, self._files[key], stored.nbytes, self._writes.pop(key, None))

    def _finish_fetch(self, key, stored: _Stored) -> torch.Tensor:
        self._start_fetch(key, stored)
        path = self._files.pop(key)
        try:
            data = self._reads.pop(key).result()
        finally:
            path.unlink(missing_ok=True)
        return _from_bytes(data, stored).to(self.device)

    @property
    def file_bytes(self) -> int:
        """The bytes of the files in the tier's directory now (what it holds on disk)."""
        return sum(p.stat().st_size for p in self.directory.glob("*.bin")) if self.directory.exists() else 0

    def close(self) -> None:
        super().close()
        self._files, self._writes, self._reads = {}, {}, {}
        self._cleanup()


def _write_file(path: Path, box: list, nbytes: int) -> None:
    """Write the one value in ``box`` (taken out of it: once this returns nothing here holds it, before
    the pool marks the write done; the pool's work item keeps its arguments a moment longer)."""
    data = box.pop()
    try:
        with open(path, "wb") as f, memoryview(data.numpy()) as view:
            written = f.write(view)
    except OSError as err:
        path.unlink(missing_ok=True)
        raise OffloadError(f"offloading {nbytes} bytes to {path} failed ({err}): free space or give another directory") from err
    if written != nbytes:
        path.unlink(missing_ok=True)
        raise OffloadError(f"offloading to {path} wrote {written} of {nbytes} bytes")


def _read_file(path: Path, nbytes: int, written: concurrent.futures.Future | None) -> torch.Tensor:
    if written is not None:
        written.result()  # (its error, if any, is this read's)
    data = torch.empty(nbytes, dtype=torch.uint8)
    try:
        with open(path, "rb") as f:
            read = f.readinto(memoryview(data.numpy())) if nbytes else 0
    except OSError as err:
        raise OffloadError(f"reading an offloaded value back from {path} failed ({err})") from err
    if read != nbytes:
        raise OffloadError(f"reading an offloaded value back from {path} gave {read} of {nbytes} bytes")
    return data


class HostMemoryTier(SecondTier):
    """Values in one host buffer of ``limit_bytes`` (pinned where the device is CUDA), allocated at the first
    offload and reused: a bump allocator whose offset returns to 0 whenever the tier is empty (a step fetches
    all it offloaded). On CUDA the copies run on a side stream: out after the compute stream's work that made
    the value, back ahead of the backward, which waits for its copy's event."""

    kind = "host memory"

    def __init__(self, limit_bytes: int, device: torch.device | str):
        super().__init__(limit_bytes)
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._pool: torch.Tensor | None = None
        self._offset = 0
        self._where: dict[object, int] = {}
        self._events: dict[object, object] = {}
        self._fetched: dict[object, torch.Tensor] = {}
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None

    def _slot(self, key, nbytes: int) -> torch.Tensor:
        if self._pool is None:
            self._pool = torch.empty(self.limit_bytes, dtype=torch.uint8, pin_memory=self._cuda)
        if len(self._where) == 0:
            self._offset = 0
        start = -(-self._offset // 64) * 64  # (64-byte aligned: every dtype's view is valid)
        if start + nbytes > self.limit_bytes:
            raise OffloadError(f"the host memory tier's pool of {self.limit_bytes} bytes is full: raise offload_limit")
        self._where[key] = start
        self._offset = start + nbytes
        return self._pool[start:start + nbytes]

    def _start_offload(self, key, tensor: torch.Tensor, stored: _Stored) -> None:
        slot = self._slot(key, stored.nbytes)
        data = _as_bytes(tensor)
        if not self._cuda:
            slot.copy_(data)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            slot.copy_(data, non_blocking=True)
            data.record_stream(self._stream)  # its memory is reused only once the copy is done
            event = torch.cuda.Event()
            event.record(self._stream)
        self._events[key] = event

    def _finish_offload(self, key) -> None:
        event = self._events.get(key)
        if event is not None and key not in self._fetched:
            event.synchronize()

    def _start_fetch(self, key, stored: _Stored) -> None:
        if key in self._fetched:
            return
        start = self._where[key]
        slot = self._pool[start:start + stored.nbytes]
        if not self._cuda:
            self._fetched[key] = slot.clone()
            return
        data = torch.empty(stored.nbytes, dtype=torch.uint8, device=self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            data.copy_(slot, non_blocking=True)
            data.record_stream(self._stream)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._events[key] = event
        self._fetched[key] = data

    def _finish_fetch(self, key, stored: _Stored) -> torch.Tensor:
        self._start_fetch(key, stored)
        event = self._events.pop(key, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        del self._where[key]
        return _from_bytes(self._fetched.pop(key), stored)

    def close(self) -> None:
        super().close()
        if self._cuda and self._stream is not None:
            self._stream.synchronize()
        self._where.clear()
        self._events.clear()
        self._fetched.clear()
        self._pool = None
