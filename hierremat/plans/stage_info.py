"""Plain description of a chain stage, shared by the planner (no torch) and hierremat.blocks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageInfo:
    """A stage of a captured model: its module path(s), structural signature and size."""

    name: str
    signature: str
    node_count: int


@dataclass(frozen=True)
class ResidentLayout:
    """Values carried along a chain beside its activation (residents): the encoder output every
    decoder layer of an encoder-decoder reads, T5's position bias, a UNet's skip tensors.

    Resident r is produced by stage ``producers[r]`` (one of that stage's outputs after its
    activation x_{i+1}) and read by the later stages ``readers[r]``; its gradient is the sum of
    their contributions, handed to the producer's backward. ``exported``: residents the model
    also returns (the chain returns them after the last stage's outputs). A stage is called as
    ``stage(x, *shared, *residents)`` with ``shared_count`` grad-free shared values first and
    every resident at its index after them (None where not produced yet).
    """

    producers: tuple[int, ...]
    readers: tuple[tuple[int, ...], ...]
    exported: tuple[int, ...] = ()
    shared_count: int = 0

    def produced_by(self, stage: int) -> tuple[int, ...]:
        return tuple(r for r, p in enumerate(self.producers) if p == stage)

    def read_by(self, stage: int) -> tuple[int, ...]:
        return tuple(r for r, readers in enumerate(self.readers) if stage in readers)

    def touches(self, stage: int) -> bool:
        """Whether stage ``stage`` produces or reads a resident."""
        return bool(self.produced_by(stage) or self.read_by(stage))

    def __len__(self) -> int:
        return len(self.producers)
