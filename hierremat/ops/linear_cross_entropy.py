"""A language-model head fused with its cross-entropy, chunked over tokens: the logits never exist whole.

A head computes logits = h @ W^T (+ b), ``[tokens, vocabulary]``, and the cross-entropy of
them against the next tokens. Materialized, the logits, their log-probabilities and their
gradient are the largest tensors of a whole training step (GPT-2, batch 2, seq 512,
vocabulary 50257, fp32: 196 MiB each). As in Liger Kernel's fused linear cross-entropy (Hsu
et al. 2024) and Cut Cross-Entropy (Wijmans et al. 2024), :func:`linear_cross_entropy`
never materializes them:

* forward: per chunk of rows, the chunk's logits (in h's dtype, upcast to fp32 when the
  model upcasts them), their log-sum-exp and the target's logit; it keeps the per-row
  log-sum-exp (``[tokens]``, fp32) and returns the loss;
* backward: per chunk, the chunk's logits again, the softmax minus the one-hot target
  (in place), scaled by the loss gradient, then the chunk's rows of dh and its share of dW
  (and db), accumulated chunk by chunk; an fp32 weight's share goes straight into its
  ``.grad`` where autograd's result would be the same (hierremat.ops.grad_in_place),
  so no ``[vocabulary, width]`` tensor exists either.

On CUDA the per-chunk row passes (log-sum-exp and loss; softmax minus one-hot, scaled and cast)
are Triton kernels of one pass each (hierremat.ops.triton_kernels); the matmuls are
cuBLAS's either way.

It is a time-for-memory trade-off: the head's matmul runs once more (a third more of the
head's FLOPs). So it is not applied unconditionally: the model's last stage offers it as
an option beside the materialized head (hierremat.planning.output_stage), and the chain DP picks
by budget. Only the summation order differs from plain autograd (dW over row chunks, added
into ``.grad`` chunk by chunk or summed first; the mean over rows): equal to fp32 rounding,
tested at rtol 1e-4, atol 1e-5 (fp32).

hierremat.graphs.variants.linear_cross_entropy puts it into a stage graph where a ``linear``
feeds such a cross-entropy and nothing else reads the logits.
"""

from __future__ import annotations

import logging

import torch

from ..device.memory import track_hidden
from .grad_in_place import added_gradient, grad_to_add_into
from .packed_bits import cuda_kernels

log = logging.getLogger(__name__)

#: One chunk of logits is at most this many bytes (fp32) ...
CHUNK_BYTES = 8 << 20
#: ... and at least this many rows (a matmul of fewer rows wastes the weight's reads).
MIN_CHUNK_ROWS = 16


def chunk_rows(rows: int, vocabulary: int) -> int:
    """Rows per chunk for ``rows`` tokens and a ``vocabulary``-wide head."""
    return max(1, min(rows, max(MIN_CHUNK_ROWS, CHUNK_BYTES // max(1, 4 * vocabulary))))


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The chunk's logits in fp32, counted by the live-tensor tracker also where it cannot see
    them (inside the op's forward: hierremat.device.memory.track_hidden)."""
    logits = h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())
    track_hidden(logits)
    logits = logits.float()
    track_hidden(logits)
    return logits


def _logsumexp_(logits: torch.Tensor, out: torch.Tensor) -> None:
    """``torch.logsumexp(logits, 1, out=out)``, ATen's operations in ATen's order, but with
    ``(logits - max).exp()`` formed over the logits themselves rather than in a second chunk."""
    maxes = logits.amax(1)
    maxes.masked_fill_(maxes.abs() == float("inf"), 0.0)
    torch.sum(logits.sub_(maxes.unsqueeze(1)).exp_(), 1, out=out)
    out.log_().add_(maxes)


def _valid(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return target != ignore_index


def _row_kernels(h: torch.Tensor):
    """hierremat.ops.triton_kernels where h is a CUDA tensor Triton can take, else None
    (the chunks' row passes then run as torch ops)."""
    if not h.is_cuda:
        return None
    kernels = cuda_kernels()
    return kernels if kernels is not None and kernels.supports(h) else None


@torch.library.custom_op("hierremat::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor, reduction: int,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, per-row log-sum-exp in fp32): cross_entropy(h @ weight.T + bias, target) with
    ``reduction`` 0 (none), 1 (mean over non-ignored rows) or 2 (sum)."""
    rows, vocabulary = h.shape[0], weight.shape[0]
    step = chunk_rows(rows, vocabulary)
    lse = torch.empty(rows, dtype=torch.float32, device=h.device)
    per_row = torch.empty(rows, dtype=torch.float32, device=h.device)
    track_hidden(lse)
    track_hidden(per_row)
    kernels = _row_kernels(h)
    with torch.autocast(h.device.type, enabled=False):
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            logits = _chunk_logits(h[start:stop], weight, bias)
            t = target[start:stop]
            if kernels is not None:  # one pass: log-sum-exp and loss per row
                kernels.cross_entropy_rows(logits, t.contiguous(), ignore_index, lse[start:stop], per_row[start:stop])
            else:
                valid = _valid(t, ignore_index)
                picked = logits.gather(1, torch.where(valid, t, 0).unsqueeze(1)).squeeze(1)
                _logsumexp_(logits, out=lse[start:stop])  # (over the logits: picked first)
                per_row[start:stop] = torch.where(valid, lse[start:stop] - picked, 0.0)
            del logits
    if reduction == 0:
        return per_row, lse
    total = per_row.sum()
    if reduction == 1:
        total = total / _valid(target, ignore_index).sum()
    return total, lse


@_linear_cross_entropy.register_fake
def _(h, weight, bias, target, reduction, ignore_index):
    rows = h.shape[0]
    loss = h.new_empty((rows,) if reduction == 0 else (), dtype=torch.float32)
    return loss, h.new_empty((rows,), dtype=torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    h, weight, bias, target, reduction, ignore_index = inputs
    _, lse = output
    ctx.save_for_backward(h, weight, bias, target, lse)
    ctx.reduction, ctx.ignore_index = reduction, ignore_index
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_loss, _grad_lse):
    h, weight, bias, target, lse = ctx.saved_tensors
    if grad_loss is None:
        return None, None, None, None, None, None
    rows, vocabulary = h.shape[0], weight.shape[0]
    step = chunk_rows(rows, vocabulary)
    valid = _valid(target, ctx.ignore_index)
    if ctx.reduction == 0:
        scale = grad_loss.float()
    else:
        scale = grad_loss.float().expand(rows)
        if ctx.reduction == 1:
            scale = scale / valid.sum()
    scale = torch.where(valid, scale, 0.0)
    need_h, need_weight, need_bias = ctx.needs_input_grad[:3]
    grad_h = torch.empty_like(h) if need_h else None
    # dW and db accumulate in fp32 over the chunks and are rounded once, as one matmul would;
    # an fp32 weight's chunks go straight into its .grad where they may (no [vocabulary, width] tensor)
    into = grad_to_add_into(weight) if need_weight and weight.dtype == torch.float32 else None
    if into is not None:
        grad_weight = into
    else:
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_weight else None
    grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=h.device) if need_bias and bias is not None else None
    kernels = _row_kernels(h)
    with torch.autocast(h.device.type, enabled=False):
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            h_chunk = h[start:stop]
            grad = _chunk_logits(h_chunk, weight, bias)  # the chunk's logits, then their gradient in place
            t = target[start:stop]
            if kernels is not None:  # one pass, written in h's dtype (over the logits in fp32)
                out = grad if h.dtype == torch.float32 else torch.empty(grad.shape, dtype=h.dtype, device=h.device)
                grad = kernels.cross_entropy_grad(grad, lse[start:stop], t.contiguous(), scale[start:stop].contiguous(), out)
            else:
                grad.sub_(lse[start:stop].unsqueeze(1)).exp_()
                grad[torch.arange(stop - start, device=h.device), torch.where(valid[start:stop], t, 0)] -= 1.0
                grad.mul_(scale[start:stop].unsqueeze(1))
                grad = grad.to(h.dtype)
            if grad_h is not None:
                torch.mm(grad, weight, out=grad_h[start:stop])
            if grad_weight is not None:
                grad_weight.addmm_(grad.t().float(), h_chunk.float())  # (no-op casts in fp32)
            if grad_bias is not None:
                grad_bias += grad.sum(0, dtype=torch.float32)
            del grad
    if into is not None:
        grad_weight = added_gradient(weight)
    elif grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return grad_h, grad_weight, grad_bias, None, None, None


_linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)


def linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor, reduction: int = 1,
    ignore_index: int = -100,
) -> torch.Tensor:
    """``cross_entropy((h @ weight.T + bias).float(), target, reduction=..., ignore_index=...)`` on
    ``[N, D]`` hidden states, chunked over rows (see the module docstring)."""
    return torch.ops.hierremat.linear_cross_entropy(h, weight, bias, target, reduction, ignore_index)[0]
