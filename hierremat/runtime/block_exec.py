"""Execute one block option: a stage's joint ATen graph run as the ILP scheduled it.

A :class:`hierremat.plans.block_options.BlockOption` lists, for the forward and for the
backward, which nodes of the stage's joint graph (hierremat.blocks.joint) to compute and
when to free each value. :class:`OptionExecutor` runs the straight-line functions
generated from those lists (hierremat.runtime.option_codegen) on real tensors, without
autograd: the forward returns the stage output and the values the option keeps; the
backward takes them with the output gradient, recomputes what the option recomputes,
accumulates parameter gradients into ``.grad`` as soon as each is computed (through
autograd's AccumulateGrad, so gradient hooks fire) and returns the input gradient. So the
memory in use at every moment is what the ILP modelled.

Random nodes (dropout) run only in the forward, in graph order, so they draw what eager
autograd draws from the same RNG state (the chain runner restores that state when it
replays a stage). Buffer updates (BatchNorm running statistics) are copied into the
stage's buffers when computed in the forward, never when recomputed in the backward.
The graph holds every cast autocast made while it was traced (hierremat.device.autocast),
so it runs with autocast off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..blocks.joint import JointGraph
from ..plans.block_options import BlockOption, ForwardOnly
from ..device.autocast import AutocastState
from .option_codegen import ForwardProgram, OptionProgram, StageBinding, generate_forward_only, generate_option


@dataclass
class OptionTape:
    """What an option's forward leaves for its backward: kept values by slot, x and y if pinned."""

    kept: list
    x: torch.Tensor | None
    y: torch.Tensor | None

    @classmethod
    def of(cls, option: BlockOption, kept: list, x: torch.Tensor, y: torch.Tensor) -> "OptionTape":
        """The tape of ``option``'s forward: x and y kept only where the option pins them."""
        return cls(kept, x if option.pins_input else None, y if option.pins_output else None)


class GeneratedOption:
    """An option's generated program (hierremat.runtime.option_codegen), made on first use:
    most options of a menu never run. Programs name parameters by placeholder, so one serves
    every stage of a signature."""

    def __init__(self, joint: JointGraph, option: BlockOption):
        self.joint = joint
        self.option = option
        self._program: OptionProgram | None = None

    @property
    def program(self) -> OptionProgram:
        if self._program is None:
            nodes = {n.name for n in self.joint.module.graph.nodes}
            for kind, name in self.option.fwd_ops + self.option.bwd_ops:
                if name not in nodes:
                    raise ValueError(f"option {self.option.name!r} names node {name!r}, which the stage's joint graph lacks")
            self._program = generate_option(self.joint, self.option, _accumulate)
        return self._program

    def modules(self) -> list:
        """The GraphModules generated so far (none before the first run)."""
        return [] if self._program is None else [self._program.forward_module, self._program.backward_module]


class OptionExecutor:
    """Runs ``option`` on ``joint`` (one stage, one output, one output gradient).

    generated: the option's program, shared with the other stages of the signature (default:
    its own); binding: the stage's parameters and buffers (default: made here)."""

    def __init__(
        self, joint: JointGraph, option: BlockOption, generated: GeneratedOption | None = None,
        binding: StageBinding | None = None,
    ):
        self.joint = joint
        self.option = option
        self.generated = generated if generated is not None else GeneratedOption(joint, option)
        self.binding = binding if binding is not None else StageBinding(joint)

    @property
    def program(self) -> OptionProgram:
        return self.generated.program

    def forward(self, x: torch.Tensor, shared: tuple) -> tuple[torch.Tensor, OptionTape]:
        """Run the forward; return the stage output and the tape for :meth:`backward`."""
        args = self.binding.args(self.program.forward_inputs, x.detach(), shared)
        with torch.no_grad(), AutocastState.off((x.device.type,)).applied():
            y, *kept = self.program.forward(args)
        return y, OptionTape.of(self.option, kept, x, y)

    def backward(self, tape: OptionTape, dy: torch.Tensor, shared: tuple) -> torch.Tensor | None:
        """Run the backward from the tape and the output gradient; return the input gradient."""
        return self.backward_with_sums(tape, dy, shared)[0]

    def backward_with_sums(self, tape: OptionTape, dy: torch.Tensor, shared: tuple, seeds: dict | None = None
                           ) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
        """:meth:`backward` of a stage that reads residents with a gradient: seeds, by shared
        position, the sums of their gradient so far (absent: none yet); returns the input
        gradient and, by shared position, the new sums (this stage's terms added)."""
        args = self.binding.args(self.program.backward_inputs, tape.x, shared, dy, tape, seeds)
        tape.kept, tape.x, tape.y = [], None, None  # the generated code frees each at its last use
        seeds = None  # (so are the seeds: the caller handed over its only reference)
        with torch.no_grad(), AutocastState.off((dy.device.type,)).applied():
            dx, *sums = self.program.backward(args)
        return dx, dict(zip(self.program.resident_grads, sums))


class GeneratedForward:
    """A stage signature's generated no-grad forward (hierremat.runtime.option_codegen), made on
    first use and shared by the stages of the signature."""

    def __init__(self, joint: JointGraph, forward: ForwardOnly):
        self.joint = joint
        self.forward = forward
        self._program: ForwardProgram | None = None

    @property
    def program(self) -> ForwardProgram:
        if self._program is None:
            self._program = generate_forward_only(self.joint, self.forward.ops)
        return self._program

    def modules(self) -> list:
        """The GraphModules generated so far (none before the first run)."""
        return [] if self._program is None else [self._program.module]


class ForwardExecutor:
    """Runs a stage's forward without grad (F_none / F_ck) as generated code: the output, nothing
    kept; buffer updates copied into the stage's buffers, random ops drawn in graph order (what
    every form of the stage's forward draws from the same RNG state)."""

    def __init__(self, generated: GeneratedForward, binding: StageBinding):
        self.generated = generated
        self.binding = binding

    def __call__(self, x: torch.Tensor, shared: tuple) -> torch.Tensor:
        program = self.generated.program
        args = self.binding.args(program.inputs, x.detach(), shared)
        with torch.no_grad(), AutocastState.off((x.device.type,)).applied():
            (y,) = program.forward(args)
        return y


def _accumulate(param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """Accumulate into ``param.grad`` through autograd's AccumulateGrad, so that gradient hooks
    (DistributedDataParallel's all-reduce, post-accumulate-grad hooks) fire as in plain training."""
    if param.requires_grad:
        torch.autograd.backward([param], [grad])
