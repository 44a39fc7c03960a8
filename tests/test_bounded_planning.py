"""Planning is bounded: large blocks are split or get a coarser menu, and ``time_limit=`` holds.

- A block of about 2,000 ATen nodes with single-value cut points inside is split there into
  stages of at most MAX_STAGE_NODES nodes; one without such points (every step reads the
  block's input; about 1,000 nodes, still over MAX_STAGE_NODES, where the heuristic options'
  op lists, quadratic in the steps, took a minute at 2,000) keeps its size and gets the coarser,
  heuristic menu (its ILP would be too large). Either plans within its time limit and trains
  exactly within the budget.
- A planning deadline reached before a block's ILP sweep leaves it the heuristic menu, says so
  in the summary, and caches nothing of it; a later plan with time solves it.
- On an injected clock, the time limit bounds the profile and the node costs too: what comes after it is timed
  from one run and modelled, the summary says so, nothing cut is cached, and the plan still trains exactly within
  its budget.
- ``time_limit=`` is checked.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

import hierremat as hr
from hierremat.blocks import segment
from hierremat.planning import menu_store
from hierremat.plans import clock as planning_clock
from hierremat.runtime import profile as profile_module
from hierremat.runtime.profile import PROFILE_REPEATS

from harness import assert_same_bits, model_loss, train_step
from models import tiny_gpt2

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


class _SlowPlanning:
    """The planning clock moved ``seconds`` on by each stage profile and each measured node profile (so that the
    machine's load cannot decide what fits before the deadline): the calls, with the clock's lead when each began."""

    def __init__(self, monkeypatch, seconds: float):
        self.lead, self.stages, self.node_methods = 0.0, [], []
        real_stage, real_nodes = profile_module._profile_stage, menu_store.profile_nodes

        def stage(*args, **kwargs):
            self.stages.append((self.lead, args[5]))  # (its repeats)
            self.lead += seconds
            return real_stage(*args, **kwargs)

        def nodes(joint, x, shared, *, method="measure", **kwargs):
            self.node_methods.append((self.lead, method))
            self.lead += seconds if method == "measure" else 0.0
            return real_nodes(joint, x, shared, method=method, **kwargs)

        monkeypatch.setattr(planning_clock, "now", lambda: time.perf_counter() + self.lead)
        monkeypatch.setattr(profile_module, "_profile_stage", stage)
        monkeypatch.setattr(menu_store, "profile_nodes", nodes)


def test_the_time_limit_bounds_the_profile_and_the_node_costs_on_an_injected_clock(monkeypatch, tmp_path):
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2)
    ids = torch.randint(0, 256, (2, 32))
    kwargs = {"labels": ids, "use_cache": False}
    reference = copy.deepcopy(model)
    plain = train_step(reference, (ids,), model_loss, kwargs=kwargs)
    budget = plain.peak * 3 // 4
    limit = 1500.0  # (each stage profile takes 1000 s on the clock: the second one ends past the limit)
    slow = _SlowPlanning(monkeypatch, 1000.0)
    settings = hr.Settings(cache=str(tmp_path), time_limit=limit)
    plan = hr.plan(model, (ids,), kwargs, budget=f"{budget}B", settings=settings)
    assert len(slow.stages) >= 3, slow.stages
    assert all(repeats == (PROFILE_REPEATS if lead < limit else 1) for lead, repeats in slow.stages), slow.stages
    assert slow.node_methods and all(method == "flops" for _, method in slow.node_methods), slow.node_methods
    cut = sum(lead >= limit for lead, _ in slow.stages)
    assert plan.time_limit_cuts[0] == f"{cut} stage(s) timed from one run, not {PROFILE_REPEATS}", plan.time_limit_cuts
    assert "modelled from FLOPs" in plan.time_limit_cuts[1]
    summary = plan.summary()
    assert "the time limit ran out while planning" in summary and "heuristic block options" in summary, summary
    assert hr.ModelPlan.from_json(plan.to_json()).time_limit_cuts == plan.time_limit_cuts
    # the plan keeps the promises: exact gradients, the peak within the budget
    module = hr.remat(model, (ids,), kwargs, plan=plan, settings=hr.Settings(cache=str(tmp_path)))
    step = train_step(module, (ids,), model_loss, kwargs=kwargs, warmup=1)
    assert_same_bits(step, plain)
    assert step.peak <= budget, (step.peak, budget, summary)
    # nothing cut was cached: a plan with time measures the stages cut and the blocks' nodes, and cuts nothing
    monkeypatch.setattr(planning_clock, "now", time.perf_counter)
    slow.stages.clear(), slow.node_methods.clear()
    again = hr.plan(model, (ids,), kwargs, budget=f"{budget}B", settings=hr.Settings(cache=str(tmp_path)))
    assert len(slow.stages) == cut and all(repeats == PROFILE_REPEATS for _, repeats in slow.stages), slow.stages
    assert slow.node_methods and all(method == "measure" for _, method in slow.node_methods)
    assert again.time_limit_cuts == () and "heuristic" not in again.summary()


def test_time_limit_is_checked():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    for bad in (0, -1, "60", True):
        with pytest.raises(ValueError, match="time_limit must be a positive number"):
            hr.plan(model, (x,), budget="1GiB", settings=hr.Settings(time_limit=bad))
    with pytest.raises(ValueError, match="time_limit"):
        hr.checkpoint_sequential(model, "1GiB", x.requires_grad_(), time_limit=0)
