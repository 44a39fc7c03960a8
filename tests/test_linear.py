"""The linear layer whose backward adds its weight gradient into ``.grad`` (hierremat.ops.linear,
hierremat.blocks.variants.linear): autograd's gradients bitwise, no weight-sized tensor made."""

import copy
import itertools

import pytest
import torch
from torch import nn

import hierremat as hr
from hierremat.device import LiveTensorTracker
from hierremat.blocks.capture import capture
from hierremat.ops.linear import linear

from harness import assert_same_bits, train_step, with_grads
from models import same_bits


def _grads(fn, x, weight, bias, grad_init):
    x = x.detach().clone().requires_grad_()
    weight.grad = None if grad_init is None else grad_init.clone()
    if bias is not None:
        bias.grad = None
    fn(x, weight, bias).pow(2).sum().backward()
    return x.grad, weight.grad, None if bias is None else bias.grad


@pytest.mark.parametrize("shape,bias,grad_init,contiguous", list(itertools.product(
    [(8, 300), (2, 5, 300), (3, 4, 2, 300)], [True, False], ["none", "zero", "rand"], [True, False])))
def test_gradients_are_autograds_bitwise(shape, bias, grad_init, contiguous):
    torch.manual_seed(0)
    x = torch.randn(*shape) if contiguous else torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2]
    weight = nn.Parameter(torch.randn(2000, shape[-1]))
    b = nn.Parameter(torch.randn(2000)) if bias else None
    init = {"none": None, "zero": torch.zeros_like(weight), "rand": torch.randn_like(weight)}[grad_init]
    expected = _grads(nn.functional.linear, x, weight, b, init)
    found = _grads(linear, x, weight, b, init)
    for e, f in zip(expected, found):
        assert (e is None) == (f is None) and (e is None or same_bits(e, f))


def test_the_backward_makes_no_tensor_of_the_weights_size():
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(1024, 4096))  # 16 MiB
    weight.grad = torch.zeros_like(weight)
    x = torch.randn(2, 4096, requires_grad=True)
    for fn, most in ((nn.functional.linear, None), (linear, weight.numel() * 4 // 8)):
        y = fn(x, weight, None)
        with LiveTensorTracker() as tracker:
            y.sum().backward()
        if most is None:
            assert tracker.peak_bytes >= weight.numel() * 4  # autograd's whole product
        else:
            assert tracker.peak_bytes <= most, tracker.peak_bytes


class _Classifier(nn.Module):
    """VGG's layout in small: convolutions, then a fully connected layer whose weight dwarfs the batch."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                                      nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(inplace=True))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(16 * 16 * 16, 1024), nn.ReLU(inplace=True),
                                        nn.Linear(1024, 10))

    def forward(self, x):
        return self.classifier(self.features(x))


def _linear_targets(model, x) -> list:
    return [n.target for n in capture(model, (x,)).module.graph.nodes if n.op == "call_function"
            and getattr(n.target, "__name__", "") == "linear"]


def test_only_weights_that_dwarf_their_activations_are_replaced():
    model, x = _Classifier(), torch.randn(2, 3, 32, 32)
    targets = _linear_targets(model, x)
    assert targets == [linear]  # the [1024, 4096] weight (16 MiB); the [10, 1024] one keeps aten.linear
    assert _linear_targets(model, torch.randn(128, 3, 32, 32)) == []  # a batch of 8 MiB of inputs to it


def test_a_classifier_with_a_large_weight_trains_bitwise_with_a_lower_floor():
    torch.manual_seed(0)
    model, x = with_grads(_Classifier().train()), torch.randn(2, 3, 32, 32)

    def floor(**settings) -> int:
        with pytest.raises(hr.InfeasibleBudgetError) as err:
            hr.plan(model, (x,), budget="1KiB", settings=hr.Settings(**settings))
        return err.value.min_budget_bytes

    lean, whole = floor(), floor(variants=False)
    assert lean <= whole - 16 * 2**20 * 3 // 4, (lean, whole)
    plain = train_step(copy.deepcopy(model), (x,), warmup=2, input_grad=True)
    module = hr.remat(with_grads(copy.deepcopy(model)), (x,), budget=f"{lean}B")
    step = train_step(module, (x,), warmup=2, input_grad=True)
    assert_same_bits(step, plain)
    assert step.tracker_peak <= lean and step.allocator_peak <= lean, (step, lean)
