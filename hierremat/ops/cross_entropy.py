"""Cross-entropy whose backward never materialises the gradient of the log-probabilities.

``aten.cross_entropy_loss`` runs as ``_log_softmax`` then ``nll_loss_forward``. Its
autograd backward first builds ``nll_loss_backward``'s gradient of the log-probabilities
(a dense ``[N, C]`` tensor that is zero except at the targets), then
``_log_softmax_backward_data`` reads it with the saved log-probabilities and writes the
logits' gradient: three ``[N, C]`` tensors alive at once. For a language-model head that
is the largest moment of the whole step (GPT-2, batch 2, seq 512, vocabulary 50257, fp32:
3 x 196 MiB).

This variant runs the same two forward kernels and, in the backward, the same two backward
kernels on blocks of rows, writing each block of the logits' gradient into its place: the
per-row kernels see the same rows with the same values, so the gradient is bitwise the one
autograd computes, while only one block of the intermediate gradient exists at a time
(two ``[N, C]`` tensors plus one buffer of a sixteenth of the elements, shared by the blocks: about
a third less at that moment). It runs the same kernels; on a 2-core CPU the blocked backward was faster than
the whole one, measured when blocks were at most 8 MiB and stayed in cache (they are a sixteenth of the rows
now: see block_elements).
The forward is unchanged: the logits and the log-probabilities exist together there.
(Going below two ``[N, C]`` tensors means recomputing the logits block by block, as Cut Cross-Entropy does, Wijmans
et al. 2024, which changes the summation order of the head's weight gradient.)
"""

from __future__ import annotations

import torch

_BLOCKS = 16  # one block of rows of the intermediate gradient is a sixteenth of the rows


@torch.library.custom_op("hierremat::row_blocked_cross_entropy", mutates_args=())
def _row_blocked_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, reduction: int, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``cross_entropy(logits, target, reduction=..., ignore_index=...)`` on ``[N, C]`` logits.

    Returns (loss, log-probabilities, total weight): the last two are what the backward
    reads (autograd saves them; callers use the loss only).
    """
    log_probs = torch.ops.aten._log_softmax(logits, 1, False)
    loss, total_weight = torch.ops.aten.nll_loss_forward(log_probs, target, None, reduction, ignore_index)
    return loss, log_probs, total_weight


@_row_blocked_cross_entropy.register_fake
def _(logits, target, reduction, ignore_index):
    rows = logits.shape[0]
    loss = logits.new_empty((rows,) if reduction == 0 else ())
    return loss, torch.empty_like(logits), logits.new_empty(())


def _setup_context(ctx, inputs, output) -> None:
    _, target, reduction, ignore_index = inputs
    _, log_probs, total_weight = output
    ctx.save_for_backward(log_probs, target, total_weight)
    ctx.reduction, ctx.ignore_index = reduction, ignore_index
    ctx.set_materialize_grads(False)  # no [N, C] zeros for the log-probabilities nobody differentiates


def _backward(ctx, grad_loss, _grad_log_probs, _grad_total_weight):
    """The logits' gradient, one block of rows at a time (torch's own two backward kernels)."""
    log_probs, target, total_weight = ctx.saved_tensors
    grad_logits = torch.empty_like(log_probs)
    rows, classes = log_probs.shape
    buffer = torch.empty(block_elements(rows, classes), dtype=log_probs.dtype, device=log_probs.device)
    step = max(1, buffer.numel() // max(1, classes))
    per_row = grad_loss.dim() > 0  # reduction "none": one gradient per row
    for start in range(0, rows, step):
        block = slice(start, min(rows, start + step))
        grad_log_probs = buffer[: (block.stop - start) * classes].view(-1, classes)
        torch.ops.aten.nll_loss_backward.grad_input(  # (zeroes it first, as the functional form's zeros)
            grad_loss[block] if per_row else grad_loss,
            log_probs[block],
            target[block],
            None,
            ctx.reduction,
            ctx.ignore_index,
            total_weight,
            grad_input=grad_log_probs,
        )
        torch.ops.aten._log_softmax_backward_data.out(
            grad_log_probs, log_probs[block], 1, log_probs.dtype, out=grad_logits[block]
        )
    return grad_logits, None, None, None


def block_elements(rows: int, classes: int) -> int:
    """Elements of the one buffer the backward's blocks of the intermediate gradient share: ``rows`` times a
    sixteenth of ``classes`` rounded up, at least one row (each block is as many whole rows as it holds; from 16
    rows on, about a sixteenth of the rows). Its bytes are a polynomial in the rows for every vocabulary, so a new
    length's memory is fitted exactly from lengths measured before (hierremat.planning.shape_fit).

    The buffer has no cap in bytes: a cap of 8 MiB would save memory only where the logits exceed 128 MiB (fp32),
    at most 3% of that moment (two ``[N, C]`` tensors and the buffer), and lengths on both sides of it would fit no
    memory (12-layer GPT-2 at batch 4, vocabulary 50257, crosses it at 167 tokens: each new length would measure
    its head)."""
    return max(classes, rows * -(-classes // _BLOCKS))


_row_blocked_cross_entropy.register_autograd(_backward, setup_context=_setup_context)


def row_blocked_cross_entropy(logits: torch.Tensor, target: torch.Tensor, reduction: int = 1, ignore_index: int = -100) -> torch.Tensor:
    """``aten.cross_entropy_loss`` (no class weights, no label smoothing) with the row-blocked backward."""
    return torch.ops.hierremat.row_blocked_cross_entropy(logits, target, reduction, ignore_index)[0]
