"""What torch keeps of every graph a plan traces, forgotten when the plan is dropped.

fx keeps the source of every GraphModule it compiles, for tracebacks (``torch.fx.graph_module._loader``,
an entry in ``linecache`` each), and ``FakeTensorMode`` keeps a dispatch cache entry for every operator
at every shape it saw (``FakeTensorMode.cache``). A process that plans a new input shape every few steps
(dynamic padding) would keep them all: about 0.4 MB per shape for a small GPT-2. Planning records the
sources it added (:func:`recorded_sources`); a RematModule forgets them (:func:`forget_sources`) when it
drops that shape's plan, and empties the fake-tensor cache after planning a new shape.
"""

from __future__ import annotations

import contextlib
import itertools
import linecache
from typing import Iterator

from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import graph_module


def _eval_cache() -> dict | None:
    loader = getattr(graph_module, "_loader", None)  # (private to torch.fx: absent, nothing is recorded)
    cache = getattr(loader, "eval_cache", None)
    return cache if isinstance(cache, dict) else None


@contextlib.contextmanager
def recorded_sources() -> Iterator[list[str]]:
    """Yield a list that, on exit, holds the keys of the GraphModule sources fx kept meanwhile."""
    cache = _eval_cache()
    before = len(cache) if cache is not None else 0
    keys: list[str] = []
    try:
        yield keys
    finally:
        if cache is not None:
            keys.extend(itertools.islice(cache, before, None))


def source_keys(modules) -> list[str]:
    """The keys of fx's sources of these GraphModules (each instance's class runs code compiled from its own source,
    under the key fx's loader keeps it by), those fx keeps."""
    cache = _eval_cache()
    keys = [getattr(getattr(type(m).forward, "__code__", None), "co_filename", None) for m in modules]
    return [key for key in keys if cache is not None and key in cache]


def forget_sources(keys: list[str]) -> None:
    """Drop the sources under ``keys`` from fx's cache and from ``linecache``."""
    cache = _eval_cache()
    for key in keys:
        if cache is not None:
            cache.pop(key, None)
        linecache.cache.pop(key, None)


def clear_fake_tensor_cache() -> None:
    """Empty FakeTensorMode's dispatch cache (a cache of results only: it fills again as needed)."""
    FakeTensorMode.cache_clear()
