"""Exceptions raised at hierremat's public API."""

from __future__ import annotations

from .budget import format_bytes


class InfeasibleBudgetError(ValueError):
    """No schedule fits the memory budget.

    Attributes:
        budget_bytes: the budget that was asked for, in bytes.
        min_budget_bytes: the smallest budget, in bytes, at which a schedule exists (for the
            use of the outputs planned for: released before backward, when the planner was free
            to assume it, as ``model(x).loss.backward()`` does).
        min_budget_bytes_output_held: where that differs, the smallest budget for a caller that
            keeps the outputs alive through the backward (``out = model(x); out.loss.backward()``
            with ``out`` still referenced; plan with ``output_held=True`` for it); else None.
        min_budget_bytes_grads_kept: where the step allocates parameter gradients (``.grad`` None
            at its start, PyTorch's default ``zero_grad(set_to_none=True)``) and that differs, the
            smallest budget with ``.grad`` kept allocated between steps; else None.
        note: more on what the minimums count (appended to the message).
    """

    def __init__(
        self, budget_bytes: int, min_budget_bytes: int, what: str = "budget",
        min_budget_bytes_output_held: int | None = None, min_budget_bytes_grads_kept: int | None = None,
        note: str = "",
    ):
        self.budget_bytes = int(budget_bytes)
        self.min_budget_bytes = int(min_budget_bytes)
        self.what = what
        self.note = note
        held = None if min_budget_bytes_output_held is None else int(min_budget_bytes_output_held)
        self.min_budget_bytes_output_held = held if held != self.min_budget_bytes else None
        kept = None if min_budget_bytes_grads_kept is None else int(min_budget_bytes_grads_kept)
        self.min_budget_bytes_grads_kept = kept if kept != self.min_budget_bytes else None
        text = (
            f"{what}={format_bytes(self.budget_bytes)} ({self.budget_bytes} bytes) is too small: "
            f"the smallest feasible budget is {format_bytes(self.min_budget_bytes)} ({self.min_budget_bytes} bytes)"
        )
        if self.min_budget_bytes_output_held is not None:
            text += (
                f" with the outputs released before backward (`model(x).loss.backward()`), "
                f"{format_bytes(self.min_budget_bytes_output_held)} ({self.min_budget_bytes_output_held} bytes) "
                "with them kept alive through it (plan with settings=hr.Settings(output_held=True) for that)"
            )
        if self.min_budget_bytes_grads_kept is not None:
            text += (
                f", counting the parameter gradients this step allocates (their .grad is None when it starts: "
                f"`zero_grad(set_to_none=True)`, PyTorch's default); {format_bytes(self.min_budget_bytes_grads_kept)} "
                f"({self.min_budget_bytes_grads_kept} bytes) with .grad kept allocated between steps "
                "(`zero_grad(set_to_none=False)` after a first step)"
            )
        super().__init__(text + note + ". Raise the budget to at least that.")

    def plus(self, budget_bytes: int, extra_bytes: int, note: str = "") -> "InfeasibleBudgetError":
        """This error for a larger whole: ``budget_bytes`` asked, every minimum ``extra_bytes`` more
        (the values held beside the chain; ``note``: what they count, appended)."""
        held, kept = self.min_budget_bytes_output_held, self.min_budget_bytes_grads_kept
        return InfeasibleBudgetError(
            budget_bytes, self.min_budget_bytes + extra_bytes, self.what,
            None if held is None else held + extra_bytes, None if kept is None else kept + extra_bytes,
            self.note + note,
        )


class UnsupportedModelError(TypeError):
    """The model (or one of its stages) cannot be planned or run; the message names it and why."""


class InvalidScheduleError(ValueError):
    """A ChainSchedule is not executable (backward before forward, missing checkpoint, ...)."""


class OffloadError(RuntimeError):
    """A second tier that cannot be written or read back whole (no room, no permission, a short read):
    raised when the tier is made (before training) or by the step that met it, never a partial value."""
