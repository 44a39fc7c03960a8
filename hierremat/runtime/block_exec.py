"""Execute one block option: a stage's joint ATen graph run op by op as the ILP scheduled it.

A :class:`hierremat.ilp.options.BlockOption` lists, for the forward and for the
backward, which nodes of the stage's joint graph (hierremat.blocks.joint) to compute and
when to free each value. :class:`OptionExecutor` follows those lists literally on real
tensors, without autograd: the forward returns the stage output and the values the option
keeps; the backward takes them with the output gradient, recomputes what the option
recomputes, accumulates parameter gradients into ``.grad`` as soon as each is computed
(through autograd's AccumulateGrad, so gradient hooks fire) and returns the input gradient. So the memory in use
at every moment is what the ILP modelled.

Random nodes (dropout) run only in the forward, in graph order, so they draw what eager
autograd draws from the same RNG state (the chain runner restores that state when it
replays a stage). Buffer updates (BatchNorm running statistics) are copied into the
stage's buffers when computed in the forward, never when recomputed in the backward.
The graph holds every cast autocast made while it was traced (hierremat.runtime.autocast),
so it runs with autocast off.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from ..blocks.joint import JointGraph, joint_inputs
from ..ilp.formulation import COMPUTE
from ..ilp.options import BlockOption
from .autocast import AutocastState


@dataclass
class OptionTape:
    """What an option's forward leaves for its backward: kept values by node name, and x if pinned."""

    kept: dict[str, torch.Tensor]
    x: torch.Tensor | None


class OptionExecutor:
    """Runs ``option`` on ``joint`` (one stage, one output, one output gradient)."""

    def __init__(self, joint: JointGraph, option: BlockOption):
        if len(joint.output_names) != 1 or len(joint.tangent_names) != 1:
            raise ValueError("block options run only on stages with one output and one output gradient")
        self.joint = joint
        self.option = option
        self.nodes = {n.name: n for n in joint.module.graph.nodes}
        for kind, name in option.fwd_ops + option.bwd_ops:
            if name not in self.nodes:
                raise ValueError(f"option {option.name!r} names node {name!r}, which the stage's joint graph lacks")
        self.output_name = joint.output_names[0]
        (self.tangent_name,) = joint.tangent_names.values()
        self.param_of_grad = {node: target for target, node in joint.param_grad_names.items()}
        self.buffer_of_mutation = dict(joint.mutations)
        self.stage_params = dict(joint.stage.named_parameters(remove_duplicate=False))
        self.stage_buffers = dict(joint.stage.named_buffers(remove_duplicate=False))
        #: multi-output node -> {element index: number of getitem nodes reading it}
        self.getitem_uses: dict[str, dict[int, int]] = {}
        for node in joint.module.graph.nodes:
            if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
                uses = self.getitem_uses.setdefault(node.args[0].name, {})
                uses[node.args[1]] = uses.get(node.args[1], 0) + 1

    def _environment(self, x: torch.Tensor | None, shared: tuple, dy: torch.Tensor | None) -> dict:
        placeholders = [n.name for n in self.joint.placeholders()]
        values = joint_inputs(self.joint, x if x is not None else _Missing(), shared, (dy if dy is not None else _Missing(),))
        return {name: v for name, v in zip(placeholders, values) if not isinstance(v, _Missing)}

    def _run(self, name: str, env: dict):
        """Compute one node. A multi-output op's result is kept as a list whose elements are
        handed over to their getitem nodes (and unused ones dropped at once), so that each
        element lives exactly as long as its getitem's value, as the BlockGraph models it."""
        node = self.nodes[name]
        if node.target is operator.getitem and isinstance(env.get(node.args[0].name), _Elements):
            return env[node.args[0].name].take(node.args[1])
        args = fx.node.map_arg(node.args, lambda n: env[n.name])
        kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n.name])
        value = node.target(*args, **kwargs)
        if isinstance(value, (tuple, list)):
            value = _Elements(value, self.getitem_uses.get(name, {}))
        return value

    def forward(self, x: torch.Tensor, shared: tuple) -> tuple[torch.Tensor, OptionTape]:
        """Run the forward ops; return the stage output and the tape for :meth:`backward`."""
        env = self._environment(x, shared, None)
        computed: set[str] = set()
        with torch.no_grad(), AutocastState.off((x.device.type,)).applied():
            for kind, name in self.option.fwd_ops:
                if kind == COMPUTE:
                    env[name] = self._run(name, env)
                    computed.add(name)
                    target = self.buffer_of_mutation.get(name)
                    if target is not None:
                        self.stage_buffers[target].copy_(env[name])
                else:
                    env.pop(name, None)
        y = env[self.output_name]
        kept = {name: env[name] for name in computed if name in env and name != self.output_name}
        if self.option.pins_output:
            kept[self.output_name] = y
        return y, OptionTape(kept, x if self.option.pins_input else None)

    def backward(self, tape: OptionTape, dy: torch.Tensor, shared: tuple) -> torch.Tensor | None:
        """Run the backward ops from the tape and the output gradient; return the input gradient."""
        env = self._environment(tape.x, shared, dy)
        env.update(tape.kept)
        tape.kept = {}
        tape.x = None
        dx = None
        with torch.no_grad(), AutocastState.off((dy.device.type,)).applied():
            for kind, name in self.option.bwd_ops:
                if kind != COMPUTE:
                    env.pop(name, None)
                    continue
                env[name] = self._run(name, env)  # no local name: a freed value must really go
                target = self.param_of_grad.get(name)
                if target is not None:
                    _accumulate(self.stage_params[target], env[name])
                if name == self.joint.input_grad_name:
                    dx = env[name]
        return dx


class _Elements:
    """The elements of a multi-output op, each released once its getitem nodes took it."""

    def __init__(self, values, uses: dict[int, int]):
        self.values = [v if i in uses else None for i, v in enumerate(values)]
        self.uses = dict(uses)

    def take(self, index: int):
        value = self.values[index]
        if value is None:
            raise RuntimeError(
                f"element {index} of a multi-output op was read again without the op being recomputed: the "
                "option's op lists do not match this graph (a stale cached menu?)"
            )
        self.uses[index] -= 1
        if self.uses[index] <= 0:
            self.values[index] = None
        return value


class _Missing:
    """Placeholder for an input the phase does not have (x in a backward without the pin, dy in a forward)."""


def _accumulate(param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """Accumulate into ``param.grad`` through autograd's AccumulateGrad, so that gradient hooks
    (DistributedDataParallel's all-reduce, post-accumulate-grad hooks) fire as in plain training."""
    if param.requires_grad:
        torch.autograd.backward([param], [grad])
