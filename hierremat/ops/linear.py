"""A linear layer whose backward adds its weight gradient into ``.grad`` as the product is made.

Autograd computes ``aten.linear``'s weight gradient whole, ``grad_out.T @ x`` as one
``[out_features, in_features]`` tensor, which ``AccumulateGrad`` then adds into ``.grad``. For a
weight far larger than the batch's activations that tensor is the largest of its backward:
VGG-16's first fully connected layer, ``[4096, 25088]``, makes 392 MiB of it for a batch whose
input to it holds 98 KiB a sample. This variant has the matrix product add into ``.grad`` itself,
``.grad.addmm_(grad_out.T, x)`` (MONeT's operator variants: Shah et al., "Memory optimization for
deep networks", ICLR 2021): no tensor of the weight's size is made. With ``.grad`` zeroed (the
budget's convention: ``zero_grad(set_to_none=False)``) the kernel's sums are those of the product
alone, bitwise; into a nonzero ``.grad`` (gradient accumulation) the kernel adds its partial sums
over the batch's rows as it goes, which rounds as ``.grad + product`` does where those rows are
few (one block of the kernel's), and otherwise within fp32 rounding of it. The capture uses the
variant only for such weights (hierremat.blocks.variants.linear), on the CPU.

The other gradients are autograd's own formulas for the call ``aten.linear`` makes on an input
of two dimensions or more that is contiguous (``addmm`` on the input folded to two dimensions, or
``mm`` without a bias): the input's ``grad_out @ weight``, the bias's ``grad_out`` summed to its
shape. An input that is not contiguous, where ``aten.linear`` takes another path, gets its
gradients from autograd itself, by running the call again.

Where the gradient cannot go into ``.grad`` directly (hierremat.ops.grad_in_place: no ``.grad``
yet, tensor hooks, create_graph, tracing), the backward returns the whole product, as autograd
does. Under autocast, and off the CPU, the wrapper :func:`linear` calls ``aten.linear`` itself.
"""

from __future__ import annotations

import torch

from .grad_in_place import added_gradient, grad_to_add_into

@torch.library.custom_op("hierremat::linear", mutates_args=())
def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``aten.linear(x, weight, bias)``."""
    return torch.ops.aten.linear(x, weight, bias)


@_linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias = inputs
    ctx.folds = x.is_contiguous()
    # what aten.linear's backward saves: the input for the weight's gradient, the weight for the input's
    # (and both, with the bias, where the call is run again)
    ctx.save_for_backward(x, weight, bias if not ctx.folds else None)
    ctx.weight = weight if weight.is_leaf and weight.requires_grad else None
    ctx.bias_shape = None if bias is None else bias.shape


def _backward(ctx, grad):
    x, weight, bias = ctx.saved_tensors
    leaf, ctx.weight = ctx.weight, None
    needs_x, needs_weight, needs_bias = ctx.needs_input_grad
    if not ctx.folds:
        return _backward_by_autograd(x, weight, bias, grad, ctx.needs_input_grad)
    grad2d = grad.reshape(-1, grad.shape[-1])
    x2d = x.reshape(-1, x.shape[-1])
    grad_x = grad2d.mm(weight).view(x.shape) if needs_x else None
    grad_bias = grad2d.sum_to_size(ctx.bias_shape) if needs_bias and ctx.bias_shape is not None else None
    grad_weight = None
    if needs_weight:
        target = grad_to_add_into(leaf)
        if target is None:
            grad_weight = grad2d.t().mm(x2d)
        else:
            target.addmm_(grad2d.t(), x2d)
            grad_weight = added_gradient(leaf)
    return grad_x, grad_weight, grad_bias


def _backward_by_autograd(x, weight, bias, grad, needs):
    inputs = [t.detach().requires_grad_(need) if t is not None else None for t, need in zip((x, weight, bias), needs)]
    wanted = [t for t, need in zip(inputs, needs) if need and t is not None]
    with torch.enable_grad():
        y = torch.ops.aten.linear(*inputs)
    found = iter(torch.autograd.grad(y, wanted, grad))
    return tuple(next(found) if need and t is not None else None for t, need in zip(inputs, needs))


_linear.register_autograd(_backward, setup_context=_setup_context)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``aten.linear`` whose backward adds the weight's gradient into ``weight.grad`` (module docstring);
    under autocast or off the CPU, ``aten.linear`` itself."""
    if x.device.type != "cpu" or torch.is_autocast_enabled("cpu"):
        return torch.ops.aten.linear(x, weight, bias)
    return torch.ops.hierremat.linear(x, weight, bias)
