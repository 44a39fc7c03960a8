"""Operators: the ``hierremat::`` operators (``torch.library``) that the operator variants'
rewrites (hierremat.blocks.variants) insert, and their kernels.

* ``packed_bits``: bit-packed boolean masks (``pack_mask``, ``dropout_bits``, ``above_bits``,
  ``masked_scale``, ``where_bits`` and their ``out=`` forms): C++ CPU kernels built from
  ``csrc/`` on first use, Triton kernels for CUDA (``triton_kernels``), a pure-torch reference
  for every other case (layout: ``bit_layout``);
* ``cross_entropy``: ``row_blocked_cross_entropy``, the backward of ``aten.cross_entropy_loss``
  on blocks of rows;
* ``embedding``: an embedding whose backward adds the rows it read into the table's ``.grad``
  (``grad_in_place``: where autograd's result would be the same);
* ``linear``: a linear layer whose backward adds its weight gradient into ``.grad`` (``addmm_``);
* ``max_pool``: a 2-d max-pool whose CPU forward pools in the channels-last layout;
* ``linear_cross_entropy``: a language model's head fused with its loss, tile by tile.

Each computes bitwise what the operators it stands for compute, except the fused head (equal
to fp32 rounding). Operators know nothing of graphs or plans: they import only device state.
"""
