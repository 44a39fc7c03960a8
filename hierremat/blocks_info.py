"""Plain description of a chain stage, shared by the planner (no torch) and hierremat.blocks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageInfo:
    """A stage of a captured model: its module path(s), structural signature and size."""

    name: str
    signature: str
    node_count: int
