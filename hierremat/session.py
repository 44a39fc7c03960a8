"""The planner session: what a process keeps between plans, in one bounded object.

A :class:`PlannerSession` owns the menus solved without an on-disk cache (re-costed at new sizes), the
menus parsed lately, the solver's record (how many ILP solves ran, why Gurobi failed, the block solvers'
failures), the open second tiers and the messages logged once. Each memo is bounded; ``close()`` closes
the tiers and forgets the rest. :func:`current_session` is the process's session, made on first use and
closed at exit; ``with planner_session():`` plans inside a fresh one, closed after the block, so that what
one caller planned cannot decide what another plans (tests, or two models that must not share memos).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Any

log = logging.getLogger(__name__)

#: Menus solved without a cache kept at once (one per distinct block structure a process plans).
SOLVED_MENUS = 64
#: Menus parsed lately kept at once (one per distinct block signature a model re-costs, typically two or three).
PARSED_MENUS = 8
#: Block-solver failures and logged-once messages remembered at most.
RECORDS = 1024


class LruMemo:
    """A mapping of at most ``capacity`` entries that forgets the one used least recently."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity}")
        self.capacity = capacity
        self._entries: collections.OrderedDict = collections.OrderedDict()

    def get(self, key: Hashable, default=None):
        if key not in self._entries:
            return default
        self._entries.move_to_end(key)
        return self._entries[key]

    def put(self, key: Hashable, value) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


class PlannerSession:
    """Every cache, memo, solver record, open tier and logged-once set of the planner (module docstring)."""

    def __init__(self) -> None:
        #: block structure digest -> the menu solved last for it where no on-disk cache is used
        self.solved_menus = LruMemo(SOLVED_MENUS)
        #: a solved menu's canonical JSON -> the menu parsed from it
        self.parsed_menus = LruMemo(PARSED_MENUS)
        #: why the block solvers failed, the latest RECORDS
        self.solver_failures: collections.deque[str] = collections.deque(maxlen=RECORDS)
        #: ILP solves run in this session (any backend)
        self.ilp_solves = 0
        #: why Gurobi failed in this session (it is not tried again), or None
        self.gurobi_failure: str | None = None
        self._logged: LruMemo = LruMemo(RECORDS)
        self._open: dict[Hashable, Any] = {}
        self._opening = threading.RLock()  # (one made may open another)
        self.closed = False

    def first_time(self, key: Hashable) -> bool:
        """True the first time ``key`` is asked about (a message logged once), False after."""
        if self._logged.get(key) is not None:
            return False
        self._logged.put(key, True)
        return True

    def opened(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The object opened for ``key`` (a second tier), made by ``make()`` on first use and closed with the
        session (its ``close()``, where it has one)."""
        with self._opening:
            if self.closed:
                raise RuntimeError("this planner session is closed: plan in hierremat.current_session() or a new one")
            if key not in self._open:
                self._open[key] = make()
            return self._open[key]

    def close(self) -> None:
        """Close what the session opened and forget its memos and records."""
        opened, self._open = list(self._open.values()), {}
        for value in opened:
            close = getattr(value, "close", None)
            if close is not None:
                close()
        self.solved_menus.clear()
        self.parsed_menus.clear()
        self.solver_failures.clear()
        self._logged.clear()
        self.closed = True


_SESSIONS: list[PlannerSession] = []  # (the stack: the process's session first, then planner_session's)


def current_session() -> PlannerSession:
    """The innermost open ``planner_session()``, else the process's session (made on first use, closed at exit)."""
    if not _SESSIONS:
        _SESSIONS.append(PlannerSession())
        atexit.register(_SESSIONS[0].close)
    return _SESSIONS[-1]


@contextlib.contextmanager
def planner_session() -> Iterator[PlannerSession]:
    """A fresh session for the block, current inside it and closed after it (module docstring)."""
    current_session()  # (the process's stays below it)
    session = PlannerSession()
    _SESSIONS.append(session)
    try:
        yield session
    finally:
        _SESSIONS.remove(session)
        session.close()
