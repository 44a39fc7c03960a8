"""Parameter gradients a step allocates are in the budget.

With PyTorch's default ``zero_grad(set_to_none=True)`` every ``.grad`` is None when a step starts: the
step allocates each parameter's gradient in the backward of the last stage that reads it and keeps it
(ChainCosts.step_grad_bytes). hierremat detects at each call which gradients the step will allocate and
runs the plan made for that case. Peaks measured with the live-tensor tracker and the CPU allocator
meter; gradients compared bitwise with plain autograd's under the same ``zero_grad``.
"""

import copy

import pytest
import torch
from torch import nn

import hierremat as hr
from hierremat.api import sequential
from hierremat.device import LiveTensorTracker
from hierremat.device.memory import CpuAllocatorMeter
from hierremat.planning import chain_plan

from harness import CALLERS_LOSS_BYTES
from models import tiny_gpt2


def _chain(seed: int = 0, width: int = 256, stages: int = 6) -> nn.Sequential:
    """Parameters outweigh activations, as in small-batch fine-tuning."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(stages)])


def _zero_grad(model: nn.Module, set_to_none: bool) -> None:
    for p in model.parameters():
        if set_to_none:
            p.grad = None
        elif p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()


def _peaks(step, model: nn.Module, set_to_none: bool) -> tuple[int, int]:
    """(tracker, allocator meter) peaks of one step each, every step after ``zero_grad(set_to_none=...)``."""
    peaks = []
    for meter in (LiveTensorTracker(), CpuAllocatorMeter()):
        _zero_grad(model, set_to_none)
        with meter:
            step()
        peaks.append(meter.peak_bytes)
    return tuple(peaks)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_checkpoint_sequential_counts_the_gradients_a_step_allocates():
    model = _chain()
    reference = copy.deepcopy(model)
    x = torch.randn(32, 256)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan_sequential(model, "1KiB", x)
    low, kept_low = err.value.min_budget_bytes, err.value.min_budget_bytes_grads_kept
    assert kept_low is not None and kept_low + param_bytes // 2 < low, str(err.value)
    assert "set_to_none=False" in str(err.value)
    _zero_grad(reference, True)
    reference(x).sum().backward()
    expected = _grads(reference)

    for budget in (low, (low + param_bytes + 4 * low) // 2):
        sequential.plan_cache.clear()

        def step():
            hr.checkpoint_sequential(model, f"{budget}B", x).sum().backward()

        _zero_grad(model, True)
        step()  # plans with .grad None
        assert [torch.equal(a, b) for a, b in zip(_grads(model), expected)] == [True] * len(expected)
        for set_to_none in (True, False, True):
            tracker, allocator = _peaks(step, model, set_to_none)
            plan = list(sequential.plan_cache._plans.values())[-1].plan
            assert bool(plan.costs.step_grad_bytes) == set_to_none
            assert plan.predicted_peak_bytes <= budget
            assert allocator <= plan.predicted_peak_bytes + CALLERS_LOSS_BYTES, (set_to_none, allocator, plan.summary())
            assert tracker <= plan.predicted_peak_bytes + CALLERS_LOSS_BYTES
            if set_to_none:  # the gradients are in the peak: a plan that ignored them would not do
                assert allocator > kept_low + param_bytes // 2


def test_gradient_accumulation_runs_one_plan_per_case_within_the_budget(monkeypatch):
    """The first micro-batch allocates the gradients, the others add into them: two plans, solved once each."""
    calls = []
    real = chain_plan.plan_from_profile
    monkeypatch.setattr(chain_plan, "plan_from_profile", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(sequential, "plan_from_profile", chain_plan.plan_from_profile)
    sequential.plan_cache.clear()
    model = _chain(1, width=192, stages=5)
    reference = copy.deepcopy(model)
    xs = [torch.randn(16, 192, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan_sequential(model, "1KiB", xs[0], output_held=False)
    budget = err.value.min_budget_bytes
    calls.clear()
    given = f"{budget}B"
    for _ in range(2):  # two optimizer steps of three micro-batches
        _zero_grad(model, True)
        _zero_grad(reference, True)
        for x in xs:
            with CpuAllocatorMeter() as meter:
                hr.checkpoint_sequential(model, given, x, output_held=False).sum().backward()
            assert meter.peak_bytes <= budget
            reference(x).sum().backward()
        assert all(torch.equal(a, b) for a, b in zip(_grads(model), _grads(reference)))
    assert len(calls) == 2  # the first call's plan, then the plan for gradients kept


@pytest.mark.parametrize("at", ["keep_everything", "smallest"])
def test_whole_model_with_a_tied_head_stays_within_the_budget_with_default_zero_grad(at):
    """GPT-2 ties its embedding and LM head: their gradient is allocated at the head's backward and
    the embedding adds into it. A plan that keeps everything runs op by op then (one backward call
    would hold the head's whole weight gradient through the chain, unplanned)."""
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2, n_embd=64, vocab_size=4096)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 4096, (2, 32))
    kwargs = {"labels": ids, "use_cache": False}
    options = {"block_options": "autograd"} if at == "keep_everything" else {}  # autograd's own option: fastest
    if at == "keep_everything":
        budget = hr.plan(model, (ids,), kwargs, budget="64GiB", settings=hr.Settings(**options)).predicted_peak_bytes
    else:
        with pytest.raises(hr.InfeasibleBudgetError) as err:
            hr.plan(model, (ids,), kwargs, budget="1KiB")
        budget = err.value.min_budget_bytes
    module = hr.remat(model, (ids,), kwargs, budget=budget, settings=hr.Settings(**options))
    torch.manual_seed(1)
    _zero_grad(reference, True)
    reference(ids, **kwargs).loss.backward()
    expected = _grads(reference)
    torch.manual_seed(1)
    _zero_grad(model, True)
    module(ids, **kwargs).loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), expected))
    tracker, allocator = _peaks(lambda: module(ids, **kwargs).loss.backward(), model, True)
    plan = module.plans[-1]
    assert plan.chain.costs.step_grad_bytes
    assert plan.chain.schedule.keeps_everything == (at == "keep_everything")
    assert max(tracker, allocator) <= plan.predicted_peak_bytes <= budget, (tracker, allocator, plan.summary())
