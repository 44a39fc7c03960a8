"""How the caller uses the chain output: held or released, which outputs get a gradient.

The plan's memory model charges the output through the backward only if the caller holds
it, and charges a gradient only for the outputs that receive one. Each backward records
what the caller did; a different use re-plans the next call.
"""

import copy
import logging

import pytest
import torch

import hierremat as hr
from hierremat.api import sequential
from hierremat.device import LiveTensorTracker

from models import random_mlp_chain, tiny_gpt2

MiB = 2**20


def _plain_peak(model, x, hold: bool) -> int:
    model = copy.deepcopy(model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with LiveTensorTracker() as tracker:
        if hold:
            y = model(x)
            y.pow(2).mean().backward()
        else:
            model(x).pow(2).mean().backward()
    return tracker.peak_bytes


def _entry(model, x, budget, variants=True, block_options="ilp"):
    return sequential.plan_cache.get(
        sequential.PlanCache.key(list(model), x, hr.parse_budget(budget), 500, block_options=block_options,
                                 variants=variants)
    )


def test_released_output_replans_to_plain_autograd_at_its_peak():
    """At plain autograd's own peak with the output released, the adapted plan recomputes nothing.
    (Operator variants off: with packed dropout masks even the held plan recomputes nothing here.)"""
    torch.manual_seed(0)
    model = random_mlp_chain(0)
    x = torch.randn(256, 96, requires_grad=True)
    budget = f"{_plain_peak(model, x, hold=False)}B"
    assert hr.parse_budget(budget) < _plain_peak(model, x, hold=True)
    sequential.plan_cache.clear()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    hr.checkpoint_sequential(model, budget, x, variants=False).pow(2).mean().backward()  # planned as held
    entry = _entry(model, x, budget, variants=False)
    assert entry.plan.costs.held_output > 0
    assert max(entry.plan.schedule.forward_counts()) > 1  # held, it has to recompute to fit
    with LiveTensorTracker() as tracker:
        hr.checkpoint_sequential(model, budget, x, variants=False).pow(2).mean().backward()  # re-planned as released
    assert entry.plan.costs.held_output == 0
    assert max(entry.plan.schedule.forward_counts()) == 1  # nothing recomputed (through autograd or generated code)
    assert tracker.peak_bytes <= hr.parse_budget(budget)
    assert abs(tracker.peak_bytes - entry.plan.predicted_peak_bytes) <= max(0.1 * hr.parse_budget(budget), MiB)


def test_holding_an_output_planned_as_released_warns_and_replans(caplog):
    torch.manual_seed(1)
    model = random_mlp_chain(1)
    x = torch.randn(256, 96, requires_grad=True)
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan_sequential(model, "1KiB", x, output_held=False)
    released_min = err.value.min_budget_bytes
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan_sequential(model, "1KiB", x, output_held=True)
    held_min = err.value.min_budget_bytes
    assert held_min > released_min
    sequential.plan_cache.clear()
    budget = f"{held_min}B"
    y = hr.checkpoint_sequential(model, budget, x, output_held=False)
    entry = _entry(model, x, budget)
    assert entry.plan.costs.held_output == 0
    with caplog.at_level(logging.WARNING, logger="hierremat"):
        y.pow(2).mean().backward()  # the caller holds y
        hr.checkpoint_sequential(model, budget, x, output_held=False).pow(2).mean()
    assert "of the chain output" in caplog.text
    assert entry.plan.costs.held_output == entry.plan.costs.activation_bytes[-1]


def test_gpt2_plans_a_gradient_for_the_loss_only():
    pytest.importorskip("transformers")
    torch.manual_seed(2)
    model = tiny_gpt2(n_layer=2)
    ids = torch.randint(0, 256, (2, 64))
    kwargs = {"labels": ids, "use_cache": False}
    plan = hr.plan(model, (ids,), kwargs, budget="1GiB")
    costs = plan.chain.costs
    assert sum(plan.chain.output_grad_mask) == 1
    assert costs.output_grad == 4  # the fp32 scalar loss; the logits get no gradient
    assert costs.activation_bytes[-1] > 2 * 64 * 256 * 4  # the logits are part of the output


def test_gpt2_gradient_for_logits_warns_and_reprofiles(caplog):
    pytest.importorskip("transformers")
    torch.manual_seed(3)
    model = tiny_gpt2(n_layer=2)
    ids = torch.randint(0, 256, (2, 32))
    kwargs = {"labels": ids, "use_cache": False}
    reference = copy.deepcopy(model)
    module = hr.remat(model, (ids,), kwargs, budget="1GiB", settings=hr.Settings(strategy="segments=2"))
    torch.manual_seed(5)
    with caplog.at_level(logging.WARNING, logger="hierremat"):
        out = module(ids, **kwargs)
        (out.loss + out.logits.float().pow(2).mean()).backward()
        module(ids, **kwargs)
    assert "gradients arrived for chain outputs" in caplog.text
    (plan,) = module.plans
    assert plan.chain.output_grad_mask == (True, True)
    # gradients of the step that carried the unexpected gradient are still exact
    torch.manual_seed(5)
    ref_out = reference(ids, **kwargs)
    (ref_out.loss + ref_out.logits.float().pow(2).mean()).backward()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_plan_that_keeps_everything_still_observes_the_output_use(caplog):
    """Keeping everything runs as plain autograd; an identity node on the output still records its use.
    (Autograd's options only: with block options, generated code measured faster may be picked.)"""
    torch.manual_seed(2)
    model = random_mlp_chain(2)
    x = torch.randn(128, 96, requires_grad=True)
    sequential.plan_cache.clear()
    y = hr.checkpoint_sequential(model, "64GiB", x, output_held=False, block_options="autograd")
    entry = _entry(model, x, "64GiB", block_options="autograd")
    assert entry.plan.schedule.keeps_everything and entry.plan.costs.held_output == 0
    with caplog.at_level(logging.WARNING, logger="hierremat"):
        y.pow(2).mean().backward()  # the caller holds y
        z = hr.checkpoint_sequential(model, "64GiB", x, output_held=False, block_options="autograd")
    assert "of the chain output" in caplog.text
    assert entry.plan.costs.held_output == entry.plan.costs.activation_bytes[-1]
    reference = copy.deepcopy(model)
    for p, q in zip(model.parameters(), reference.parameters()):
        p.grad, q.grad = None, None
    torch.manual_seed(7)
    del y
    z = None
    torch.manual_seed(7)
    hr.checkpoint_sequential(model, "64GiB", x, block_options="autograd").pow(2).mean().backward()
    torch.manual_seed(7)
    reference(x).pow(2).mean().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
