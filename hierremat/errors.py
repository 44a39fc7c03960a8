"""Exceptions raised at hierremat's public API."""

from __future__ import annotations

from .budget import format_bytes


class InfeasibleBudgetError(ValueError):
    """No schedule fits the memory budget.

    Attributes:
        budget_bytes: the budget that was asked for, in bytes.
        min_budget_bytes: the smallest budget, in bytes, at which a schedule exists.
    """

    def __init__(self, budget_bytes: int, min_budget_bytes: int, what: str = "budget"):
        self.budget_bytes = int(budget_bytes)
        self.min_budget_bytes = int(min_budget_bytes)
        super().__init__(
            f"{what}={format_bytes(self.budget_bytes)} ({self.budget_bytes} bytes) is too small: "
            f"the smallest feasible budget is {format_bytes(self.min_budget_bytes)} "
            f"({self.min_budget_bytes} bytes). Raise the budget to at least that."
        )


class UnsupportedModelError(TypeError):
    """The model (or one of its stages) cannot be planned or run; the message names it and why."""


class InvalidScheduleError(ValueError):
    """A ChainSchedule is not executable (backward before forward, missing checkpoint, ...)."""
