"""An embedding whose backward adds the rows it read into the table's ``.grad``, never a dense table.

``aten.embedding``'s backward (``embedding_dense_backward``) builds a gradient the size of the
whole table, ``[num_embeddings, dim]``, zero except at the rows the batch read, which
``AccumulateGrad`` then adds into ``.grad``. For a language model's token embedding (GPT-2:
50257 x 768, 147 MiB in fp32) that tensor is the largest of the first stage's backward,
although a batch reads a few hundred rows of it.

This variant computes the read rows' gradient with the same kernel on the batch's distinct
indices (``embedding_dense_backward`` of the indices renumbered in sorted order, so every row
sums the same terms in the same order) and adds each row into ``.grad`` once
(``index_add_`` of distinct indices): bitwise what ``.grad += dense`` gives on those rows;
the other rows keep their values (adding a dense zero would only turn a ``-0.0`` into
``+0.0``). Where the gradient cannot go into ``.grad`` directly
(hierremat.ops.grad_in_place: no ``.grad`` yet, tensor hooks, create_graph, tracing),
the backward is ``embedding_dense_backward`` itself.

A table read by more than two operators of the graph keeps ``aten.embedding``: BART ties its
encoder's and decoder's embeddings and its head. Autograd sums the three gradients before
adding them into ``.grad``, ``(head + dec) + enc``; rows added into ``.grad`` first would give
``(dec + enc) + head`` where one backward call runs all three (a plan that keeps everything runs
the model as one graph). With two readers the sums are the same: addition commutes.

``padding_idx`` and ``scale_grad_by_freq`` are honoured as aten does; sparse embeddings are
not rewritten. On CUDA ``torch.unique`` synchronizes the host once per embedding backward.
"""

from __future__ import annotations

import torch

from .grad_in_place import added_gradient, grad_to_add_into



@torch.library.custom_op("hierremat::embedding", mutates_args=())
def _embedding(weight: torch.Tensor, indices: torch.Tensor, padding_idx: int, scale_grad_by_freq: bool) -> torch.Tensor:
    """``aten.embedding(weight, indices, padding_idx, scale_grad_by_freq)`` (dense)."""
    return torch.ops.aten.embedding(weight, indices, padding_idx, scale_grad_by_freq, False)


@_embedding.register_fake
def _(weight, indices, padding_idx, scale_grad_by_freq):
    return weight.new_empty((*indices.shape, weight.shape[1]))


def _setup_context(ctx, inputs, output) -> None:
    weight, indices, padding_idx, scale_grad_by_freq = inputs
    ctx.save_for_backward(indices)
    # the table itself only where its .grad may be added into (a leaf: holding it costs nothing)
    ctx.weight = weight if weight.is_leaf and weight.requires_grad else None
    ctx.num_weights, ctx.padding_idx, ctx.scale_grad_by_freq = weight.shape[0], padding_idx, scale_grad_by_freq


def _backward(ctx, grad):
    (indices,) = ctx.saved_tensors
    weight, ctx.weight = ctx.weight, None
    target = grad_to_add_into(weight) if ctx.needs_input_grad[0] else None
    if target is None:
        dense = torch.ops.aten.embedding_dense_backward(
            grad, indices, ctx.num_weights, ctx.padding_idx, ctx.scale_grad_by_freq
        )
        return dense, None, None, None
    distinct, renumbered = torch.unique(indices, return_inverse=True)
    rows = torch.ops.aten.embedding_dense_backward(grad, renumbered, distinct.numel(), -1, ctx.scale_grad_by_freq)
    if ctx.padding_idx >= 0:
        rows.masked_fill_((distinct == ctx.padding_idx).unsqueeze(1), 0.0)
    target.index_add_(0, distinct, rows)
    return added_gradient(weight), None, None, None


_embedding.register_autograd(_backward, setup_context=_setup_context)


def embedding(weight: torch.Tensor, indices: torch.Tensor, padding_idx: int = -1, scale_grad_by_freq: bool = False) -> torch.Tensor:
    """``aten.embedding`` (dense) whose backward adds into ``weight.grad`` (see the module docstring)."""
    return torch.ops.hierremat.embedding(weight, indices, padding_idx, scale_grad_by_freq)
