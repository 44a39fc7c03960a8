"""Cache of per-block ILP solutions (block option menus), in memory and on disk.

A block's menu of options depends only on its structural signature, the device it was
profiled on, the dtype, and the versions of the cost model and of the ILP formulation;
:class:`CacheKey` holds exactly those. The payload is an opaque JSON-serialisable
``dict`` produced by the ILP code.

On disk, each key is one UTF-8 JSON file ``<directory>/<key.digest()>.json``::

    {"format": "hierremat-options", "format_version": 1,
     "key": {<CacheKey fields>}, "payload": {...},
     "checksum": sha256 hex of canonical JSON of {"key": ..., "payload": ...}}

Canonical JSON = ``json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=True)``.

The directory is bounded: a file's modification time is when its entry was last written or
first read by a process (its last use), and after a write the entries used least recently
are removed until the files take at most ``max_bytes`` (default 64 MiB, or
``$HIERREMAT_CACHE_MAX_BYTES``, bytes or e.g. ``"256MiB"``); the entry just written stays.
The directory is listed for that at a process's first write, then where its own writes since
could bring the files over the cap, and at least every RESCAN_SECONDS (other processes write
too): listing it after every write took 0.3 s of each new input shape's planning.
A file that is unreadable, not JSON (corrupted, truncated), of another format or
format_version, holding another key, or whose checksum does not match is never trusted:
it is logged (logger ``hierremat.cache``, WARNING, naming the file and the reason) and
treated as a miss; the next :meth:`OptionsCache.put` of that key overwrites it.
Writes go to a temp file in the same directory, are flushed and fsync'ed, then
``os.replace``'d into place, so concurrent writers and readers of the same key (two
training processes) only ever see a complete file. Nothing is ever pickled.

Pure Python: this module never imports torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ..budget import parse_budget
from ..session import current_session

__all__ = [
    "BUNDLE_FORMAT",
    "CacheKey",
    "DEFAULT_MAX_BYTES",
    "ENV_VAR",
    "MAX_BYTES_ENV_VAR",
    "FORMAT",
    "FORMAT_VERSION",
    "OptionsCache",
    "default_cache",
    "default_directory",
    "default_max_bytes",
]

logger = logging.getLogger("hierremat.cache")

FORMAT = "hierremat-options"
FORMAT_VERSION = 1
BUNDLE_FORMAT = "hierremat-options-bundle"
ENV_VAR = "HIERREMAT_CACHE_DIR"
MAX_BYTES_ENV_VAR = "HIERREMAT_CACHE_MAX_BYTES"
DEFAULT_MAX_BYTES = 64 * 2**20

_ENTRY_NAME = re.compile(r"^[0-9a-f]{64}\.json$")
_TEMP_NAME = re.compile(r"^\.[0-9a-f]{64}\..*\.tmp$")
_STALE_TEMP_S = 60.0  # clear() leaves younger temp files alone (a writer may be mid-write)
#: Seconds after which a write lists the directory again to enforce the cap, whatever this process wrote.
RESCAN_SECONDS = 10.0


def canonical_json(obj: Any) -> str:
    """Deterministic JSON text of ``obj`` (sorted keys, no spaces, ASCII). Raises
    TypeError/ValueError when ``obj`` is not JSON-serialisable."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _checksum(key: dict, payload: dict) -> str:
    return _sha256(canonical_json({"key": key, "payload": payload}))


@dataclasses.dataclass(frozen=True)
class CacheKey:
    """Everything a block's option menu depends on. All fields are strings.

    signature: the block's structural signature (hash of ops, edges, shapes, dtypes).
    device_type: e.g. ``"cuda"``, ``"cpu"``.  device_name: e.g. ``"NVIDIA H100 80GB HBM3"``.
    dtype: e.g. ``"float32"``.  cost_model_version, formulation_version: bump these when
    profiling or the ILP changes, so that old solutions are no longer found.
    """

    signature: str
    device_type: str
    device_name: str
    dtype: str
    cost_model_version: str
    formulation_version: str

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not isinstance(getattr(self, f.name), str):
                raise TypeError(
                    f"CacheKey.{f.name} must be a str, got {type(getattr(self, f.name)).__name__}"
                )

    def to_dict(self) -> dict[str, str]:
        """The key as a plain dict (field name -> value)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> CacheKey:
        """Inverse of :meth:`to_dict`; raises ValueError/TypeError unless ``d`` has exactly
        the key's fields, all strings."""
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(d, dict) or set(d) != names:
            raise ValueError(f"a cache key needs exactly the fields {sorted(names)}")
        return cls(**d)

    def digest(self) -> str:
        """Stable 64-hex-digit id: sha256 of the canonical JSON of :meth:`to_dict`.
        Used as the file name."""
        return _sha256(canonical_json(self.to_dict()))


class _Invalid(Exception):
    """A cache document that must not be trusted; the message says why."""


def _check_document(doc: Any, expect: CacheKey | None = None) -> tuple[CacheKey, dict]:
    """Validate one parsed entry document; return (key, payload) or raise _Invalid."""
    if not isinstance(doc, dict):
        raise _Invalid("not a JSON object")
    if doc.get("format") != FORMAT:
        raise _Invalid(f"format is {doc.get('format')!r}, expected {FORMAT!r}")
    if doc.get("format_version") != FORMAT_VERSION:
        raise _Invalid(
            f"format_version is {doc.get('format_version')!r}, expected {FORMAT_VERSION}"
        )
    try:
        key = CacheKey.from_dict(doc.get("key"))
    except (TypeError, ValueError) as e:
        raise _Invalid(f"bad key: {e}") from None
    payload = doc.get("payload")
    if not isinstance(payload, dict):
        raise _Invalid("payload is not a JSON object")
    if doc.get("checksum") != _checksum(key.to_dict(), payload):
        raise _Invalid("checksum mismatch (file modified or damaged)")
    if expect is not None and key != expect:
        raise _Invalid(f"holds another key ({key.to_dict()}), expected {expect.to_dict()}")
    return key, payload


def _document(key: CacheKey, payload: dict) -> dict:
    k = key.to_dict()
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "key": k,
        "payload": payload,
        "checksum": _checksum(k, payload),
    }


def _read_json(path: Path) -> Any:
    """Parse a JSON file; raise _Invalid (unreadable, corrupted, truncated)."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Invalid(f"not UTF-8 (corrupted): {e}") from None
    except OSError as e:
        raise _Invalid(f"unreadable: {e}") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise _Invalid(f"not valid JSON (corrupted or truncated): {e}") from None


def _atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: temp file in the same directory, flush,
    fsync, os.replace. Creates the directory. Raises OSError on failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename itself durable; not possible everywhere
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def _touch(path: Path) -> None:
    """Mark an entry file used now (its modification time; the eviction order)."""
    try:
        os.utime(path)
    except OSError:
        pass


def default_max_bytes() -> int:
    """``$HIERREMAT_CACHE_MAX_BYTES`` (bytes, or a size such as ``"256MiB"``) if set, else 64 MiB."""
    text = os.environ.get(MAX_BYTES_ENV_VAR)
    if not text:
        return DEFAULT_MAX_BYTES
    try:
        return parse_budget(text)
    except (TypeError, ValueError) as e:
        raise ValueError(f"${MAX_BYTES_ENV_VAR}={text!r} is not a size: {e}") from None


def default_directory() -> Path:
    """``$HIERREMAT_CACHE_DIR`` if set and non-empty, else ``~/.cache/hierremat``."""
    return Path(os.environ.get(ENV_VAR) or "~/.cache/hierremat").expanduser()


class OptionsCache:
    """Block-option cache: a per-instance in-memory dict in front of a directory of JSON files.

    Args:
        directory: where entry files live; default :func:`default_directory` (resolved
            once, here). It is created on the first write, not before.
        enabled: ``False`` (what ``cache=False`` maps to) makes :meth:`get` return None
            and :meth:`put` do nothing. The maintenance methods (:meth:`entries`,
            :meth:`clear`, :meth:`export`, :meth:`import_`) work on the directory either way.
        max_bytes: the most the entry files may take; after a write, the least recently used
            entries are removed down to it (module docstring). Default :func:`default_max_bytes`.

    Payloads are copied in and out (via JSON), so callers may mutate what they get.
    Disk errors on write are logged and swallowed: a cache never fails a training run.
    Thread-safe; safe across processes sharing the directory.
    """

    def __init__(self, directory: str | os.PathLike | None = None, enabled: bool = True, max_bytes: int | None = None):
        self.directory = Path(directory).expanduser() if directory is not None else default_directory()
        self.enabled = bool(enabled)
        self.max_bytes = default_max_bytes() if max_bytes is None else max_bytes
        if not isinstance(self.max_bytes, int) or isinstance(self.max_bytes, bool) or self.max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive number of bytes, got {self.max_bytes!r}")
        self._memory: dict[str, str] = {}  # digest -> canonical JSON of the payload
        self._lock = threading.Lock()
        self._disk_warned = False  # disk trouble (unwritable, full, unreadable) is warned about once
        # the entry files' bytes at the last listing (evict) plus those this process wrote since, and when
        # (time.monotonic()) that listing was: None before the first
        self._known_bytes: int | None = None
        self._listed_at = 0.0

    def __repr__(self) -> str:
        return f"OptionsCache(directory={str(self.directory)!r}, enabled={self.enabled})"

    def forget_memory(self) -> None:
        """Drop the in-memory layer (the next get reads the disk, as a new process would)."""
        with self._lock:
            self._memory.clear()

    def path_for(self, key: CacheKey) -> Path:
        """The entry file of ``key`` (may not exist)."""
        return self.directory / f"{key.digest()}.json"

    def get(self, key: CacheKey) -> dict | None:
        """The payload stored for ``key``, or None on a miss (also when the file is invalid,
        which is logged as a WARNING)."""
        if not self.enabled:
            return None
        digest = key.digest()
        with self._lock:
            hit = self._memory.get(digest)
        if hit is not None:
            return json.loads(hit)
        path = self.directory / f"{digest}.json"
        try:
            if not path.exists():
                return None
        except OSError as e:  # the directory cannot be searched (permissions)
            self._disk_trouble(f"could not look up {path}: {e}; planning goes on without the cache's entries")
            return None
        try:
            _, payload = _check_document(_read_json(path), expect=key)
        except _Invalid as e:
            logger.warning(
                "hierremat cache: ignoring %s: %s; treated as a miss (the next put of this "
                "key overwrites it)", path, e,
            )
            return None
        with self._lock:
            self._memory[digest] = canonical_json(payload)
        _touch(path)  # used now: the last to be evicted
        return payload

    def put(self, key: CacheKey, payload: dict) -> None:
        """Store ``payload`` (a JSON-serialisable dict) for ``key`` in memory and on disk.
        Raises TypeError if the payload is not a JSON-serialisable dict."""
        if not self.enabled:
            return
        text = self._payload_text(payload)
        with self._lock:
            self._memory[key.digest()] = text
        self._write(key, json.loads(text))

    @staticmethod
    def _payload_text(payload: Any) -> str:
        if not isinstance(payload, dict):
            raise TypeError(f"cache payload must be a dict, got {type(payload).__name__}")
        try:
            return canonical_json(payload)
        except (TypeError, ValueError) as e:
            raise TypeError(f"cache payload is not JSON-serialisable: {e}") from None

    def _write(self, key: CacheKey, payload: dict) -> bool:
        path = self.path_for(key)
        text = canonical_json(_document(key, payload)) + "\n"
        try:
            _atomic_write(path, text)
        except OSError as e:  # unwritable, full (ENOSPC), read-only: the plan goes on, unsaved
            self._disk_trouble(f"could not write {path}: {e}; planning goes on without saving to the cache")
            return False
        written = len(text.encode())
        with self._lock:
            known = self._known_bytes
            if known is not None and known + written <= self.max_bytes and \
                    time.monotonic() - self._listed_at < RESCAN_SECONDS:
                self._known_bytes = known + written  # (an entry overwritten is counted twice: an overestimate)
                return True
        self.evict(keep=path)
        return True

    def usage(self) -> list[tuple[float, int, Path]]:
        """(last use, bytes, file) of every entry file, least recently used first."""
        out = []
        for path in self._files():
            try:
                st = path.stat()
            except OSError:
                continue  # removed meanwhile
            out.append((st.st_mtime, st.st_size, path))
        return sorted(out)

    def evict(self, keep: Path | None = None) -> int:
        """Remove the least recently used entry files until they take at most ``max_bytes`` (never
        ``keep``; entries this process holds in memory stay usable by it). Returns how many."""
        listed_at = time.monotonic()
        files = self.usage()
        total = sum(size for _, size, _ in files)
        removed = 0
        for _, size, path in files:
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            try:
                path.unlink()
            except OSError:
                continue
            total -= size
            removed += 1
        with self._lock:
            self._known_bytes, self._listed_at = total, listed_at
        if removed:
            logger.info("hierremat cache: removed %d least recently used entries from %s (cap %d bytes)",
                        removed, self.directory, self.max_bytes)
        return removed

    def _disk_trouble(self, message: str) -> None:
        """Log disk trouble once per cache as a WARNING (then at DEBUG): a cache never fails a run."""
        if self._disk_warned:
            logger.debug("hierremat cache: %s", message)
            return
        self._disk_warned = True
        logger.warning("hierremat cache: %s (further disk errors of this cache are logged at DEBUG)", message)

    def _files(self) -> list[Path]:
        try:
            return sorted(p for p in self.directory.iterdir() if _ENTRY_NAME.match(p.name))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def entries(self) -> list[dict]:
        """Metadata of every entry file on disk, sorted by file name. Each is a dict:
        the six key fields (None if the file is invalid), ``digest`` (str), ``size``
        (file size in bytes), ``created`` (file mtime, seconds since the epoch: when the
        entry was last written or first read by a process, its last use: the eviction order),
        ``file`` (str path), ``valid`` (bool) and ``problem``
        (why it is invalid, else None). Does not log."""
        out = []
        for path in self._files():
            meta: dict[str, Any] = {f.name: None for f in dataclasses.fields(CacheKey)}
            try:
                st = path.stat()
            except OSError:
                continue  # removed meanwhile
            meta.update(digest=path.stem, size=st.st_size, created=st.st_mtime,
                        file=str(path), valid=True, problem=None)
            try:
                key, _ = _check_document(_read_json(path))
                if key.digest() != path.stem:
                    raise _Invalid("file name does not match its key")
                meta.update(key.to_dict())
            except _Invalid as e:
                meta.update(valid=False, problem=str(e))
            out.append(meta)
        return out

    def clear(self) -> int:
        """Delete every entry file (and stale temp files) in the directory and empty the
        memory layer; other files are left alone. Returns the number of entry files removed."""
        with self._lock:
            self._memory.clear()
        removed = 0
        for path in self._files():
            try:
                path.unlink()
                removed += 1
            except FileNotFoundError:
                pass
        try:
            temps = [p for p in self.directory.iterdir() if _TEMP_NAME.match(p.name)]
        except (FileNotFoundError, NotADirectoryError):
            temps = []
        for path in temps:
            try:
                if time.time() - path.stat().st_mtime > _STALE_TEMP_S:
                    path.unlink()
            except OSError:
                pass
        return removed

    def export(self, path: str | os.PathLike) -> int:
        """Write every valid entry to one JSON bundle file at ``path`` (written atomically):
        ``{"format": "hierremat-options-bundle", "format_version": 1, "entries": [<entry
        documents, as on disk>]}``. Invalid files are skipped with a WARNING. Returns the
        number of entries exported."""
        docs = []
        for file in self._files():
            try:
                key, payload = _check_document(_read_json(file))
                if key.digest() != file.stem:
                    raise _Invalid("file name does not match its key")
            except _Invalid as e:
                logger.warning("hierremat cache: not exporting %s: %s", file, e)
                continue
            docs.append(_document(key, payload))
        bundle = {"format": BUNDLE_FORMAT, "format_version": FORMAT_VERSION, "entries": docs}
        _atomic_write(Path(path).expanduser(), json.dumps(bundle, sort_keys=True, indent=1) + "\n")
        return len(docs)

    def import_(self, path: str | os.PathLike) -> int:
        """Add the entries of a bundle written by :meth:`export`. Every entry is validated
        like a file on disk (format, version, key, checksum); invalid ones are skipped with
        a WARNING. Existing entries with the same key are replaced. Returns the number
        imported. Raises ValueError if the file is not a readable bundle at all."""
        path = Path(path).expanduser()
        try:
            bundle = _read_json(path)
        except _Invalid as e:
            raise ValueError(f"{path}: {e}") from None
        if (not isinstance(bundle, dict) or bundle.get("format") != BUNDLE_FORMAT
                or not isinstance(bundle.get("entries"), list)):
            raise ValueError(f"{path}: not a {BUNDLE_FORMAT!r} file")
        if bundle.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{path}: bundle format_version is {bundle.get('format_version')!r}, "
                f"expected {FORMAT_VERSION}"
            )
        count = 0
        for i, doc in enumerate(bundle["entries"]):
            try:
                key, payload = _check_document(doc)
            except _Invalid as e:
                logger.warning("hierremat cache: skipping entry %d of %s: %s", i, path, e)
                continue
            with self._lock:
                self._memory.pop(key.digest(), None)
            if self._write(key, payload):
                count += 1
        return count


def default_cache(directory: str | os.PathLike | None = None, enabled: bool = True) -> OptionsCache:
    """The planner session's :class:`OptionsCache` per (directory, enabled), so that repeated
    planning calls share one memory layer (hierremat.session). ``directory=None`` resolves
    :func:`default_directory` now (the environment variable is read on every call)."""
    d = Path(directory).expanduser() if directory is not None else default_directory()
    key = ("options cache", str(d.absolute()), bool(enabled))
    return current_session().opened(key, lambda: OptionsCache(d, enabled=enabled))
