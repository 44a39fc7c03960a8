"""Every rank on one plan: under FSDP2 each rank runs the same schedule (its collectives in the
schedule's order), so rank 0's planning outcome is broadcast (``rank0s``) and the ranks' input keys are checked
to agree before any of them plans (``ranks_plan``)."""

from __future__ import annotations

import json

import torch

from ..errors import InfeasibleBudgetError, UnsupportedModelError
from ..plans.sequential_plan import SequentialPlan


def rank_count() -> int:
    """How many ranks the default process group has (1 without one)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank0s(outcome: SequentialPlan | InfeasibleBudgetError) -> SequentialPlan | InfeasibleBudgetError:
    """Rank 0's planning outcome (a plan, or the budget was infeasible) on every rank of the
    default process group: every rank must run the same schedule (its collectives happen in
    the schedule's order) or raise the same error. ``outcome`` itself without a group."""
    import torch.distributed as dist

    if rank_count() == 1:
        return outcome
    if isinstance(outcome, InfeasibleBudgetError):
        mine = {"infeasible": [outcome.budget_bytes, outcome.min_budget_bytes, outcome.what,
                               outcome.min_budget_bytes_output_held, outcome.min_budget_bytes_grads_kept]}
    else:
        mine = {"plan": outcome.to_json()}
    box = [json.dumps(mine) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    theirs = json.loads(box[0])
    if "infeasible" in theirs:
        return InfeasibleBudgetError(*theirs["infeasible"])
    return SequentialPlan.from_json(theirs["plan"])


#: The budget a new shape of a sharded model is first planned within (RematModule._add_sharded): none.
UNBOUNDED_BYTES = 1 << 62


def ranks_plan(shape_key, plans: bool, refuses: bool = False, retime: bool | None = None) -> tuple[bool, bool, bool]:
    """Under FSDP2 every rank runs one schedule (its all-gathers happen in the schedule's order): whether any rank
    of the default process group plans in this call (``plans``: this one does), where every rank then re-plans for
    the shards together with it (PlannedShape.shard: rank 0's plan on every rank). One small all-gather of the ranks'
    input keys per call where the group has several ranks. Ranks called with inputs of other shapes, dtypes or
    autocast (``shape_key``: the call's input key without its padding state) raise UnsupportedModelError, every
    one of them, before any plans or runs a step; a padding state differing between ranks is one schedule's
    (rank 0's), as at the first call after fully_shard. Returns (whether any rank plans, whether any refuses to:
    ``refuses``, a new shape with ``on_new_shape="error"``, whether every rank solves its plan again from its training
    steps' times now: ``retime``, whether this rank's is due to be, None where it runs no sharded plan to solve
    again; every rank then does where none plans and rank 0's is due, a collective: StepRetimer.retime)."""
    import torch.distributed as dist

    if rank_count() == 1:
        return plans, refuses, bool(retime) and not plans

    def without_index(part):  # (each rank's inputs are on its own device: cuda:0, cuda:1, ...)
        if isinstance(part, tuple):
            return tuple(without_index(p) for p in part)
        return part.type if isinstance(part, torch.device) else part

    mine = (repr(without_index(shape_key)), plans, refuses, retime)
    every = [None] * rank_count()
    dist.all_gather_object(every, mine)
    keys = [k for k, *_ in every]
    if len(set(keys)) > 1:
        other = next(r for r, k in enumerate(keys) if k != keys[0])
        raise UnsupportedModelError(
            f"under FSDP2 every rank must be called with inputs of the same shapes, dtypes and autocast setting (every "
            f"rank runs one schedule, whose all-gathers must match), but rank 0 and rank {other} differ: {keys[0]} "
            f"against {keys[other]}. Pad every rank's batch to one length (the global batch's longest, or a fixed "
            "multiple)"
        )
    planned = any(p for _, p, _, _ in every)
    retimed = not planned and bool(every[0][3]) and all(r is not None for *_, r in every)
    return planned, any(r for _, _, r, _ in every), retimed
