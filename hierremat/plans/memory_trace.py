"""A measured chain's byte counts, each kept as the candidates it is the largest of.

Every byte count a chain profile measures (hierremat.runtime.profile) is either a size (a stage
output's bytes, the bytes a forward keeps for its backward) or a peak: the most bytes live during a
run above those live before it. The live-tensor tracker records the live bytes just after each
storage it counts, so a peak is the largest of those records in its run; a figure with a floor
(``max(peak, output bytes)``) adds the floor as one more candidate. Each candidate is then a sum of
storage sizes, and at another input shape of the same graph every storage has the size its shape
expressions give there: a polynomial in the input's sizes (linear in the tokens, quadratic in the
sequence length for attention's scores). hierremat.planning.shape_fit fits each candidate from the
shapes measured, checks the fit reproduces every one of them to the byte, and takes each figure's
largest candidate at a new shape: its memory with no run of the model.

Keys name the figure they make: ``stage{i}.{field}`` (a StageCosts or autograd OptionCosts field),
``activation{j}``, ``output_grad``, ``loss``, ``resident{r}.value`` and ``resident{r}.grad``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from .costs import ChainCosts

#: A trace's key for the CPU kernels' scratch above a figure's peak (``stage{i}.scratch.{figure}``): what the
#: allocator meter saw above the tracked bytes (hierremat.runtime.profile). The figure is its candidates' largest
#: plus its scratch; the scratch is not a sum of storages: at another shape, the largest measured.
SCRATCH = "scratch."
#: The memory figures of a stage (StageCosts') and of its autograd option (OptionCosts') a trace holds.
STAGE_FIELDS = ("nograd_fwd_overhead_bytes",)
OPTION_FIELDS = ("kept_bytes", "fwd_overhead_bytes", "bwd_overhead_bytes", "bwd_overhead_new_grads_bytes")


@dataclass(frozen=True)
class MemoryTrace:
    """(key, candidates) pairs, each figure the largest of its candidates (module docstring).

    A figure absent from a trace was None where measured (bwd_overhead_new_grads_bytes of a stage
    without trainable parameters)."""

    figures: tuple[tuple[str, tuple[int, ...]], ...]

    def values(self) -> dict[str, int]:
        """Each figure (and each scratch): the largest of its candidates."""
        return {key: max(points) for key, points in self.figures}

    def prefixed(self, prefix: str) -> "MemoryTrace":
        return MemoryTrace(tuple((f"{prefix}{key}", points) for key, points in self.figures))

    def plus(self, other: "MemoryTrace") -> "MemoryTrace":
        return MemoryTrace(self.figures + other.figures)

    def to_dict(self) -> dict:
        """As JSON (figures in order: a cache's JSON sorts an object's keys)."""
        return {"figures": [[key, list(points)] for key, points in self.figures]}

    @classmethod
    def from_dict(cls, d: dict) -> "MemoryTrace":
        return cls(tuple((str(key), tuple(int(p) for p in points)) for key, points in d["figures"]))


def stage_trace(scratch: Mapping[str, int] | None = None, **figures: tuple[int, ...] | None) -> MemoryTrace:
    """A stage's trace from its figures' candidates (None: the figure is None), and the kernels' scratch
    on top of each peak (``scratch``: figure -> bytes; SCRATCH)."""
    unknown = set(figures) - set(STAGE_FIELDS) - set(OPTION_FIELDS)
    if unknown:
        raise ValueError(f"not a stage memory figure: {sorted(unknown)}")
    traced = [(k, tuple(int(p) for p in v)) for k, v in figures.items() if v is not None]
    traced += [(SCRATCH + k, (int(bytes_),)) for k, bytes_ in (scratch or {}).items() if figures.get(k) is not None]
    return MemoryTrace(tuple(traced))


def is_scratch(key: str) -> bool:
    """Whether a trace's key names a figure's scratch (SCRATCH)."""
    return key.partition(".")[2].startswith(SCRATCH)


def with_memory(costs: ChainCosts, values: Mapping[str, int]) -> tuple[ChainCosts, int]:
    """``costs`` with every byte count a chain trace names set to ``values`` (its figures at another
    shape), and the loss bytes. Stage options other than autograd's (block options) are left out: a
    menu re-costs those at the new shape."""
    stages = []
    for i, st in enumerate(costs.stages):
        option = st.options[0]
        figure = lambda f: values[f"stage{i}.{f}"] + values.get(f"stage{i}.{SCRATCH}{f}", 0)
        figures = {f: figure(f) for f in OPTION_FIELDS[:-1]}
        new_grads = figure(OPTION_FIELDS[-1]) if f"stage{i}.{OPTION_FIELDS[-1]}" in values else None
        option = replace(option, **figures, bwd_overhead_new_grads_bytes=new_grads)
        stages.append(replace(st, options=(option,), **{f: figure(f) for f in STAGE_FIELDS}))
    residents = tuple(
        replace(r, value_bytes=values[f"resident{k}.value"], grad_bytes=values[f"resident{k}.grad"])
        for k, r in enumerate(costs.residents)
    )
    fitted = replace(
        costs, stages=tuple(stages), residents=residents, output_grad_bytes=values["output_grad"],
        activation_bytes=tuple(values[f"activation{j}"] for j in range(len(costs.activation_bytes))),
    )
    return fitted, values["loss"]
