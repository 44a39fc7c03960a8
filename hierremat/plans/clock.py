"""The planning clock: when a plan bounded by a ``time_limit`` must be done, on one clock.

Every part of planning that the time limit bounds reads :func:`now`: the stages' profile
(hierremat.runtime.profile: stages timed from one run once the deadline has passed), the blocks' node profiles
(hierremat.planning.menus: modelled from FLOPs and bytes, not measured), the ILP sweeps
(hierremat.ilp.options: the heuristic menu), the executors' timings and compiling. A test injects a clock by
replacing :func:`now` (``monkeypatch.setattr(clock, "now", ...)``); the callers read it as ``clock.now()``.
"""

from __future__ import annotations

import math
import time


def now() -> float:
    """Seconds on the planning clock (``time.perf_counter``)."""
    return time.perf_counter()


def deadline_after(seconds: float | None, started: float) -> float | None:
    """The deadline ``seconds`` after ``started`` (a :func:`now` value); None: no bound."""
    return None if seconds is None else started + seconds


def seconds_left(deadline: float | None) -> float:
    """Seconds until ``deadline`` (negative once passed; infinite without one)."""
    return math.inf if deadline is None else deadline - now()


def passed(deadline: float | None) -> bool:
    """Whether ``deadline`` (a :func:`now` value, or None: never) has passed."""
    return deadline is not None and now() >= deadline
