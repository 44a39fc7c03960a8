"""The smallest feasible budget a user is told is one they can train at.

For every model of the suite, called the way it is trained, the budget that
InfeasibleBudgetError reports (``min_budget_bytes`` after asking for 1 KiB) is used as it
is: the module plans there and trains two steps (the first step tells the plan how the
caller uses the outputs: released as ``model(...).loss.backward()`` does, the loss alone
held while it is differentiated) within it, with no new error. A caller that keeps the
outputs alive through the backward is told the minimum for that too
(``min_budget_bytes_output_held``), and trains there with ``output_held=True``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hierremat as hr
from hierremat.device import LiveTensorTracker
from hierremat.dp import min_peak_schedule
from hierremat.planning.chain_plan import _fastest_fitting
from hierremat.plans.simulate import simulate

from chains import random_chain
from models import LossOnly, TinyResNet, random_mlp_chain, tiny_bert, tiny_gpt2, tiny_llama, tiny_qwen2, tiny_vit

pytest.importorskip("transformers")


def _ids():
    return torch.randint(0, 256, (2, 40))


def _lm(make):
    def build():
        ids = _ids()
        return make(), (ids,), {"labels": ids, "use_cache": False}, {}
    return build


def _bert():
    ids = torch.randint(5, 256, (2, 40))
    labels = torch.full_like(ids, -100)
    labels[:, ::7] = ids[:, ::7]
    return tiny_bert(), (ids,), {"attention_mask": torch.ones_like(ids), "labels": labels}, {}


MODELS = {
    "gpt2": _lm(tiny_gpt2),
    "gpt2-outputs-loss": lambda: (*_lm(tiny_gpt2)()[:3], {"outputs": "loss"}),
    "gpt2-loss-only": lambda: (LossOnly(tiny_gpt2()), (lambda ids: (ids, ids))(_ids()), {}, {}),
    "llama": _lm(tiny_llama),
    "qwen2": _lm(tiny_qwen2),
    "bert": _bert,
    "vit": lambda: (tiny_vit(), (torch.randn(4, 3, 32, 32),), {"labels": torch.randint(0, 10, (4,))}, {}),
    "resnet": lambda: (TinyResNet(), (torch.randn(8, 3, 16, 16),), {"labels": torch.randint(0, 10, (8,))}, {}),
}


def _loss(out):
    if isinstance(out, torch.Tensor):
        return out
    return out.loss if hasattr(out, "loss") else out[0]


def _steps(module, model, args, kwargs, budget, hold: bool):
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for _ in range(2):
        with LiveTensorTracker() as tracker:
            out = module(*args, **kwargs)
            loss = _loss(out)
            if not hold:
                del out
            loss.backward()
            del loss
            out = None
    assert tracker.peak_bytes <= budget, module.plans[-1].summary()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_reported_minimum_trains(name):
    torch.manual_seed(0)
    model, args, kwargs, settings = MODELS[name]()
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan(model, args, kwargs, budget="1KiB", **settings)
    budget = err.value.min_budget_bytes
    module = hr.remat(model, args, kwargs, budget=f"{budget}B", **settings)
    _steps(module, model, args, kwargs, budget, hold=False)
    held = err.value.min_budget_bytes_output_held
    if held is not None:  # the outputs kept alive through the backward need more, and say how much
        assert held > budget and "output_held=True" in str(err.value)
        module = hr.remat(model, args, kwargs, budget=f"{held}B", settings=hr.Settings(output_held=True), **settings)
        _steps(module, model, args, kwargs, held, hold=True)


def test_the_reported_minimum_trains_checkpoint_sequential():
    torch.manual_seed(1)
    model = random_mlp_chain(1)
    x = torch.randn(128, 96, requires_grad=True)
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan_sequential(model, "1KiB", x)
    budget = f"{err.value.min_budget_bytes}B"
    for p in model.parameters():  # as in any step after the first (the budget does not count .grad)
        p.grad = torch.zeros_like(p)
    hr.checkpoint_sequential(model, budget, x).pow(2).mean().backward()  # the first call plans
    for _ in range(2):
        with LiveTensorTracker() as tracker:
            hr.checkpoint_sequential(model, budget, x).pow(2).mean().backward()
        assert tracker.peak_bytes <= err.value.min_budget_bytes


def test_a_plan_that_keeps_everything_is_priced_as_it_runs():
    """The DP prices its schedules with the chain's output gradient held to the end of the backward; one that
    keeps everything runs as plain autograd, which frees it. The plan's predicted peak is the simulator's
    replay as it runs (the stress test's invariant; a random chain at its reported minimum once broke it)."""
    kept_everything = 0
    for seed in range(300):
        rng = np.random.default_rng(seed)
        costs = random_chain(rng, int(rng.integers(1, 4)), 2)
        low = min_peak_schedule(costs.with_leaner_forwards()).predicted_peak_bytes
        for budget in (low, low + 5, 4 * low):
            planned, schedule = _fastest_fitting(costs, budget, 0, lambda schedule: 0, slots=400)
            replay = simulate(planned, schedule, output_grad_persists=not schedule.keeps_everything)
            assert schedule.predicted_peak_bytes == replay.peak_bytes <= budget, (seed, budget, schedule)
            assert schedule.predicted_time == pytest.approx(replay.time, rel=1e-9)
            kept_everything += schedule.keeps_everything
    assert kept_everything > 10
