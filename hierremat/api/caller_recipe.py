"""What a RematModule learns from how it is called, after it planned: the autocast recipe of the caller's backward,
and fp32 copies of the outputs that a wrapper makes (accelerate's mixed precision); a shape planned for another is
planned again, a saved plan warned about once.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Iterable

from .planned_shape import PlannedShape
from .shape_planning import PlanSettings

log = logging.getLogger(__name__)


def observed_backward_autocast(plans: Iterable[PlannedShape]) -> bool | None:
    """Whether the last backward under autocast of ``plans`` (least recently used first) ran under it."""
    for planned in reversed(list(plans)):
        seen = planned.chain_module.planned.runner.observed_backward_autocast
        if seen is not None and planned.plan.chain.autocast != "off":
            return seen
    return None


def with_backward_recipe(settings: PlanSettings, plans: Iterable[PlannedShape], model_name: str) -> PlanSettings:
    """``settings`` with the caller's autocast recipe (PlanSettings.backward_autocast) taken from the last backward
    under autocast of ``plans``: every shape planned from then on is traced for it (warned where it contradicts the
    one given)."""
    seen = observed_backward_autocast(plans)
    given = settings.backward_autocast
    if seen is None or given == seen:
        return settings
    (log.info if given is None else log.warning)(
        "the backward runs %s autocast%s: %s's shapes are planned for it", "under" if seen else "outside",
        "" if given is None else f", not as backward_autocast={given} said", model_name,
    )
    return replace(settings, backward_autocast=seen)


def planned_for_another_recipe(planned: PlannedShape, recipe: bool | None) -> bool:
    """Whether ``planned`` is to be planned again for the caller's autocast recipe, now known: planned before, with
    stages left without block options for it, or for the other recipe. A saved plan for the other recipe is warned
    about once, not planned again."""
    menus = planned.chain_module.planned.menus
    if menus is None or recipe is None:
        return False
    other = menus.backward_autocast is not None and menus.backward_autocast != recipe
    if planned.saved:
        if other and not planned.recipe_warned:
            planned.recipe_warned = True
            log.warning("the saved plan's block options were traced for the backward %s autocast, and it runs %s "
                        "it: their gradients may differ from plain autocast's in the last bits; plan again with "
                        "backward_autocast=%s", "under" if menus.backward_autocast else "outside",
                        "under" if recipe else "outside", recipe)
        return False
    return bool(menus.recipe_dependent) or other


def copies_to_count(planned: PlannedShape, upcasts: bool, model_name: str) -> int | None:
    """The bytes of the fp32 copies the caller makes of the outputs (``upcasts``: accelerate's mixed precision wraps
    the forward, also after remat planned it or fully_shard sharded the model) where ``planned`` was planned with
    others, to plan it again with; None where they are the same, or ``planned`` is a saved plan (warned once)."""
    copies = planned.chain.half_outputs_in_fp32_bytes if upcasts else 0
    if copies == planned.plan.output_copies_bytes:
        return None
    if planned.saved:
        if copies and not planned.copies_warned:
            planned.copies_warned = True
            log.warning("the caller copies the model's fp16/bf16 outputs to fp32 (accelerate's mixed precision), "
                        "and the saved plan does not count the copies (%d B): its peak may exceed its budget by "
                        "that much; plan with hierremat.remat under the same wrapper instead", copies)
        return None
    log.info("%s's outputs are %s copied to fp32 by the caller (accelerate's mixed precision): planned again",
             model_name, "now" if copies else "no longer")
    return copies
