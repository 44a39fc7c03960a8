"""``hierremat.plan`` and ``hierremat.explore``: a whole model's plan at one budget, and the budgets it can take
(its smallest feasible one, a menu of plans from there to keeping everything) from one capture and profile."""

from __future__ import annotations

import time
from dataclasses import replace

import torch
from torch import nn

from ..blocks.capture import uncompiled
from ..blocks.hf import call_kwargs
from ..budget import parse_budget
from ..errors import InfeasibleBudgetError
from ..plans.model_plan import ModelPlan
from ..device.autocast import AutocastState
from .sequential import check_devices
from .settings import Settings, settings_from
from .shape_planning import ProfiledChain, captured_chain, plan_shape, device_types


def plan(
    model: nn.Module,
    example_args,
    example_kwargs: dict | None = None,
    *,
    budget,
    outputs: str | tuple[str, ...] | None = None,
    device: str | torch.device | None = None,
    settings: Settings | None = None,
) -> ModelPlan:
    """Capture, segment, profile and solve ``model`` on example inputs under ``budget`` (bytes or "3GiB").

    outputs: None: the model's outputs, all of them, as it returns them; or the names of the outputs the caller
    uses (``"loss"`` for a Hugging Face language model trained with ``model(...).loss.backward()``): the others
    are returned as None and never computed for their own sake, so the logits need not exist whole (the head may
    run fused with the loss, tile by tile: hierremat.planning.output_stage).
    device: where the model trains, for a model built without its weights (``torch.device("meta")``, or under
    ``FakeTensorMode``): it is captured without values and planned with real weights lent per distinct stage on
    ``device`` (hierremat.runtime.lent_weights); the plan is used once the model is materialized. None: where
    the model's parameters are.
    settings: every other option (hr.Settings: solver, cache, segmentation, variants, compile, time limit,
    offloading, autocast recipe); block options are built at once here.
    """
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    planning = settings_from(settings).planning(outputs, device)
    kwargs = call_kwargs(uncompiled(model), example_kwargs or {})
    return plan_shape(model, args, kwargs, parse_budget(budget), None, planning).plan


class BudgetExplorer:
    """What each memory budget costs a model, from one capture and one profile (see hierremat.explore).

    smallest_feasible_bytes: the smallest feasible budget InfeasibleBudgetError reports (a plan
    exists there; it sets aside the replay reserve of every stage, so the exact minimum may be
    up to that reserve lower); keep_all_bytes: the predicted peak of keeping everything
    (plain autograd's schedule). Plans at any budget
    are solved from the same measured costs, so their predicted times compare exactly; with ``offload=``
    given to explore, ``plan(budget, offload=False)`` is the plan without the second tier, from the same costs.
    """

    def __init__(self, profiled: ProfiledChain, capture_seconds: float):
        self._profiled = profiled
        self._capture_seconds = capture_seconds
        self.keep_all_bytes = profiled.solve(2**62, strategy="none").predicted_peak_bytes + profiled.beside_chain_bytes
        self.smallest_feasible_bytes = self._smallest_feasible()
        self._without_offload: int | None = None

    def _smallest_feasible(self, offload: bool = True) -> int:
        budget = 1
        for _ in range(4):  # follow the reported minimum until a plan exists there
            try:
                self._profiled.solve(budget, offload=offload)
                return budget
            except InfeasibleBudgetError as err:
                if err.min_budget_bytes <= budget:
                    raise
                budget = err.min_budget_bytes
        raise AssertionError(f"no plan at the smallest feasible budget reported ({budget} B)")

    def smallest_feasible(self, offload: bool = True) -> int:
        """The smallest feasible budget (as smallest_feasible_bytes), with the second tier or, ``offload``
        False, without it."""
        if _check_offload_flag(offload):
            return self.smallest_feasible_bytes
        if self._without_offload is None:
            self._without_offload = self._smallest_feasible(offload=False)
        return self._without_offload

    def plan(self, budget, offload: bool = True) -> ModelPlan:
        """The plan within ``budget`` (bytes or "512MiB"); InfeasibleBudgetError below the smallest feasible one.
        offload: False plans without the second tier explore was given (the same costs: to compare)."""
        budget_bytes = parse_budget(budget)
        solved = self._profiled.solve(budget_bytes, offload=_check_offload_flag(offload))
        return self._profiled.model_plan(solved, self._capture_seconds)

    def menu(self, points: int = 6) -> tuple[ModelPlan, ...]:
        """Plans at ``points`` budgets spaced evenly from the smallest feasible one to keeping everything."""
        if points < 2:
            raise ValueError(f"points must be at least 2, got {points}")
        low, high = self.smallest_feasible_bytes, max(self.keep_all_bytes, self.smallest_feasible_bytes)
        budgets = sorted({low + (high - low) * i // (points - 1) for i in range(points)})
        return tuple(self._profiled.model_plan(self._profiled.solve(b), self._capture_seconds) for b in budgets)


def _check_offload_flag(offload) -> bool:
    if not isinstance(offload, bool):
        raise TypeError(f"offload must be True (with the second tier explore was given) or False (without it), got "
                        f"{offload!r}: the tier itself is chosen by explore(..., settings=hr.Settings(offload=...))")
    return offload


def explore(
    model: nn.Module,
    example_args,
    example_kwargs: dict | None = None,
    *,
    outputs: str | tuple[str, ...] | None = None,
    settings: Settings | None = None,
) -> BudgetExplorer:
    """Capture, profile and build the block menus of ``model`` once, to see what budgets cost.

    ``explore(model, args).menu()`` gives plans from the smallest feasible budget to keeping
    everything (``python -m hierremat`` prints them); ``.plan(budget)`` one plan, which
    ``remat(model, ..., plan=...)`` runs. outputs and settings as for hierremat.plan (its strategy is
    'optimal', and block options run eagerly here: compiled forms are priced only when compiled).
    """
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    settings = replace(settings_from(settings), strategy="optimal", compile=False).planning(outputs, None)
    model = uncompiled(model)
    kwargs = call_kwargs(model, example_kwargs or {})
    started = time.perf_counter()
    check_devices(device_types(args, kwargs), "the example inputs")
    autocast = AutocastState.capture(device_types(args, kwargs))
    chain, x0, shared, capture_seconds, _ = captured_chain(model, args, kwargs, settings, autocast, started)
    return BudgetExplorer(ProfiledChain.of(chain, x0, shared, settings, settings.deadline(started)), capture_seconds)
