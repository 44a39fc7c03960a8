"""hierremat: optimal hierarchical activation rematerialization for PyTorch.

    import hierremat as hr
    y = hr.checkpoint_sequential(model, "512MiB", x)   # drop-in for torch's, budget instead of segments
    plan = hr.plan_sequential(model, "512MiB", x)      # plan only; print(plan.summary())

The planning core (``hierremat.dp``, ``hierremat.plans.simulate``, schedules, costs) does not
import torch; the torch-facing names below are loaded on first use.
"""

from ._torch_version import check_torch_version
from .budget import format_bytes, parse_budget
from .errors import InfeasibleBudgetError, InvalidScheduleError, OffloadError, UnsupportedModelError
from .plans.model_plan import ModelPlan
from .plans.sequential_plan import SequentialPlan
from .plans.schedule import ChainSchedule
from .session import PlannerSession, current_session, planner_session

__version__ = "0.1.0"

check_torch_version()

_TORCH_NAMES = {
    "checkpoint_sequential": "api.sequential",
    "plan_sequential": "api.sequential",
    "plan_cache": "api.sequential",
    "plan": "api.explore",
    "explore": "api.explore",
    "BudgetExplorer": "api.explore",
    "remat": "api.whole_model",
    "RematModule": "api.whole_model",
    "Settings": "api.settings",
}


def __getattr__(name: str):
    if name in _TORCH_NAMES:
        import importlib

        return getattr(importlib.import_module(f".{_TORCH_NAMES[name]}", __name__), name)
    raise AttributeError(f"module 'hierremat' has no attribute {name!r}")


__all__ = [
    "BudgetExplorer",
    "ChainSchedule",
    "ModelPlan",
    "RematModule",
    "InfeasibleBudgetError",
    "InvalidScheduleError",
    "OffloadError",
    "PlannerSession",
    "SequentialPlan",
    "Settings",
    "UnsupportedModelError",
    "checkpoint_sequential",
    "current_session",
    "explore",
    "format_bytes",
    "parse_budget",
    "plan",
    "plan_cache",
    "plan_sequential",
    "planner_session",
    "remat",
]
