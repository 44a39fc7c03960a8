"""Parameter gradients a training step allocates, stage by stage.

PyTorch's default ``zero_grad(set_to_none=True)`` (what Hugging Face's Trainer and most loops
call) leaves every ``.grad`` None between steps. A parameter's first gradient of the step then
becomes its ``.grad`` in the backward of the last stage that reads it (the first backward to
reach it) and stays to the end of the step; with ``.grad`` allocated (``set_to_none=False``, or
the second micro-batch of a gradient accumulation) it is added into ``.grad`` and freed. The
chain DP plans for the first case with ``ChainCosts.step_grad_bytes``; :class:`StepGrads` says,
at each call, which case holds.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


def stage_parameters(stage: Callable, model: torch.nn.Module | None = None) -> list[torch.nn.Parameter]:
    """The parameters a stage reads: those its graph reads where it says
    (hierremat.blocks.segment.GraphStage.parameter_targets), taken from ``model`` where given (the
    sharded parameters, under FSDP2), else a module's own; none for a plain callable (its
    parameters cannot be seen)."""
    if hasattr(stage, "parameter_targets") and hasattr(stage, "parameter"):
        read = stage.parameter if model is None else model.get_parameter
        return [read(target) for target in stage.parameter_targets()]
    if isinstance(stage, torch.nn.Module):
        return list(stage.parameters())
    return []


def grad_bytes(param: torch.Tensor) -> int:
    """Bytes of a parameter's gradient on this process (its local shard under FSDP2)."""
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.numel() * local.element_size()


class StepGrads:
    """Which stage's backward gives each trainable parameter its first gradient of a step.

    Built from the stages as they are; under FSDP2, from the sharded ``model`` whose parameters
    the stages read by name. :meth:`bytes` reads the parameters' ``.grad`` when it is called.
    """

    def __init__(self, stages: Sequence[Callable], model: torch.nn.Module | None = None):
        owner: dict[int, tuple[int, torch.nn.Parameter]] = {}
        for i, stage in enumerate(stages):
            for param in stage_parameters(stage, model):
                if param.requires_grad:
                    owner[id(param)] = (i, param)  # a later reader's backward runs first
        self.length = len(stages)
        self.owners = tuple(owner.values())

    def bytes(self) -> tuple[int, ...]:
        """Per stage, bytes of the gradients its backward will allocate (``.grad`` None now);
        () when there are none (every ``.grad`` allocated: ChainCosts.step_grad_bytes' "none")."""
        per_stage = [0] * self.length
        for i, param in self.owners:
            if param.grad is None:
                per_stage[i] += grad_bytes(param)
        return tuple(per_stage) if any(per_stage) else ()
