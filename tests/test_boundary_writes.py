"""Stages whose first operator writes over their input (torchvision's ``inplace=True`` activations
at a block boundary): planned and run bitwise like plain autograd (hierremat.blocks.boundary_writes)."""

import copy

import pytest
import torch
from torch import nn

import hierremat as hr
from hierremat.blocks.boundary_writes import functional_overload

from harness import assert_same_bits, train_step

ACTIVATIONS = {
    "relu": lambda: nn.ReLU(inplace=True),
    "relu6": lambda: nn.ReLU6(inplace=True),
    "silu": lambda: nn.SiLU(inplace=True),
    "hardswish": lambda: nn.Hardswish(inplace=True),
}


class ActFirst(nn.Module):
    """A block that starts by activating its input in place, as MobileNet's and VGG's do at a boundary."""

    def __init__(self, channels: int, act: str):
        super().__init__()
        self.act = ACTIVATIONS[act]()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x):
        x = self.act(x)
        return self.bn(self.conv(x)) + x  # the overwritten input is read again


class ShiftFirst(nn.Module):
    """A block that starts with ``x += shift`` (``aten.add_`` on its input)."""

    def __init__(self, channels: int):
        super().__init__()
        self.shift = nn.Parameter(torch.randn(channels, 1, 1))
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        x += self.shift
        return self.conv(torch.relu(x))  # (the convolution keeps its input, not its output)


def _stem(channels: int = 8) -> list[nn.Module]:
    return [nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)]


def _head(channels: int = 8) -> list[nn.Module]:
    return [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10)]


def vgg_like() -> nn.Sequential:
    """torchvision's VGG layout: convolutions, in-place ReLUs and pools as siblings of one Sequential."""
    layers = [nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True)]
    for _ in range(3):
        layers += [nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2, ceil_mode=True)]
    return nn.Sequential(*layers, *_head())


class SkipOverWrite(nn.Module):
    """A block's input overwritten in place by the block, and read again two blocks later (a UNet skip):
    the later reader sees the overwritten values, as in plain PyTorch."""

    def __init__(self, channels: int = 8):
        super().__init__()
        self.stem = nn.Sequential(*_stem(channels))
        self.blocks = nn.ModuleList(ActFirst(channels, "relu") for _ in range(3))
        self.head = nn.Sequential(*_head(channels))

    def forward(self, x):
        h0 = self.stem(x)
        h = self.blocks[0](h0)
        h = self.blocks[2](self.blocks[1](h))
        return self.head(h + h0)


def _models():
    torch.manual_seed(0)
    yield "vgg", vgg_like()
    for act in ACTIVATIONS:
        yield act, nn.Sequential(*_stem(), *(ActFirst(8, act) for _ in range(3)), *_head())
    yield "add_", nn.Sequential(*_stem(), *(ShiftFirst(8) for _ in range(3)), *_head())
    yield "skip", SkipOverWrite()


def _cross_entropy(out):
    return nn.functional.cross_entropy(out, torch.arange(out.shape[0]) % 10)


@pytest.mark.parametrize("name,model", list(_models()), ids=[name for name, _ in _models()])
def test_a_stage_that_overwrites_its_input_trains_bitwise_within_budget(name, model):
    model.train()
    x = torch.randn(2, 3, 16, 16)
    plain = train_step(copy.deepcopy(model), (x,), _cross_entropy, input_grad=True, warmup=2)
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan(model, (x,), budget="1KiB")
    floor = err.value.min_budget_bytes
    for budget in (floor, floor * 4 // 3, max(plain.tracker_peak, 2 * floor)):
        module = hr.remat(copy.deepcopy(model), (x,), budget=f"{budget}B")
        step = train_step(module, (x,), _cross_entropy, input_grad=True, warmup=2)
        assert_same_bits(step, plain)
        print('ALLOC', name, budget, step.tracker_peak, step.allocator_peak, plain.tracker_peak, plain.allocator_peak)
        assert step.tracker_peak <= budget, (name, budget, step.tracker_peak, module.plans[0].summary())


def test_functional_overloads_of_in_place_operators():
    aten = torch.ops.aten
    assert functional_overload(aten.relu_.default) is aten.relu.default
    assert functional_overload(aten.hardtanh_.default) is aten.hardtanh.default
    assert functional_overload(aten.add_.Tensor) is aten.add.Tensor
    assert functional_overload(aten.silu_.default) is aten.silu.default
    assert functional_overload(aten.relu.default) is None  # not in place
    assert functional_overload(aten.copy_.default) is aten.copy.default


def test_a_model_input_overwritten_by_the_first_stage_is_left_as_the_caller_passed_it():
    """The write into the model's own input is made out of place too: the caller's tensor is unchanged
    (plain PyTorch would have overwritten it), the gradients are plain's."""
    torch.manual_seed(0)
    model = nn.Sequential(*(ActFirst(3, "relu") for _ in range(3)), *_head(3))
    x = torch.randn(2, 3, 16, 16)
    plain = train_step(copy.deepcopy(model), (x.clone(),), _cross_entropy, warmup=2)
    module = hr.remat(model, (x,), budget="64MiB")
    before = x.clone()
    step = train_step(module, (x,), _cross_entropy, warmup=2)
    assert torch.equal(x, before)
    assert_same_bits(step, plain)
