"""When a RematModule builds block options, and re-costs them at a new shape: rent or buy (the deterministic
ski-rental rule; Karlin, Manasse, Rudolph and Sleator, "Competitive snoopy caching", 1988). A shape planned
without them (``defer_block_options``, or re-costing put off at a fitted shape) runs its grad steps on autograd
options until those steps have lost what building or re-costing them costs; then it is planned again with them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..device.memory import profiler_active
from .planned_shape import PlannedShape
from .shape_planning import PlanSettings

log = logging.getLogger(__name__)


@dataclass
class BlockBuilding:
    """What a RematModule knows of its block options' cost, across its shapes (mutable: one per module).

    recost_seconds: what re-costing block options at a fitted shape took last time, or what building them is taken
    to cost while none is built (s); None: not known. built: whether any shape's plan has block options. pay: whether
    they were built because they pay or the budget needs them (not only found in the cache). lost_without: seconds
    block options could have saved the grad steps run before any was built (s). profiler_logged: whether a
    torch.profiler session putting them off was logged."""

    recost_seconds: float | None = None
    built: bool = False
    pay: bool = False
    lost_without: float = 0.0
    profiler_logged: bool = False

    def deferring(self, settings: PlanSettings) -> bool:
        """Whether block options are still to be built once they pay (``defer_block_options``, none built yet)."""
        return settings.defer_block_options and not self.built

    def reset(self) -> None:
        """Forget what was learnt (the model moved to another device)."""
        self.recost_seconds, self.built, self.pay, self.lost_without = None, False, False, 0.0

    def record(self, planned: PlannedShape) -> None:
        """Learn from a shape just planned: what its re-costing took, or what building is taken to cost."""
        menus = planned.plan.menus
        recosted = any(m.get("recosted") for m in menus.values())
        if recosted and not planned.plan.times.startswith("measured"):
            self.recost_seconds = planned.plan.options_seconds  # (block options re-costed at a fitted shape)
        elif planned.build_estimate is not None and self.recost_seconds is None:
            self.recost_seconds = planned.build_estimate  # (none built yet: what building them is taken to cost)
        elif menus and not self.built:  # built (solved): the next fitted shape re-costs at once, as after a first
            self.recost_seconds = None  # shape planned with them, and learns what re-costing takes
        self.built |= bool(menus)
        self.pay |= bool(menus) and not planned.menus_from_cache

    def due(self, planned: PlannedShape) -> bool:
        """Whether ``planned``, after one more grad step without block options, is to be planned again with them
        (its ``steps_without`` counted otherwise). Building them serves every shape: until one is built, the steps
        of all count; not while a torch.profiler session runs (building measures the CPU allocator with one)."""
        if not planned.block_gain:
            return False
        if profiler_active():
            if not self.profiler_logged:
                self.profiler_logged = True
                log.info("a torch.profiler session runs: block options are not built or re-costed until it ends")
            return False
        if not self.built:
            self.lost_without += planned.block_gain
            if self.lost_without < self.recost_seconds:
                planned.steps_without += 1
                return False
            log.info("block options built at this shape after steps without them lost up to %.2f s (building them "
                     "was taken to cost %.2f s)", self.lost_without, self.recost_seconds)
            return True
        if self.recost_seconds is not None and planned.steps_without * planned.block_gain < self.recost_seconds:
            planned.steps_without += 1  # (None: built since this shape was planned, what re-costing takes not known)
            return False
        log.info("block options re-costed at this shape after %d steps without them (each up to %.1f ms slower)",
                 planned.steps_without, planned.block_gain * 1e3)
        return True
