"""Forwards without grad that compute exactly what the forward with grad computes.

Some operators choose their kernel by whether their inputs require a gradient. On CPU,
``scaled_dot_product_attention`` runs its fused (flash) kernel unless the attention mask needs
a gradient (T5's learned position bias), and then its math path; the two round differently.
A checkpointed stage run under ``torch.no_grad()`` would thus compute other values than its
forward with grad, which plain autograd runs and recomputations replay: gradients would no
longer be bitwise plain autograd's (T5 without dropout: differences of 1e-8 in fp32, 1e-3 in
bf16). :func:`tapeless` runs the forward in grad mode, so every operator chooses as in
training, while a saved-tensor hook drops what autograd would keep for a backward: the memory
is that of a forward without grad (torch.utils.checkpoint's non-reentrant variant runs its
first forward this way). Outputs carry a grad_fn that leads nowhere: detach them.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


def _drop(tensor: torch.Tensor) -> None:
    return None


def _unreachable(_) -> torch.Tensor:
    raise RuntimeError("hierremat: a forward run without a tape was backpropagated")


@contextmanager
def tapeless() -> Iterator[None]:
    """Grad mode, nothing saved for a backward (module docstring)."""
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_drop, _unreachable):
        yield
