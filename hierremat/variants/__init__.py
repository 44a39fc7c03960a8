"""Operator variants: exact, memory-lean implementations of operators (MONeT's idea).

Each variant computes bitwise what the operator it replaces computes, in less memory:
* ``cross_entropy``: the backward of ``aten.cross_entropy_loss`` on blocks of rows (never
  the whole dense gradient of the log-probabilities);
* ``dropout``: dropout masks packed to one bit per element, and the dropout's output
  as a deterministic op of its input and the packed mask, so a block option may
  recompute it instead of keeping it (the random draw itself is never repeated);
* ``relu_masks``: ReLU's backward (``threshold_backward``) from a 1-bit mask of its output,
  which the block ILP may keep instead of the output or recompute from it;
* ``embedding``: the backward adds the rows the batch read into the table's ``.grad``
  (``index_add_`` of distinct rows, each summed as ``embedding_dense_backward`` sums it),
  never a dense ``[num_embeddings, dim]`` gradient (``grad_in_place``: where autograd's
  result would be the same, ``.grad`` allocated and no tensor hooks).

* ``in_place``: pointwise operators, and backward kernels that read an element before
  writing it (activation, softmax and dropout backwards), write their result over an argument
  that nothing reads after them (the same kernels' in-place or ``out=`` overloads), so the
  step allocates no new result.

``linear_cross_entropy`` is a variant of another kind: a language model's head fused with
its loss, chunk by chunk, which never materializes the logits but computes the head's
matmul once more and sums the weight gradient in another order (equal to fp32 rounding),
adding an fp32 weight's share into its ``.grad`` chunk by chunk where it may. It
trades time for memory, so it is an option the plan picks by budget (hierremat.output_stage),
never a rewrite applied unconditionally.

The packing kernels are in ``csrc/`` (a C++ extension built on first use) with a
pure-torch fallback (``hierremat.variants.packed_bits``).
"""
