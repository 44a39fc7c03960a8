"""FSDP2 (``torch.distributed.fsdp.fully_shard``) under hierremat's chain runner.

Order: plan first, shard second, as torchtitan applies activation checkpointing before
``fully_shard``::

    trained = hr.remat(model, (ids,), {"labels": ids}, budget="20GiB")  # captures, profiles, plans
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())  # the sharded parameters
    trained(ids, labels=ids).loss.backward()  # the first call re-plans for the shards

Planning needs the model's parameters on one device (not its gradients or optimizer
states, which FSDP2 shards too), or the model built on meta and planned with ``device=``
(hierremat.runtime.lent_weights: one lent copy per distinct stage), then sharded, ``to_empty``
and initialized: torchtitan's order. The first call after ``fully_shard`` finds the FSDP2
modules and re-plans the chain (no capture, no profiling: only the chain DP) with what
FSDP2 gathers counted (:class:`ShardedChain`); rank 0's plan is broadcast so that every
rank runs the same schedule, hence the same collectives in the same order.

How a stage runs: through the ``__call__`` of the FSDP2 module that owns its parameters,
the stage standing in as that module's forward for the one call. FSDP2's own hooks then
do what they do for any module: all-gather the parameters before the forward (and before
a recomputation), reshard after it, all-gather again before the backward and
reduce-scatter the gradients after it. A recomputation during the backward is what FSDP2
sees under activation checkpointing: its post-forward hook leaves the parameters gathered
for the backward that follows. Sharding itself is FSDP2's; hierremat only calls the
module. The captured stage graphs read each parameter from the model at every call
(``GraphStage.bind``), so they use the unsharded parameters FSDP2 has just gathered.

A new input shape after ``fully_shard`` (a sequence length not seen before) is planned as a model built on
meta is (:func:`without_weights`: the parameters' whole shapes, lent weights to measure with), then
re-planned for the shards as the first shape was: every rank on rank 0's plan.

What FSDP2 holds is counted (:func:`with_gathered`, :func:`reserve_bytes`; the plan's summary
shows it): each stage's gathered parameters while it runs (forward, recomputation,
backward), its unsharded gradients and reduce-scatter buffers, the root module's
parameters for the whole step, a group prefetched ahead of its backward. The model is
measured with gloo on CPU (tests/test_distributed.py) and errs on the safe side.

Constraints: block options of the per-block ILP are not used
under FSDP2 (their op-by-op executor computes parameter gradients outside autograd, where
FSDP2's post-backward hook cannot see them): the plan uses what autograd keeps per stage
(Rotor on blocks); each stage's parameters must belong to one FSDP2 module.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from ..plans.costs import ChainCosts
from ..errors import UnsupportedModelError

log = logging.getLogger(__name__)

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - torch built without distributed
    FSDPModule = None


def is_fsdp_module(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` itself."""
    return FSDPModule is not None and isinstance(module, FSDPModule)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``model`` or any of its submodules."""
    return any(is_fsdp_module(m) for m in model.modules())


def _owner(model: nn.Module, target: str) -> nn.Module:
    """The innermost FSDP2 module on the path to the parameter ``target``."""
    parts = target.split(".")[:-1]
    for depth in range(len(parts), -1, -1):
        module = model.get_submodule(".".join(parts[:depth]))
        if is_fsdp_module(module):
            return module
    raise UnsupportedModelError(
        f"parameter {target} belongs to no fully_shard'ed module: apply fully_shard to the model too "
        "(the root), as FSDP2 expects"
    )


def _group_bytes(module: nn.Module) -> int:
    """Bytes of the parameters FSDP2 gathers for ``module``: its own, not those of FSDP2 modules inside it."""
    inner = {id(p) for m in module.modules() if m is not module and isinstance(m, FSDPModule) for p in m.parameters()}
    state = module._get_fsdp_state()  # the mixed-precision policy's parameter dtype, if any
    policy = getattr(state, "_mp_policy", None)
    dtype = getattr(policy, "param_dtype", None)
    return sum(p.numel() * (dtype or p.dtype).itemsize for p in module.parameters() if id(p) not in inner)


@dataclass(frozen=True)
class GatheredBytes:
    """What FSDP2 all-gathers in a step, in bytes.

    per_stage[i]: the unsharded parameters of the FSDP2 module stage i runs through, when
        that module is not the root (gathered for the stage's forward, again for its
        recomputation and its backward, and freed after each).
    root: the root module's unsharded parameters (FSDP2 does not reshard the root after
        the forward: they stay gathered until its post-backward).
    """

    per_stage: tuple[int, ...]
    root: int


class ShardedChain:
    """Calls the stages of a captured chain through the FSDP2 modules that own their parameters."""

    def __init__(self, model: nn.Module, stages: Sequence[nn.Module]):
        self.model = model
        self.stages = list(stages)
        self.owners: list[nn.Module] = []
        for i, stage in enumerate(self.stages):
            owners = {id(m): m for m in (_owner(model, t) for t in stage.parameter_targets())}
            if len(owners) > 1:
                raise UnsupportedModelError(
                    f"stage {i} ({getattr(stage, 'stage_name', type(stage).__name__)}) uses the parameters of "
                    f"{len(owners)} fully_shard'ed modules; hierremat needs one per stage: apply fully_shard to each "
                    "repeated block (decoder layer) and to the model"
                )
            self.owners.append(next(iter(owners.values())) if owners else model)

    def gathered_bytes(self) -> GatheredBytes:
        root = self.model
        return GatheredBytes(
            tuple(0 if owner is root else _group_bytes(owner) for owner in self.owners),
            _group_bytes(root) if isinstance(root, FSDPModule) else 0,
        )

    def call(self, i: int, x: torch.Tensor, *shared):
        """Stage i on (x, *shared), as the forward of its FSDP2 module (the root's stages run
        inside the root's forward already: see :meth:`run`)."""
        stage = self.stages[i]

        def forward(*args):
            stage.bind(self.model)  # the parameters FSDP2 has just gathered
            return stage(*args)

        if self.owners[i] is self.model:
            return forward(x, *shared)
        return _as_forward_of(self.owners[i], forward)(x, *shared)

    def run(self, chain: Callable, x: torch.Tensor, *shared):
        """The whole chain, ``chain(x, *shared)``, as the root module's forward.

        FSDP2's root hooks then see one forward per step: they gather the root's parameters
        once, and their pre-backward hook, on the chain's outputs, fires in the caller's
        backward, so FSDP2's end-of-backward callback runs once, after the chain's backward
        (not after the first stage backward that hierremat's runner starts inside it)."""
        if not isinstance(self.model, FSDPModule):
            return chain(x, *shared)
        return _as_forward_of(self.model, chain)(x, *shared)


@contextlib.contextmanager
def without_weights(model: nn.Module) -> Iterator[None]:
    """Within: ``model``, sharded with FSDP2, as a model built on meta, to plan a new input shape with lent weights
    (hierremat.runtime.lent_weights), as its first shape may be planned: every parameter and buffer a meta
    tensor of its whole (unsharded) shape and dtype, and FSDP2's forward hooks off (they would all-gather, and
    export traces the modules' own forwards). The parameters, buffers and hooks are put back on exit. Nothing
    runs on the shards: no collective, so each rank may plan on its own before they agree in
    ``PlannedShape.shard``."""
    saved, meta = [], {}  # (one meta tensor per tensor: tied weights stay tied)

    def meta_of(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in meta:
            empty = torch.empty(t.shape, dtype=t.dtype, device="meta")
            meta[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
        return meta[id(t)]

    try:
        for module in model.modules():
            tensors = {kind: dict(getattr(module, kind)) for kind in ("_parameters", "_buffers")}
            hooks = {kind: getattr(module, kind) for kind in _FORWARD_HOOKS} if is_fsdp_module(module) else {}
            saved.append((module, tensors, hooks))
            for kind, named in tensors.items():
                getattr(module, kind).update({name: meta_of(t) for name, t in named.items() if t is not None})
            for kind, value in hooks.items():
                setattr(module, kind, type(value)())
        yield
    finally:
        for module, tensors, hooks in saved:
            module._parameters.update(tensors["_parameters"])
            module._buffers.update(tensors["_buffers"])
            for kind, value in hooks.items():
                setattr(module, kind, value)


#: the nn.Module attributes that hold forward hooks (FSDP2 registers its own there)
_FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                  "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _as_forward_of(module: nn.Module, forward: Callable) -> Callable:
    """``forward`` called through ``module.__call__`` (its hooks), standing in as its forward for that call."""

    def call(*args):
        module.forward = forward  # an instance attribute: shadows the class's forward for this call
        try:
            return module(*args)
        finally:
            del module.forward

    return call


def with_gathered(costs: ChainCosts, gathered: GatheredBytes) -> ChainCosts:
    """The chain's costs under FSDP2: option 0 of each stage (see the module docstring), with
    what FSDP2 allocates while the stage runs added to its overheads (G: the unsharded
    parameters of the stage's module; measured on CPU with gloo by tests/test_distributed.py).

    * Forward (and recomputation): the gathered parameters stay while the stage computes
      (G), and before it, the all-gather's output buffer and the parameters it is copied
      out into exist together for a moment (2 G, before any activation of the stage).
    * Backward: the gathered parameters and the unsharded gradients autograd accumulates
      (2 G) while the stage's backward runs; after it, when its activations are gone,
      FSDP2's post-backward hook frees the parameters and builds the reduce-scatter's
      input (G) and output (G / world size) while the gradients go, and gloo's
      reduce-scatter works on a copy of its input (G more): 4 G bounds that moment.
    """

    def forward(overhead: int, g: int) -> int:
        return max(overhead + g, 2 * g)

    stages = []
    for stage, g in zip(costs.stages, gathered.per_stage):
        stage = stage.called_as_module()
        option = stage.options[0]
        option = replace(
            option, fwd_overhead_bytes=forward(option.fwd_overhead_bytes, g),
            bwd_overhead_bytes=max(option.bwd_overhead_bytes + 2 * g, 4 * g),
            bwd_overhead_new_grads_bytes=None,  # measured unsharded: the gradients the step keeps are shards
        )
        stages.append(
            replace(stage, nograd_fwd_overhead_bytes=forward(stage.nograd_fwd_overhead_bytes, g), options=(option,))
        )
    return replace(costs, stages=tuple(stages))


def reserve_bytes(gathered: GatheredBytes) -> int:
    """Bytes FSDP2 holds beside the chain's schedule: the root module's gathered parameters
    (for the whole step) and gradients (from the output stage's backward until the final
    post-backward); one group gathered ahead of its backward (FSDP2 prefetches the next group
    in backward order, and it stays until that group's backward ends); the previous group's
    reduce-scatter input, which FSDP2 keeps until the next group's reduce-scatter; and one
    more such buffer for a reduce-scatter still in flight (its buffers are released when the
    asynchronous collective completes: measured on gloo, peaks vary by up to that much)."""
    largest = max(gathered.per_stage, default=0)
    return 2 * gathered.root + 3 * largest
