"""One training step under the memory meters, and its results compared with another's."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import hierremat as hr
from hierremat.device import LiveTensorTracker
from hierremat.device.memory import CpuAllocatorMeter, memory_meter

from models import same_bits

#: A test's fp32 scalar loss and its seed gradient (4 B each): the caller's, beside a chain's predicted peak.
CALLERS_LOSS_BYTES = 8


@dataclass(frozen=True)
class Step:
    """What one forward and backward left: the loss, each parameter's gradient, each buffer
    (BatchNorm's running statistics), the input's gradient, the peaks in bytes above the step's start by
    the meters it ran under (None where it did not: ``train_step``'s ``meters``), and the model's output where
    it was held through the backward and is a tensor (detached; else None)."""

    loss: torch.Tensor
    grads: tuple[torch.Tensor | None, ...]
    buffers: tuple[torch.Tensor, ...]
    input_grad: torch.Tensor | None
    tracker_peak: int | None
    allocator_peak: int | None
    output: torch.Tensor | None = None
    device_peak: int | None = None  # the budget's meter on the inputs' device (CUDA's allocator statistics)

    @property
    def peak(self) -> int:
        """The largest peak any of its meters read, in bytes."""
        return max(p for p in (self.tracker_peak, self.allocator_peak, self.device_peak) if p is not None)


class Checkpointed(nn.Module):
    """``model`` run by hr.checkpoint_sequential at ``budget``."""

    def __init__(self, model: nn.Sequential, budget):
        super().__init__()
        self.model, self.budget = model, budget

    def forward(self, x):
        return hr.checkpoint_sequential(self.model, self.budget, x)


def with_grads(model: nn.Module) -> nn.Module:
    """``model`` with every ``.grad`` allocated (zeroed): planned from then on for steps that allocate none."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model


def mean_square(out) -> torch.Tensor:
    return out.float().pow(2).mean()


def model_loss(out) -> torch.Tensor:
    """The loss of a model's output: a tensor's mean square, a tuple's first element, else its ``.loss`` (Hugging
    Face's outputs)."""
    if isinstance(out, torch.Tensor):
        return mean_square(out)
    if isinstance(out, tuple):
        return out[0]
    return out.loss


def train_step(model: nn.Module, args: tuple, loss: Callable = mean_square, *, seed: int = 1,
               grads_allocated: bool = True, input_grad: bool = False, warmup: int = 0,
               kwargs: dict | None = None, hold_output: bool = False, meters: str = "cpu",
               autocast: torch.dtype | None = None, backward_under_autocast: bool = False) -> Step:
    """One step of ``model(*args, **kwargs)`` under the ``meters``, after ``warmup`` unmeasured ones (a
    RematModule plans its first shape at its first call, and times its stages in its first steps).

    grads_allocated: every ``.grad`` exists (zeroed) before the step, so the step's peak does not
    hold the parameter gradients; else they are None, as PyTorch's default ``zero_grad`` leaves them.
    input_grad: the first argument requires grad, and its gradient is returned.
    hold_output: the model's output is held through the backward (``out = model(...); loss(out).backward()``),
    else only the loss is.
    meters: "cpu", the live-tensor tracker and the CPU allocator meter; "tracker" or "allocator", one of them
    (Dynamo does not compile under the tracker's dispatch mode); "device", the budget's meter on the first
    tensor argument's device (hierremat.device.memory.memory_meter); "none", no meter.
    autocast: the forward runs under ``torch.autocast`` with this dtype (None: not at all); the backward runs
    under it too where ``backward_under_autocast``, else after the context closed.
    """
    if input_grad:
        args = (args[0].detach().requires_grad_(), *args[1:])
    kwargs = kwargs or {}
    forward = torch.autocast(_device_of(args, kwargs).type, dtype=autocast or torch.bfloat16,
                             enabled=autocast is not None)
    _reset_grads(model, grads_allocated)
    for _ in range(warmup):
        torch.manual_seed(seed)
        with forward:
            value = loss(model(*args, **kwargs))
        value.backward()
    _reset_grads(model, grads_allocated)
    if input_grad:
        args[0].grad = None
    torch.manual_seed(seed)
    if meters not in ("cpu", "tracker", "allocator", "device", "none"):
        raise ValueError(f"meters={meters!r}: one of 'cpu', 'tracker', 'allocator', 'device', 'none'")
    tracker = LiveTensorTracker() if meters in ("cpu", "tracker") else contextlib.nullcontext()
    allocator = CpuAllocatorMeter() if meters in ("cpu", "allocator") else contextlib.nullcontext()
    device = memory_meter(_device_of(args, kwargs)) if meters == "device" else contextlib.nullcontext()
    with allocator, tracker, device:
        if backward_under_autocast:
            with forward:
                out = model(*args, **kwargs)
                value = loss(out)
                out = out if hold_output else None
                value.backward()
        else:
            with forward:
                out = model(*args, **kwargs)
                value = loss(out)
            out = out if hold_output else None
            value.backward()
    return Step(
        value.detach(),
        tuple(None if p.grad is None else p.grad.clone() for p in model.parameters()),
        tuple(b.clone() for b in model.buffers()),
        args[0].grad if input_grad else None,
        getattr(tracker, "peak_bytes", None),
        getattr(allocator, "peak_bytes", None),
        out.detach() if isinstance(out, torch.Tensor) else None,
        getattr(device, "peak_bytes", None),
    )


def _reset_grads(model: nn.Module, allocated: bool) -> None:
    """Every trainable parameter's ``.grad`` zeroed where ``allocated``, else None."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p) if allocated else None


def _device_of(args: tuple, kwargs: dict) -> torch.device:
    """The device of the step's first tensor argument (CPU where it has none)."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return tensors[0].device if tensors else torch.device("cpu")


def assert_same_bits(step: Step, reference: Step) -> None:
    """Loss, gradients and buffers bitwise equal."""
    assert same_bits(step.loss, reference.loss), (step.loss, reference.loss)
    for j, (a, b) in enumerate(zip(step.grads, reference.grads, strict=True)):
        assert (a is None) == (b is None) and (a is None or same_bits(a, b)), f"gradient of parameter {j}"
    for j, (a, b) in enumerate(zip(step.buffers, reference.buffers, strict=True)):
        assert same_bits(a, b), f"buffer {j}"
    if reference.input_grad is not None:
        assert same_bits(step.input_grad, reference.input_grad), "input gradient"
