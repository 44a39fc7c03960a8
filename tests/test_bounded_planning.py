"""Planning is bounded: large blocks are split or get a coarser menu, and ``time_limit=`` holds.

- A block of about 2,000 ATen nodes with single-value cut points inside is split there into
  stages of at most MAX_STAGE_NODES nodes; one without such points (every step reads the
  block's input; about 1,000 nodes, still over MAX_STAGE_NODES, where the heuristic options'
  op lists, quadratic in the steps, took a minute at 2,000) keeps its size and gets the coarser,
  heuristic menu (its ILP would be too large). Either plans within its time limit and trains
  exactly within the budget.
- A planning deadline reached before a block's ILP sweep leaves it the heuristic menu, says so
  in the summary, and caches nothing of it; a later plan with time solves it.
- ``time_limit=`` is checked.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hierremat as hr
from hierremat.blocks import segment

from harness import train_step

WIDTH, DEPTH = 8, 300  # ~2,000 ATen nodes per block (forward and backward)
COARSE_DEPTH = 150  # (a block without cut points: ~1,000)


class LongBlock(nn.Module):
    """One module of many small steps, written out (no containers inside to cut at)."""

    def __init__(self, reads_input: bool):
        super().__init__()
        self.weight = nn.Parameter(0.3 * torch.randn(COARSE_DEPTH if reads_input else DEPTH, WIDTH, WIDTH))
        self.reads_input = reads_input

    def forward(self, x):
        h = x
        for i in range(len(self.weight)):
            step = torch.tanh(h @ self.weight[i])
            h = h + (step * x if self.reads_input else step)  # reading x in every step: no single-value cut
        return h


def _model(reads_input: bool) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), LongBlock(reads_input), nn.Linear(WIDTH, 2))


def _step(model, x):
    """(gradients, the larger of the two meters' peaks) of one step, ``.grad`` allocated."""
    step = train_step(model, (x,))
    return step.grads, max(step.tracker_peak, step.allocator_peak)


@pytest.mark.parametrize("reads_input", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["split-2000-nodes", "coarse-1000-nodes"])
def test_a_large_block_plans_within_its_time_limit(reads_input, tmp_path):
    model = _model(reads_input)
    x = torch.randn(64, WIDTH, requires_grad=True)
    reference = copy.deepcopy(model)
    grads_ref, plain_peak = _step(reference, x)
    limit = 60.0  # (that the ILP sweeps keep to it: tests/test_ilp.py, on an injected clock)
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan(model, (x,), budget="1KiB", settings=hr.Settings(cache=str(tmp_path), time_limit=limit))
    budget = max(plain_peak // 2, err.value.min_budget_bytes)
    plan = hr.plan(model, (x,), budget=f"{budget}B", settings=hr.Settings(cache=str(tmp_path), time_limit=limit))
    names = [s.name for s in plan.stages]
    nodes = [s.node_count for s in plan.stages]
    if reads_input:
        assert max(nodes) > segment.MAX_STAGE_NODES and any("heuristic" in line for line in plan.summary().splitlines())
    else:
        assert max(nodes) <= segment.MAX_STAGE_NODES and any("[2/" in name for name in names), names
        assert len({s.signature for s in plan.stages if "[" in s.name}) >= 1
    module = hr.remat(model, (x,), plan=plan, settings=hr.Settings(cache=str(tmp_path)))
    _step(module, x)  # (the first call may re-plan for the output's use)
    grads, peak = _step(module, x)
    assert peak <= module.plans[-1].budget_bytes
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_deadline_before_the_sweep_leaves_the_heuristic_menu_uncached(tmp_path):
    torch.manual_seed(1)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(3)])
    x = torch.randn(16, 32, requires_grad=True)
    cache = str(tmp_path)
    rushed = hr.plan(model, (x,), budget="64MiB", settings=hr.Settings(cache=cache, time_limit=1e-6))
    assert rushed.options_solves == 0 and "deadline" in rushed.summary()
    again = hr.plan(model, (x,), budget="64MiB", settings=hr.Settings(cache=cache))
    assert again.options_solves > 0 and "heuristic" not in again.summary()


def test_time_limit_is_checked():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    for bad in (0, -1, "60", True):
        with pytest.raises(ValueError, match="time_limit must be a positive number"):
            hr.plan(model, (x,), budget="1GiB", settings=hr.Settings(time_limit=bad))
    with pytest.raises(ValueError, match="time_limit"):
        hr.checkpoint_sequential(model, "1GiB", x.requires_grad_(), time_limit=0)
