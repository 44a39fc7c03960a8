"""Parameters read by several stages (a tied embedding and LM head): one gradient accumulation per step.

Plain autograd sums a parameter's gradients from all its uses before ``AccumulateGrad`` adds
them into ``.grad``, so the parameter's accumulation hooks fire once per backward, with the
complete gradient. DistributedDataParallel relies on it: its reducer marks a parameter ready
from that hook and refuses a second call in one step ("Expected to mark a variable ready only
once"); post-accumulate-grad hooks (an optimizer stepping in backward) expect it too.

hierremat's runner backpropagates stage by stage, so a parameter read by two stages would
reach its ``AccumulateGrad`` twice. Here every stage reading it but the first (in chain order:
the last whose backward runs) computes with a *stand-in*: a leaf that shares the parameter's
storage (no memory) and, during the stage's backward, its ``.grad`` too, so the stand-in's
accumulation adds into the parameter's ``.grad`` in place without calling the parameter's
hooks. The first reader uses the parameter itself: its accumulation adds the last term and
fires the hooks once, when ``.grad`` is complete. The sums are autograd's stage by stage, as
without stand-ins.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class StandIn:
    """One shared parameter during one step: the parameter and the leaf standing in for it."""

    target: str
    param: torch.nn.Parameter
    leaf: torch.nn.Parameter


class TiedParameters:
    """The parameters several stages read, and which stages compute with stand-ins for them.

    forms: per stage, the modules that run it (the stage, then other forms of it: a fused head),
    all looked at when the stage computes; those with ``parameter_targets()`` (parameters by
    their names in the user's model) and ``substitute(target, param)`` take part
    (hierremat.blocks.segment.GraphStage).
    """

    def __init__(self, forms: Sequence[Sequence]):
        #: per stage: (a form, the targets it reads)
        self.forms = [[(m, frozenset(m.parameter_targets())) for m in modules
                       if hasattr(m, "parameter_targets") and hasattr(m, "substitute")] for modules in forms]
        readers: dict[str, list[int]] = {}
        for i, modules in enumerate(self.forms):
            for target in sorted(set().union(*(targets for _, targets in modules))):
                readers.setdefault(target, []).append(i)
        #: target -> the stage that uses the parameter itself (its first reader)
        self.first_reader = {t: r[0] for t, r in readers.items() if len(r) > 1}
        #: stage -> the targets it uses stand-ins for
        self.by_stage: dict[int, tuple[str, ...]] = {}
        for target, stages in readers.items():
            for i in stages[1:]:
                self.by_stage[i] = (*self.by_stage.get(i, ()), target)

    def __bool__(self) -> bool:
        return bool(self.by_stage)

    def stand_ins(self) -> dict[str, StandIn]:
        """Fresh stand-ins for one step (the parameters as they are now)."""
        out = {}
        for target, first in self.first_reader.items():
            param = next(m for m, targets in self.forms[first] if target in targets).parameter(target)
            if param.requires_grad:
                out[target] = StandIn(target, param, torch.nn.Parameter(param.detach()))
        return out

    @contextlib.contextmanager
    def forward(self, i: int, stand_ins: dict[str, StandIn]):
        """Stage i computes with the stand-ins while inside (a grad-mode forward that backward will follow)."""
        used = self._used(i, stand_ins)
        self._put(i, [(s.target, s.leaf) for s in used])
        try:
            yield
        finally:
            self._put(i, [(s.target, s.param) for s in used])

    def _used(self, i: int, stand_ins: dict[str, StandIn]) -> list[StandIn]:
        return [stand_ins[t] for t in self.by_stage.get(i, ()) if t in stand_ins]

    def _put(self, i: int, params: list[tuple[str, torch.nn.Parameter]]) -> None:
        """Make every form of stage i compute with these parameters (target, parameter)."""
        for target, param in params:
            for m, targets in self.forms[i]:
                if target in targets:
                    m.substitute(target, param)

    @contextlib.contextmanager
    def backward(self, i: int, stand_ins: dict[str, StandIn]):
        """Stage i's backward: its stand-ins' accumulations go into the parameters' ``.grad``."""
        used = self._used(i, stand_ins)
        for s in used:
            s.leaf.grad = s.param.grad
        try:
            with self.forward(i, stand_ins):  # generated backward code reads the parameters it was given
                yield
        finally:
            for s in used:
                if s.leaf.grad is not None and s.param.grad is not s.leaf.grad:
                    s.param.grad = s.leaf.grad  # the first gradient (``.grad`` was None)
                s.leaf.grad = None
