"""One training step under the memory meters, and its results compared with another's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hierremat.device import LiveTensorTracker
from hierremat.device.memory import CpuAllocatorMeter

from models import same_bits

#: A test's fp32 scalar loss and its seed gradient (4 B each): the caller's, beside a chain's predicted peak.
CALLERS_LOSS_BYTES = 8


@dataclass(frozen=True)
class Step:
    """What one forward and backward left: the loss, each parameter's gradient, each buffer
    (BatchNorm's running statistics), the input's gradient, and the peaks in bytes above the
    step's start by the live-tensor tracker and by the CPU allocator, and the model's output where it was held
    through the backward and is a tensor (detached; else None)."""

    loss: torch.Tensor
    grads: tuple[torch.Tensor | None, ...]
    buffers: tuple[torch.Tensor, ...]
    input_grad: torch.Tensor | None
    tracker_peak: int
    allocator_peak: int
    output: torch.Tensor | None = None


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
               kwargs: dict | None = None, hold_output: bool = False) -> Step:
    """One step of ``model(*args, **kwargs)`` under both meters, after ``warmup`` unmeasured ones (a
    RematModule plans its first shape at its first call, and times its stages in its first steps).

    grads_allocated: every ``.grad`` exists (zeroed) before the step, so the step's peak does not
    hold the parameter gradients; else they are None, as PyTorch's default ``zero_grad`` leaves them.
    input_grad: the first argument requires grad, and its gradient is returned.
    hold_output: the model's output is held through the backward (``out = model(...); loss(out).backward()``),
    else only the loss is.
    """
    if input_grad:
        args = (args[0].detach().requires_grad_(), *args[1:])
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if grads_allocated else None
    kwargs = kwargs or {}
    for _ in range(warmup):
        torch.manual_seed(seed)
        loss(model(*args, **kwargs)).backward()
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if grads_allocated else None
    if input_grad:
        args[0].grad = None
    torch.manual_seed(seed)
    with CpuAllocatorMeter() as allocator, LiveTensorTracker() as tracker:
        out = model(*args, **kwargs)
        value = loss(out)
        if not hold_output:
            del out
        value.backward()
    output = out.detach() if hold_output and isinstance(out, torch.Tensor) else None
    return Step(
        value.detach(),
        tuple(None if p.grad is None else p.grad.clone() for p in model.parameters()),
        tuple(b.clone() for b in model.buffers()),
        args[0].grad if input_grad else None,
        tracker.peak_bytes,
        allocator.peak_bytes,
        output,
    )


def assert_same_bits(step: Step, reference: Step) -> None:
    """Loss, gradients and buffers bitwise equal."""
    assert same_bits(step.loss, reference.loss), (step.loss, reference.loss)
    for j, (a, b) in enumerate(zip(step.grads, reference.grads, strict=True)):
        assert (a is None) == (b is None) and (a is None or same_bits(a, b)), f"gradient of parameter {j}"
    for j, (a, b) in enumerate(zip(step.buffers, reference.buffers, strict=True)):
        assert same_bits(a, b), f"buffer {j}"
    if reference.input_grad is not None:
        assert same_bits(step.input_grad, reference.input_grad), "input gradient"
