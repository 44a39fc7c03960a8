"""Planning a model that has no weights yet: one real copy per distinct stage, lent while planning.

The models that need rematerialization most are built on the meta device (torchtitan's order: build
on meta, apply activation checkpointing, shard, then ``to_empty`` and initialize). Their parameters
have shapes and dtypes but no storage, and the whole model may not fit on one device (so do those built
under ``FakeTensorMode``, whose fake tensors say which device they stand for: planned the same way). hierremat
captures such a model on meta (export needs no values) and then, for the duration of planning,
lends every *distinct* stage (stage signature: the same graph at the same shapes) one set of real
tensors on the target device, which every stage of that signature computes with: the profile, the
block graphs, their node times and the executors' speeds all run on them. Identical blocks share
one copy, so planning holds one block's weights per signature (plus the prologue's and the
epilogue's), not the model's. A parameter two stages read (a tied embedding and LM head) gets one
copy, as it is one tensor.

The values are random, of each tensor's dtype (floating: normal with standard deviation 0.02, as
GPT-2's and Llama's initializers; integers and booleans: ones, a valid index and an attention mask
without padding), drawn from a fixed seed so that every rank of a distributed run plans with the
same ones. Example inputs given on meta are lent so too (given real, they are used). Costs do not
depend on the values, up to sizes that depend on the data (an embedding gradient's distinct rows:
one where every index is 1) and to denormal-slow arithmetic, which normal(0, 0.02) weights avoid. After planning the stages read
the model's own tensors again (:func:`bind_to_model`, once the model holds real ones).
"""

from __future__ import annotations

import contextlib
import operator
from typing import Iterator, Sequence

import torch
from torch import fx, nn

from ..device import is_abstract
from ..errors import UnsupportedModelError
from ..blocks.segment import substitute_tensor

#: Seed of the lent values (the same on every rank).
LENT_SEED = 20261125
#: Standard deviation of lent floating values (GPT-2's and Llama's initializer range).
LENT_STD = 0.02


def has_abstract_weights(model: nn.Module) -> bool:
    """Whether any of ``model``'s parameters or buffers has no storage (meta or fake: device.is_abstract)."""
    return any(is_abstract(t) for t in (*model.parameters(), *model.buffers()))


def lent_value(like: torch.Tensor, device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """A real tensor of ``like``'s shape and dtype on ``device`` (values: module docstring)."""
    value = torch.ones(like.shape, dtype=like.dtype, device=device)
    if like.is_floating_point() or like.is_complex():
        value = value.normal_(0.0, LENT_STD, generator=generator) if generator is not None else value.normal_(0.0, LENT_STD)
    return value


def _generator(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(LENT_SEED)


def lent_inputs(values, device: torch.device):
    """``values`` (a pytree) on ``device``: every meta or fake tensor replaced by a lent real one, the others moved."""
    generator = _generator(device)

    def lend(v):
        if not isinstance(v, torch.Tensor):
            return v
        return lent_value(v, device, generator) if is_abstract(v) else v.to(device)

    return torch.utils._pytree.tree_map(lend, values)


def _tensor_targets(gm: fx.GraphModule) -> list[str]:
    """The targets of ``gm``'s get_attr nodes that are tensors (parameters and buffers), in graph order."""
    targets = []
    for node in gm.graph.find_nodes(op="get_attr"):
        try:
            value = operator.attrgetter(node.target)(gm)
        except AttributeError:
            continue
        if isinstance(value, torch.Tensor) and node.target not in targets:
            targets.append(node.target)
    return targets


def _graph_of(stage: nn.Module) -> fx.GraphModule | None:
    gm = getattr(stage, "graph_module", stage)
    return gm if isinstance(gm, fx.GraphModule) else None


def _lend(own: torch.Tensor, device: torch.device, generator: torch.Generator, stage: nn.Module, target: str):
    """A lent copy of ``own``; where ``device`` cannot hold it, an error naming the stage, the tensor and its bytes."""
    try:
        return lent_value(own, device, generator)
    except (torch.OutOfMemoryError, RuntimeError) as err:
        nbytes = own.numel() * own.element_size()
        name = getattr(stage, "stage_name", type(stage).__name__)
        raise UnsupportedModelError(
            f"planning without weights lends stage {name!r} its weights on {device}, but {target} "
            f"({nbytes / 2**20:.1f} MiB) could not be allocated there ({err}); plan on a device with room for one copy "
            "of each distinct stage's weights"
        ) from err


@contextlib.contextmanager
def lent_weights(stages: Sequence[nn.Module], signatures: Sequence[str], device: torch.device) -> Iterator[int]:
    """While the block runs, every stage computes with real tensors on ``device`` where its own are on
    meta: one copy per stage signature and tensor position, a tensor several stages read lent once
    (module docstring). Yields the bytes lent; puts each stage's own tensors back on exit."""
    generator = _generator(device)
    by_tensor: dict[int, torch.Tensor] = {}  # id of a meta tensor -> its lent copy
    by_position: dict[tuple[str, int], torch.Tensor] = {}  # (signature, position) -> the lent copy
    originals: list[tuple[nn.Module, str, torch.Tensor]] = []
    lent_bytes = 0
    try:
        for stage, signature in zip(stages, signatures):
            gm = _graph_of(stage)
            if gm is None:
                continue
            for position, target in enumerate(_tensor_targets(gm)):
                own = operator.attrgetter(target)(gm)
                if not is_abstract(own):
                    continue
                copy = by_tensor.get(id(own))
                if copy is None:
                    copy = by_position.get((signature, position))
                    if copy is None or copy.shape != own.shape or copy.dtype != own.dtype:
                        copy = _lend(own, device, generator, stage, target)
                        if isinstance(own, nn.Parameter):
                            copy = nn.Parameter(copy, requires_grad=own.requires_grad)
                        lent_bytes += copy.numel() * copy.element_size()
                        by_position[(signature, position)] = copy
                    by_tensor[id(own)] = copy
                originals.append((gm, target, own))
                substitute_tensor(gm, target, copy)
        yield lent_bytes
    finally:
        for gm, target, own in reversed(originals):
            substitute_tensor(gm, target, own)


def bind_to_model(modules: Sequence[nn.Module], model: nn.Module) -> int:
    """Make each graph in ``modules`` (stages, the orchestrator) read the model's current parameters and
    buffers by name (a model planned on meta, since materialized with ``to_empty``: new tensors).
    Returns how many targets were re-bound."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    bound = 0
    for module in modules:
        gm = _graph_of(module)
        if gm is None:
            continue
        for target in _tensor_targets(gm):
            value = named.get(target)
            if value is not None and operator.attrgetter(target)(gm) is not value:
                substitute_tensor(gm, target, value)
                bound += 1
    return bound
