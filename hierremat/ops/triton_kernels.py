"""Triton kernels of hierremat's operator variants, for CUDA tensors.

The packed-mask operators of hierremat.ops.packed_bits (bit layout: element i at bit
``i % 8`` of byte ``i // 8``) and the two row passes of the fused LM head
(hierremat.ops.linear_cross_entropy). Each computes what its pure-torch reference
computes, in one pass over memory where the reference takes several:

* :func:`pack_mask`, :func:`above_bits`, :func:`where_bits_out`: bitwise the references
  (``where_bits`` selects on the integer bit patterns, so NaN payloads and signed zeros pass);
* :func:`masked_scale_out`: ``(x * m) * scale`` in fp32, rounded once to x's dtype, the
  order and precision of ``x.mul(mask).mul_(scale)`` (and of CUDA's ``native_dropout``);
* :func:`cross_entropy_rows` (per-row log-sum-exp and loss, one online pass: Milakov and
  Gimelshein 2018) and :func:`cross_entropy_grad` (softmax minus the one-hot target, scaled,
  in place): equal to the torch ops to fp32 rounding (another summation order and ``exp``),
  the tolerance the fused head already states.

Only fp16, bf16 and fp32 contiguous tensors take these kernels (:func:`supports`); Triton
passes Python floats as fp32, so fp64 keeps the references. The launchers take any tensor
Triton can address: with ``TRITON_INTERPRET=1`` set before this module is imported, they run
on CPU tensors through Triton's interpreter, which is how the CPU test suite checks them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bit_layout import packed_size

#: Packed bytes per program of the mask kernels (8x as many elements).
MASK_BLOCK = 512
#: Vocabulary entries per program step of the cross-entropy kernels.
VOCAB_BLOCK = 1024

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_WORDS = {2: torch.int16, 4: torch.int32}


def supports(*tensors: torch.Tensor) -> bool:
    """Whether these tensors (the floating ones fp16/bf16/fp32) are contiguous, as the kernels need."""
    return all(t.is_contiguous() and (not t.is_floating_point() or t.dtype in _FLOATS) for t in tensors)


def _grid(count: int, per_program: int) -> tuple[int]:
    """One program per ``per_program`` of ``count`` items (at least one program)."""
    return (triton.cdiv(max(count, 1), per_program),)


# Reductions combine with these rather than tl.sum / tl.max, which are jit functions of
# triton.language itself: built before TRITON_INTERPRET is set, they cannot run in the
# interpreter the CPU tests use.
@triton.jit
def _bitwise_or(a, b):
    return a | b


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _pack_kernel(src_ptr, bits_ptr, numel, threshold, COMPARE: tl.constexpr, BLOCK: tl.constexpr):
    """Byte b = OR over j < 8 of bit(element 8b + j) << j, over a [BLOCK, 8] tile."""
    byte = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    lane = tl.arange(0, 8)
    index = byte[:, None] * 8 + lane[None, :]
    inside = index < numel
    if COMPARE:  # above_bits: !(x <= threshold), so NaN is above
        x = tl.load(src_ptr + index, mask=inside, other=0.0).to(tl.float32)
        bit = ((x <= threshold) == 0) & inside
    else:  # pack_mask: any nonzero byte of a bool mask
        bit = (tl.load(src_ptr + index, mask=inside, other=0) != 0) & inside
    packed = tl.reduce(bit.to(tl.int32) << lane[None, :], 1, _bitwise_or)
    tl.store(bits_ptr + byte, packed.to(tl.uint8), mask=byte * 8 < numel)


@triton.jit
def _masked_scale_kernel(x_ptr, bits_ptr, out_ptr, numel, scale, BLOCK: tl.constexpr):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = index < numel
    x = tl.load(x_ptr + index, mask=inside, other=0.0).to(tl.float32)
    keep = (tl.load(bits_ptr + (index >> 3), mask=inside, other=0).to(tl.int32) >> (index & 7)) & 1
    tl.store(out_ptr + index, ((x * keep.to(tl.float32)) * scale).to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _where_bits_kernel(word_ptr, bits_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = index < numel
    word = tl.load(word_ptr + index, mask=inside, other=0)
    keep = (tl.load(bits_ptr + (index >> 3), mask=inside, other=0).to(tl.int32) >> (index & 7)) & 1
    tl.store(out_ptr + index, tl.where(keep != 0, word, tl.full([BLOCK], 0, word.dtype)), mask=inside)


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """``hierremat::pack_mask`` of a contiguous bool mask."""
    numel = mask.numel()
    bits = torch.empty(packed_size(numel), dtype=torch.uint8, device=mask.device)
    _pack_kernel[_grid(bits.numel(), MASK_BLOCK)](mask.view(torch.uint8), bits, numel, 0.0, COMPARE=False, BLOCK=MASK_BLOCK)
    return bits


def above_bits(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """``hierremat::above_bits``: the threshold rounded to x's dtype first, as threshold_backward
    compares (exact in fp32, so the fp32 comparison in the kernel decides the same)."""
    numel = x.numel()
    bits = torch.empty(packed_size(numel), dtype=torch.uint8, device=x.device)
    rounded = float(torch.tensor(threshold, dtype=x.dtype))
    _pack_kernel[_grid(bits.numel(), MASK_BLOCK)](x, bits, numel, rounded, COMPARE=True, BLOCK=MASK_BLOCK)
    return bits


def masked_scale_out(x: torch.Tensor, bits: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
    """``hierremat::masked_scale.out`` (``out`` may be ``x``: each element is read before it is written)."""
    numel = x.numel()
    _masked_scale_kernel[_grid(numel, MASK_BLOCK * 8)](x, bits, out, numel, scale, BLOCK=MASK_BLOCK * 8)
    return out


def where_bits_out(x: torch.Tensor, bits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``hierremat::where_bits.out`` on the bit patterns of x (``out`` may be ``x``)."""
    word = _WORDS[x.element_size()]
    numel = x.numel()
    _where_bits_kernel[_grid(numel, MASK_BLOCK * 8)](x.view(word), bits, out.view(word), numel, BLOCK=MASK_BLOCK * 8)
    return out


@triton.jit
def _cross_entropy_rows_kernel(logits_ptr, target_ptr, lse_ptr, loss_ptr, vocabulary, ignore_index,
                               BLOCK: tl.constexpr):
    """One row: its log-sum-exp by an online max and rescaled sum, and lse - logit[target]
    (0 where the target is ignore_index)."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * vocabulary
    running_max = tl.full([BLOCK], float("-inf"), tl.float32)
    running_sum = tl.full([BLOCK], 0.0, tl.float32)
    for start in range(0, vocabulary, BLOCK):
        column = start + tl.arange(0, BLOCK)
        x = tl.load(base + column, mask=column < vocabulary, other=float("-inf")).to(tl.float32)
        new_max = _maximum(running_max, x)
        # lanes still at -inf add nothing (exp(-inf - -inf) would be NaN)
        rescale = tl.where(new_max == float("-inf"), 0.0, tl.exp(running_max - new_max))
        term = tl.where(new_max == float("-inf"), 0.0, tl.exp(x - new_max))
        running_sum = running_sum * rescale + term
        running_max = new_max
    row_max = tl.reduce(running_max, 0, _maximum)
    total = tl.reduce(tl.where(running_max == float("-inf"), 0.0, running_sum * tl.exp(running_max - row_max)), 0, _add)
    lse = tl.log(total) + row_max
    tl.store(lse_ptr + row, lse)
    target = tl.load(target_ptr + row)
    valid = target != ignore_index
    picked = tl.load(base + tl.where(valid, target, 0)).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - picked, 0.0))


@triton.jit
def _cross_entropy_grad_kernel(logits_ptr, lse_ptr, target_ptr, scale_ptr, out_ptr, vocabulary,
                               BLOCK: tl.constexpr):
    """(softmax - one_hot(target)) * scale over one [1, BLOCK] tile of a row."""
    row = tl.program_id(0).to(tl.int64)
    column = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = column < vocabulary
    x = tl.load(logits_ptr + row * vocabulary + column, mask=inside, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + row)
    target = tl.load(target_ptr + row)
    scale = tl.load(scale_ptr + row)
    grad = (tl.exp(x - lse) - (column == target).to(tl.float32)) * scale
    tl.store(out_ptr + row * vocabulary + column, grad.to(out_ptr.dtype.element_ty), mask=inside)


def cross_entropy_rows(logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                       lse: torch.Tensor, loss: torch.Tensor) -> None:
    """Write each row's log-sum-exp (fp32) into ``lse`` and its loss (0 where ignored) into
    ``loss``, for contiguous ``[rows, vocabulary]`` logits."""
    rows, vocabulary = logits.shape
    if rows:
        _cross_entropy_rows_kernel[(rows,)](logits, target, lse, loss, vocabulary, ignore_index, BLOCK=VOCAB_BLOCK)


def cross_entropy_grad(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, scale: torch.Tensor,
                       out: torch.Tensor) -> torch.Tensor:
    """``(softmax(logits) - one_hot(target)) * scale[:, None]`` into ``out`` (which may be the
    fp32 logits themselves); rows whose scale is 0 (ignored targets, whatever their target
    value) come out 0."""
    rows, vocabulary = logits.shape
    if rows:
        grid = (rows, triton.cdiv(vocabulary, VOCAB_BLOCK))
        _cross_entropy_grad_kernel[grid](logits, lse, target, scale, out, vocabulary, BLOCK=VOCAB_BLOCK)
    return out
