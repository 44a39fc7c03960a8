"""Capturing a model that has no weights yet (the meta device) as it will run on its real device.

``torch.export`` traces with fake tensors, which need no values, but a model built on meta traces as a
meta model: autocast, which acts per device type, casts nothing, and the tensors its code creates
(position ids, masks) are created on meta. :func:`weights_faked_on` gives the model, for the capture,
fake parameters and buffers that say they are on the device it will train on (one FakeTensorMode, which
export then uses), and the inputs fake on it too: the graph is the one a capture of the materialized model
gives. The model's own tensors are put back after; the captured graph holds the fakes until the caller
binds it to them (hierremat.runtime.lent_weights.bind_to_model).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from ..device import is_abstract


@contextlib.contextmanager
def weights_faked_on(model: nn.Module, device: torch.device) -> Iterator[Callable]:
    """While the block runs, every meta (or fake: device.is_abstract) parameter and buffer of ``model`` is a
    fake tensor on ``device`` in one FakeTensorMode of its own. Yields a function that makes a pytree's
    tensors fake in that mode (real ones on their own device, abstract ones on ``device``)."""
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    faked: dict[int, torch.Tensor] = {}  # a tensor two modules hold (tied weights) is one fake

    def fake_of(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in faked:
            with mode:
                fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            faked[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake
        return faked[id(t)]

    def fake_inputs(values):
        def fake(v):
            if not isinstance(v, torch.Tensor):
                return v
            return fake_of(v) if is_abstract(v) else mode.from_tensor(v)
        return pytree.tree_map(fake, values)

    try:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, tensor in list(table.items()):
                    if tensor is not None and is_abstract(tensor):
                        swapped.append((table, name, tensor))
                        table[name] = fake_of(tensor)
        yield fake_inputs
    finally:
        for table, name, tensor in reversed(swapped):
            table[name] = tensor
