"""A language-model head fused with its cross-entropy, in tiles of logits: the logits never exist whole.

A head computes logits = h @ W^T (+ b), ``[tokens, vocabulary]``, and the cross-entropy of
them against the next tokens. Materialized, the logits, their log-probabilities and their
gradient are the largest tensors of a whole training step (GPT-2, batch 2, seq 512,
vocabulary 50257, fp32: 196 MiB each). As in Liger Kernel's fused linear cross-entropy (Hsu
et al. 2024) and Cut Cross-Entropy (Wijmans et al. 2024), :func:`linear_cross_entropy`
never materializes them. It works in tiles of at most TILE_BYTES of fp32 logits, a block of
rows by a range of vocabulary columns (Cut Cross-Entropy's blocking), so that each block of
rows, as many as a tile of MIN_TILE_COLUMNS columns holds, reads the weight once per pass:

* forward: per tile, its logits (in h's dtype, upcast to fp32 when the model upcasts them),
  each row's running log-sum-exp over the column tiles (online softmax normalization,
  Milakov and Gimelshein 2018) and the target's logit; it keeps the per-row log-sum-exp
  (``[tokens]``, fp32) and returns the loss;
* backward: per tile, its logits again, the softmax minus the one-hot target (in place),
  scaled by the loss gradient, then its share of dh (over the column tiles, in fp32) and
  its columns' share of dW (and db); an fp32 weight's share goes straight into its
  ``.grad`` where autograd's result would be the same (hierremat.ops.grad_in_place),
  so no ``[vocabulary, width]`` tensor exists either.

On CUDA where Triton runs, the chunks are whole rows instead (at most CHUNK_BYTES each), so that each
chunk's row passes (log-sum-exp and loss; softmax minus one-hot, scaled and cast) are Triton kernels of
one pass each (hierremat.ops.triton_kernels); the matmuls are cuBLAS's either way.

It is a time-for-memory trade-off: the head's matmul runs once more (a third more of the
head's FLOPs), against the passes over materialized logits it saves. On 2 CPU cores (GPT-2's
head, 1024 tokens, fp32) it takes 1.0-1.3x autograd's time in tiles, where chunks of whole
rows (41 rows, each reading the whole weight) took 2.9-3.1x. It is not applied
unconditionally: the model's last stage offers it as an option beside the materialized head
(hierremat.planning.output_stage), and the chain DP picks by budget. Only the summation order
differs from plain autograd (the log-sum-exp over column tiles, dh over column tiles and dW
over row blocks, added into ``.grad`` tile by tile or summed first; the mean over rows): equal
to fp32 rounding, tested at rtol 1e-4, atol 1e-5 (fp32).

hierremat.blocks.variants.linear_cross_entropy puts it into a stage graph where a ``linear``
feeds such a cross-entropy and nothing else reads the logits.
"""

from __future__ import annotations

import logging

import torch

from ..device.memory import track_hidden
from .grad_in_place import added_gradient, grad_to_add_into
from .packed_bits import cuda_kernels

log = logging.getLogger(__name__)

#: One tile of logits is at most this many bytes (fp32) ...
TILE_BYTES = 4 << 20
#: ... and at least this many vocabulary columns wide, so that it spans as many rows as it can: each block of rows
#: reads the whole weight once per pass, so a tile of few rows spends its time reading the weight. GPT-2's head
#: (1024 tokens, 768 wide, 50257 columns, fp32; 2 CPU cores): chunks of 41 whole rows took 2.9-3.1x autograd's
#: time; tiles of 1024 rows by 1024-4096 columns (4-16 MiB) 1.0-1.3x.
MIN_TILE_COLUMNS = 1024
#: Where the row passes are Triton kernels (CUDA), a chunk of whole rows of logits is at most this many bytes
#: (fp32) ...
CHUNK_BYTES = 8 << 20
#: ... and at least this many rows (a matmul of fewer rows wastes the weight's reads).
MIN_CHUNK_ROWS = 16


def tile_shape(rows: int, vocabulary: int) -> tuple[int, int]:
    """(rows, vocabulary columns) of one tile of fp32 logits, for ``rows`` tokens and a ``vocabulary``-wide head:
    at most TILE_BYTES, at least MIN_TILE_COLUMNS wide, as many rows as those allow."""
    columns = max(1, min(vocabulary, MIN_TILE_COLUMNS))
    tile_rows = max(1, min(rows, TILE_BYTES // (4 * columns)))
    return tile_rows, max(columns, min(vocabulary, TILE_BYTES // (4 * tile_rows)))


def chunk_rows(rows: int, vocabulary: int) -> int:
    """Whole rows per chunk for the Triton row passes, for ``rows`` tokens and a ``vocabulary``-wide head."""
    return max(1, min(rows, max(MIN_CHUNK_ROWS, CHUNK_BYTES // max(1, 4 * vocabulary))))


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The logits of rows ``h`` and vocabulary rows ``weight`` in fp32, counted by the live-tensor tracker
    also where it cannot see them (inside the op's forward: hierremat.device.memory.track_hidden)."""
    logits = h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())
    track_hidden(logits)
    logits = logits.float()
    track_hidden(logits)
    return logits


def _tiles(rows: int, vocabulary: int):
    """(row slice, column slice) of each tile, column tiles of one block of rows after another."""
    tile_rows, columns = tile_shape(rows, vocabulary)
    for r0 in range(0, rows, tile_rows):
        for v0 in range(0, vocabulary, columns):
            yield slice(r0, min(rows, r0 + tile_rows)), slice(v0, min(vocabulary, v0 + columns))


def _target_in(t: torch.Tensor, columns: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether each row's target is one of ``columns``, its column in them where it is, else 0)."""
    inside = (t >= columns.start) & (t < columns.stop)
    return inside, torch.where(inside, t - columns.start, 0)


def _valid(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return target != ignore_index


def _row_kernels(h: torch.Tensor):
    """hierremat.ops.triton_kernels where h is a CUDA tensor Triton can take (the op then works in chunks of
    whole rows), else None (in tiles, as torch ops)."""
    if not h.is_cuda:
        return None
    kernels = cuda_kernels()
    return kernels if kernels is not None and kernels.supports(h) else None


def _forward_in_tiles(h, weight, bias, target, ignore_index, lse, per_row) -> None:
    """Each row's log-sum-exp over its column tiles and its loss, into ``lse`` and ``per_row``.

    The log-sum-exp is taken online (Milakov and Gimelshein 2018, "Online normalizer calculation for
    softmax"): a running maximum, and the sum of the exponentials shifted by it, rescaled by
    ``exp(old maximum - new shift)`` when it grows. An infinite maximum shifts by 0, as ``torch.logsumexp``
    does; a maximum still -inf rescales a sum of 0 to 0."""
    rows, vocabulary = h.shape[0], weight.shape[0]
    tile_rows, _ = tile_shape(rows, vocabulary)
    maximum = torch.empty(tile_rows, dtype=torch.float32, device=h.device)
    total, picked = torch.empty_like(maximum), torch.empty_like(maximum)
    for block, columns in _tiles(rows, vocabulary):
        n = block.stop - block.start
        if columns.start == 0:  # a new block of rows
            maximum[:n] = float("-inf")
            total[:n], picked[:n] = 0.0, 0.0
        logits = _chunk_logits(h[block], weight[columns], None if bias is None else bias[columns])
        inside, column = _target_in(target[block], columns)
        picked[:n] = torch.where(inside, logits.gather(1, column.unsqueeze(1)).squeeze(1), picked[:n])
        grown = torch.maximum(maximum[:n], logits.amax(1))
        shift = grown.masked_fill(grown.abs() == float("inf"), 0.0)
        total[:n] = total[:n] * (maximum[:n] - shift).exp_() + logits.sub_(shift.unsqueeze(1)).exp_().sum(1)
        maximum[:n] = grown
        del logits
        if columns.stop == vocabulary:
            torch.add(total[:n].log(), shift, out=lse[block])
            per_row[block] = torch.where(_valid(target[block], ignore_index), lse[block] - picked[:n], 0.0)


def _forward_in_row_chunks(h, weight, bias, target, ignore_index, lse, per_row, kernels) -> None:
    """Each row's log-sum-exp and loss by the Triton row kernels, over chunks of whole rows."""
    rows, vocabulary = h.shape[0], weight.shape[0]
    step = chunk_rows(rows, vocabulary)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        logits = _chunk_logits(h[start:stop], weight, bias)
        kernels.cross_entropy_rows(logits, target[start:stop].contiguous(), ignore_index, lse[start:stop],
                                   per_row[start:stop])
        del logits


@torch.library.custom_op("hierremat::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor, reduction: int,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, per-row log-sum-exp in fp32): cross_entropy(h @ weight.T + bias, target) with
    ``reduction`` 0 (none), 1 (mean over non-ignored rows) or 2 (sum)."""
    rows = h.shape[0]
    lse = torch.empty(rows, dtype=torch.float32, device=h.device)
    per_row = torch.empty(rows, dtype=torch.float32, device=h.device)
    track_hidden(lse)
    track_hidden(per_row)
    kernels = _row_kernels(h)
    with torch.autocast(h.device.type, enabled=False):
        if kernels is not None:
            _forward_in_row_chunks(h, weight, bias, target, ignore_index, lse, per_row, kernels)
        else:
            _forward_in_tiles(h, weight, bias, target, ignore_index, lse, per_row)
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


def _backward_in_tiles(h, weight, bias, target, lse, scale, need_h, grad_weight, grad_bias):
    """Each tile's logits again, their gradient in place (softmax minus the one-hot target, scaled) in h's
    dtype, added into ``grad_weight`` and ``grad_bias``'s columns; returns h's gradient (accumulated over the
    column tiles in fp32, rounded once) where ``need_h``, else None."""
    rows, vocabulary = h.shape[0], weight.shape[0]
    grad_h = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if need_h else None
    for block, columns in _tiles(rows, vocabulary):
        h_block, weight_columns = h[block], weight[columns]
        grad = _chunk_logits(h_block, weight_columns, None if bias is None else bias[columns])
        inside, column = _target_in(target[block], columns)
        grad.sub_(lse[block].unsqueeze(1)).exp_()
        grad[torch.arange(block.stop - block.start, device=h.device), column] -= inside.float()
        grad.mul_(scale[block].unsqueeze(1))
        grad = grad.to(h.dtype)
        if grad_h is not None:
            if grad_h.dtype == grad.dtype:
                grad_h[block].addmm_(grad, weight_columns)
            else:
                grad_h[block] += grad @ weight_columns
        if grad_weight is not None:
            grad_weight[columns].addmm_(grad.t().float(), h_block.float())  # (no-op casts in fp32)
        if grad_bias is not None:
            grad_bias[columns] += grad.sum(0, dtype=torch.float32)
        del grad
    return None if grad_h is None else grad_h.to(h.dtype)


def _backward_in_row_chunks(h, weight, bias, target, lse, scale, need_h, grad_weight, grad_bias, kernels):
    """As :func:`_backward_in_tiles`, over chunks of whole rows, each chunk's gradient formed by a Triton
    kernel (h's gradient written chunk by chunk, in h's dtype)."""
    rows, vocabulary = h.shape[0], weight.shape[0]
    step = chunk_rows(rows, vocabulary)
    grad_h = torch.empty_like(h) if need_h else None
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        h_chunk = h[start:stop]
        logits = _chunk_logits(h_chunk, weight, bias)
        out = logits if h.dtype == torch.float32 else torch.empty(logits.shape, dtype=h.dtype, device=h.device)
        grad = kernels.cross_entropy_grad(logits, lse[start:stop], target[start:stop].contiguous(),
                                          scale[start:stop].contiguous(), out)
        del logits
        if grad_h is not None:
            torch.mm(grad, weight, out=grad_h[start:stop])
        if grad_weight is not None:
            grad_weight.addmm_(grad.t().float(), h_chunk.float())
        if grad_bias is not None:
            grad_bias += grad.sum(0, dtype=torch.float32)
        del grad
    return grad_h


def _backward(ctx, grad_loss, _grad_lse):
    h, weight, bias, target, lse = ctx.saved_tensors
    if grad_loss is None:
        return None, None, None, None, None, None
    rows = h.shape[0]
    valid = _valid(target, ctx.ignore_index)
    if ctx.reduction == 0:
        scale = grad_loss.float()
    else:
        scale = grad_loss.float().expand(rows)
        if ctx.reduction == 1:
            scale = scale / valid.sum()
    scale = torch.where(valid, scale, 0.0)
    need_h, need_weight, need_bias = ctx.needs_input_grad[:3]
    # dW and db accumulate in fp32 over the tiles and are rounded once, as one matmul would;
    # an fp32 weight's tiles go straight into its .grad where they may (no [vocabulary, width] tensor)
    into = grad_to_add_into(weight) if need_weight and weight.dtype == torch.float32 else None
    if into is not None:
        grad_weight = into
    else:
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_weight else None
    grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=h.device) if need_bias and bias is not None else None
    kernels = _row_kernels(h)
    with torch.autocast(h.device.type, enabled=False):
        if kernels is not None:
            grad_h = _backward_in_row_chunks(h, weight, bias, target, lse, scale, need_h, grad_weight, grad_bias,
                                             kernels)
        else:
            grad_h = _backward_in_tiles(h, weight, bias, target, lse, scale, need_h, grad_weight, grad_bias)
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
