"""Adding a parameter's gradient into its ``.grad`` directly, where autograd's result would be the same.

Autograd hands a parameter its gradient as a new tensor, which ``AccumulateGrad`` then adds
into ``.grad`` (in place, when ``.grad`` exists). For a large weight read by few rows, an
embedding table or a language model's head (GPT-2: ``[50257, 768]``, 147 MiB in fp32), that
new tensor is the largest of the backward although the backward could add its rows into
``.grad`` where they belong. A backward may do so (:func:`grad_to_add_into`) when:

* the weight is a leaf that requires a gradient and already has a dense ``.grad`` of its own
  shape, dtype and device (the budget's convention: ``.grad`` kept allocated between steps;
  with ``.grad`` None, the first gradient becomes ``.grad`` and nothing is saved by this);
* it has no tensor hooks (``register_hook``: they must see the gradient itself);
* the backward does not build a graph (``create_graph=True``) and nothing traces it
  (AOTAutograd's tracing sees fake tensors without ``.grad``; Dynamo and compiled autograd
  are excluded explicitly).

The backward then returns :func:`added_gradient` for the weight: zeros, broadcast from one
element (4 bytes), so that ``AccumulateGrad`` still runs, adds nothing and calls its hooks
(DDP's and FSDP's post-accumulate hooks see the complete ``.grad``). Only the first such
backward of a weight in one ``backward()`` call returns them, the others None: autograd sums
two broadcast tensors into a dense one (a weight read twice, GPT-2's tied embedding and head
in one stage).

Rounding: the rows go into ``.grad`` before the gradients that reach it through autograd in
the same ``backward()`` call, so with a nonzero ``.grad`` (gradient accumulation) and a weight
read twice in one call, ``(g + a) + b`` replaces autograd's ``g + (b + a)``; with ``.grad``
zeroed, or each reader in its own call (hierremat's stages), the sums are the same.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..session import current_session


def grad_to_add_into(weight: torch.Tensor | None) -> torch.Tensor | None:
    """``weight.grad`` when a backward may add the weight's gradient into it directly (see the
    module docstring), else None."""
    if weight is None or not weight.is_leaf or not weight.requires_grad or weight._backward_hooks:
        return None
    grad = weight.grad
    if grad is None or grad.layout is not torch.strided or grad.shape != weight.shape:
        return None
    if grad.dtype != weight.dtype or grad.device != weight.device:
        return None
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    return grad


def added_gradient(weight: torch.Tensor) -> torch.Tensor | None:
    """The gradient a backward returns for ``weight`` after adding it into ``weight.grad``:
    zeros of its shape that take one element of memory, or None where an earlier backward of
    the same ``backward()`` call returned them."""
    task = torch._C._current_graph_task_id()
    # weight -> the graph task (one ``backward()`` call) its last stand-in gradient went to
    tasks = current_session().opened("stand-in gradient tasks", WeakIdKeyDictionary)
    if task >= 0 and tasks.get(weight) == task:
        return None
    tasks[weight] = task
    return torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)
