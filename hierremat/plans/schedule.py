"""Schedule values: the operations of a chain schedule and ``ChainSchedule``.

Rotor's notation (Beaumont et al., 2019), with per-stage options:
  F_none(i)    forward of stage i without grad; x_i is freed afterwards.
  F_ck(i)      forward of stage i without grad; x_i is kept (a checkpoint).
  F_all(i, k)  forward of stage i with grad, running option k; keeps what k keeps.
  Loss         the chain output x_L is handed to the caller; its gradient arrives.
  B(i)         backward of stage i, with the option of its last F_all.
  Offload(i)   x_i, a checkpoint, leaves the device for the second tier (its copy began with the
               F_ck(i) before it and ran beside the forwards since).
  Fetch(i)     x_i comes back from the second tier.
  Offload_kept(i)  the values the tape of F_all(i) keeps leave the device for the second tier, before the
               stages after i run (their copy waits); Offload_kept(i, x): x_i too (the option pins
               it and no other tape holds it).
  Fetch_kept(i)    they come back, before B(i).
Plain values: no tensors, no callables. JSON round-trip is lossless.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class _StageOp:
    """An op on one stage, written as its name in the schedule's JSON and the stage: ``F_ck(3)``."""

    stage: int

    def __str__(self) -> str:
        return f"{_OP_NAMES[type(self)]}({self.stage})"


@dataclass(frozen=True)
class FNone(_StageOp):
    pass


@dataclass(frozen=True)
class FCk(_StageOp):
    pass


@dataclass(frozen=True)
class FAll:
    stage: int
    option: int = 0

    def __str__(self) -> str:
        return f"F_all({self.stage}, {self.option})"


@dataclass(frozen=True)
class Backward(_StageOp):
    pass


@dataclass(frozen=True)
class Loss:
    def __str__(self) -> str:
        return "Loss"


@dataclass(frozen=True)
class Offload(_StageOp):
    pass


@dataclass(frozen=True)
class Fetch(_StageOp):
    pass


@dataclass(frozen=True)
class OffloadKept:
    """``Offload_kept(i)``; ``with_input``: x_i, which the option pins and no other tape holds, goes too."""

    stage: int
    with_input: bool = False

    def __str__(self) -> str:
        return f"Offload_kept({self.stage}{', x' if self.with_input else ''})"


@dataclass(frozen=True)
class FetchKept(_StageOp):
    pass


Op = Union[FNone, FCk, FAll, Backward, Loss, Offload, Fetch, OffloadKept, FetchKept]
_OP_TYPES = {"F_none": FNone, "F_ck": FCk, "F_all": FAll, "B": Backward, "Loss": Loss, "Offload": Offload,
             "Fetch": Fetch, "Offload_kept": OffloadKept, "Fetch_kept": FetchKept}
_OP_NAMES = {v: k for k, v in _OP_TYPES.items()}


def op_to_json(op: Op) -> list:
    name = _OP_NAMES[type(op)]
    if isinstance(op, Loss):
        return [name]
    if isinstance(op, FAll):
        return [name, op.stage, op.option]
    if isinstance(op, OffloadKept):
        return [name, op.stage, int(op.with_input)]
    return [name, op.stage]


def op_from_json(item: list) -> Op:
    cls = _OP_TYPES[item[0]]
    if cls is OffloadKept:
        return OffloadKept(int(item[1]), bool(item[2]))
    return cls(*(int(v) for v in item[1:]))


@dataclass(frozen=True)
class ChainSchedule:
    """A whole-chain schedule with what the planner predicted for it.

    predicted_time: seconds (sum of the ops' profiled times).
    predicted_peak_bytes: peak bytes of the step as the planner's memory model counts it.
    budget_bytes: the budget it was planned for; memory_unit_bytes: the DP's memory slot.
    """

    ops: tuple[Op, ...]
    length: int
    predicted_time: float
    predicted_peak_bytes: int
    budget_bytes: int
    memory_unit_bytes: int

    @property
    def loss_index(self) -> int:
        """Index of the Loss op: ops before it run in the chain's forward, the rest in backward."""
        for idx, op in enumerate(self.ops):
            if isinstance(op, Loss):
                return idx
        raise ValueError("schedule has no Loss op")

    @property
    def keeps_everything(self) -> bool:
        """True for plain autograd's schedule: every stage forwarded once with option 0, then every backward."""
        L = self.length
        expected = tuple(FAll(i, 0) for i in range(L)) + (Loss(),) + tuple(Backward(i) for i in reversed(range(L)))
        return self.ops == expected

    def forward_counts(self) -> list[int]:
        """How many times each stage's forward runs in the step (1 = never recomputed)."""
        counts = [0] * self.length
        for op in self.ops:
            if isinstance(op, (FNone, FCk, FAll)):
                counts[op.stage] += 1
        return counts

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": "hierremat.ChainSchedule/1",
                "length": self.length,
                "ops": [op_to_json(op) for op in self.ops],
                "predicted_time": self.predicted_time,
                "predicted_peak_bytes": self.predicted_peak_bytes,
                "budget_bytes": self.budget_bytes,
                "memory_unit_bytes": self.memory_unit_bytes,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> "ChainSchedule":
        d = json.loads(text)
        if d.get("format") != "hierremat.ChainSchedule/1":
            raise ValueError(f"not a hierremat ChainSchedule JSON (format={d.get('format')!r})")
        return cls(
            ops=tuple(op_from_json(item) for item in d["ops"]),
            length=int(d["length"]),
            predicted_time=float(d["predicted_time"]),
            predicted_peak_bytes=int(d["predicted_peak_bytes"]),
            budget_bytes=int(d["budget_bytes"]),
            memory_unit_bytes=int(d["memory_unit_bytes"]),
        )

    def __str__(self) -> str:
        return " ".join(str(op) for op in self.ops)
