"""Operator variants: exact, memory-lean implementations of operators (MONeT's idea).

Each variant computes bitwise what the operator it replaces computes, in less memory:
* ``cross_entropy``: the backward of ``aten.cross_entropy_loss`` on blocks of rows (never
  the whole dense gradient of the log-probabilities);
* ``dropout``: dropout masks packed to one bit per element, and the dropout's output
  as a deterministic op of its input and the packed mask, so a block option may
  recompute it instead of keeping it (the random draw itself is never repeated).

The packing kernels are in ``csrc/`` (a C++ extension built on first use) with a
pure-torch fallback (``hierremat.variants.packed_bits``).
"""
