"""A stage's output gradient handed to autograd as its only reference (hierremat.runtime.grad_taps.GradRelay): freed
once the node that reads it has run, so a stage whose first backward node makes a gradient of its own (ReLU,
BatchNorm) peaks one output gradient lower; the chain's last stage, whose gradients the caller holds, is measured
as it runs."""

import pytest
import torch
from torch import nn

import hierremat as hr
from hierremat.device import LiveTensorTracker
from hierremat.runtime.grad_taps import GradRelay
from hierremat.runtime.profile import profile_chain

from harness import CALLERS_LOSS_BYTES, train_step, with_grads


def _stem(channels: int = 8) -> nn.Module:
    """A torchvision-like stem: convolution, BatchNorm, in-place ReLU."""
    return nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
                         nn.ReLU(inplace=True))


def _backward_peak(stem: nn.Module, x: torch.Tensor, hand_over: bool) -> tuple[int, int, tuple]:
    """(the peak above the backward's start, the output gradient's bytes, the parameters' gradients)."""
    for p in stem.parameters():
        p.grad = torch.zeros_like(p)
    with LiveTensorTracker() as tracker:
        y = stem(x)
        grad = torch.ones_like(y)
        nbytes = grad.untyped_storage().nbytes()
        start = tracker.live_bytes
        tracker.reset_peak()
        if hand_over:
            relay = GradRelay(y)
            relay.grads.append(grad)
            del grad
            relay.backward()
        else:
            torch.autograd.backward(y, grad)
        peak = tracker.peak_bytes - start
    return peak, nbytes, tuple(p.grad.clone() for p in stem.parameters())


def test_a_handed_over_gradient_is_freed_once_read():
    torch.manual_seed(0)
    stem, x = _stem(), torch.randn(4, 8, 32, 32)
    held, nbytes, held_grads = _backward_peak(stem, x, hand_over=False)
    handed, _, handed_grads = _backward_peak(stem, x, hand_over=True)
    assert held - handed == nbytes  # ReLU's gradient is made while the output's is alive; BatchNorm's after it is gone
    assert all(torch.equal(a, b) for a, b in zip(held_grads, handed_grads))


def test_a_relay_passes_no_gradient_where_none_arrives():
    a = torch.randn(3, requires_grad=True)
    relay = GradRelay((a * 2, a * 3))
    relay.grads.append(torch.ones(3))  # the second output gets none
    relay.backward()
    assert torch.equal(a.grad, torch.full((3,), 2.0))
    assert relay.grads == [] and relay.root is None


def test_the_last_of_identical_stages_is_measured_with_its_gradient_held():
    torch.manual_seed(0)
    stages = [_stem() for _ in range(3)]
    x = torch.randn(4, 8, 32, 32, requires_grad=True)
    profile = profile_chain(stages, x, signatures=["stem"] * 3, repeats=1, timed=False)
    first, middle, last = (s.options[0].bwd_overhead_bytes for s in profile.costs.stages)
    grad_bytes = x.untyped_storage().nbytes()
    assert first == middle
    assert last - middle == grad_bytes


class _Checkpointed(nn.Module):
    def __init__(self, chain: nn.Sequential, budget: int):
        super().__init__()
        self.chain, self.budget = chain, budget

    def forward(self, x):
        return hr.checkpoint_sequential(self.chain, self.budget, x)


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_a_chain_of_stems_trains_bitwise_within_budget_at_its_floor_and_above(fraction):
    torch.manual_seed(0)
    model = with_grads(nn.Sequential(*[_stem() for _ in range(5)]))
    x = torch.randn(4, 8, 32, 32, requires_grad=True)
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan_sequential(model, "1KiB", x)
    plain = train_step(model, (x,), input_grad=True)
    floor = err.value.min_budget_bytes
    budget = int(floor + fraction * (plain.tracker_peak - floor))
    step = train_step(_Checkpointed(model, budget), (x,), input_grad=True, warmup=1)
    assert max(step.tracker_peak, step.allocator_peak) <= budget + CALLERS_LOSS_BYTES
    assert all(torch.equal(a, b) for a, b in zip(plain.grads, step.grads))
    assert torch.equal(plain.input_grad, step.input_grad)
