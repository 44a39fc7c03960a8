"""Operator variants put into graphs (MONeT's idea): rewrites that replace an operator's calls by
an exact, memory-lean form. The operators they insert are hierremat.ops'.

Each rewrite computes bitwise what the graph computed, in less memory:
* ``cross_entropy`` (at capture): ``aten.cross_entropy_loss`` by the row-blocked cross-entropy,
  whose backward never makes the whole dense gradient of the log-probabilities;
* ``embedding`` (at capture): ``aten.embedding`` by the embedding whose backward adds the rows
  the batch read into the table's ``.grad``, never a dense ``[num_embeddings, dim]`` gradient;
* ``linear`` (at capture): ``aten.linear`` of a weight far larger than its activations by the
  linear layer whose backward adds the weight's gradient into ``.grad`` (bitwise with ``.grad``
  zeroed; see hierremat.ops.linear under gradient accumulation);
* ``max_pool`` (at capture): ``aten.max_pool2d`` by the max-pool whose CPU forward pools in the
  channels-last layout, several times faster, with the NCHW kernel's output and indices;
* ``dropout`` (joint graphs): dropout masks packed to one bit per element, and the dropout's
  output as a deterministic op of its input and the packed mask, so a block option may
  recompute it instead of keeping it (the random draw itself is never repeated);
* ``relu_masks`` (joint graphs): ReLU's backward (``threshold_backward``) from a 1-bit mask of
  its output, which the block ILP may keep instead of the output or recompute from it;
* ``in_place`` (joint graphs): pointwise operators, and backward kernels that read an element
  before writing it (activation, softmax and dropout backwards), write their result over an
  argument that nothing reads after them (the same kernels' in-place or ``out=`` overloads),
  so the step allocates no new result.

``linear_cross_entropy`` is a rewrite of another kind: a language model's head fused with its
loss, tile by tile, which never materializes the logits but computes the head's matmul once
more and sums the weight gradient in another order (equal to fp32 rounding). It trades time
for memory, so it is an option the plan picks by budget (hierremat.planning.output_stage),
never a rewrite applied unconditionally.
"""
