"""Whether a stage's joint graph traced under autocast replays eager autocast's gradients bitwise.

Under autocast, joint graphs are traced with the forward under the caller's setting, so
every cast autocast makes (weights included) is an explicit node of the graph, and options
run with autocast off (hierremat.device.autocast).
"""

from __future__ import annotations

import torch

from ..plans.block_graph import FORWARD
from ..blocks.joint import JointGraph, trace_joint
from ..device.autocast import AutocastState

#: Device types where a block's graph traced under autocast, replayed, is known to give eager autocast's gradients
#: bitwise (tests/test_mixed_precision.py). Not CUDA yet: the 1e-4 gap of block options under bf16 autocast on an H200
#: was their compiled form's (compile="auto" compiled them; Inductor keeps fp32 between fused ops:
#: benchmarks/bits_by_op.py, where every eager op of the step gave plain's bits), and "auto" no longer compiles in
#: bf16 or fp16 (planning.chain_plan.resolve_compile); eager block options under autocast have not run on a GPU,
#: so there stages keep option 0 (recomputed whole, eagerly: test_cuda_bf16_autocast_within_budget passes so).
#: ``bits_by_op.py --replayed-under-autocast`` on a GPU says whether CUDA can join.
AUTOCAST_EXACT_DEVICE_TYPES = ("cpu",)


class BackwardRecipeUnknown(ValueError):
    """A stage whose backward autocast changes, planned before the caller's recipe is known."""


def exact_under_autocast(
    joint: JointGraph, stage, x: torch.Tensor, shared: tuple, input_grad: bool, autocast: AutocastState,
    resident_grads: tuple[int, ...] = (), backward_autocast: bool | None = None,
) -> None:
    """Raise ValueError where ``joint``, traced under autocast for the caller's recipe ``backward_autocast``,
    cannot reproduce eager autocast bitwise.

    * A parameter cast more than once: eager autocast casts it once per context and sums its
      low-precision gradients before casting them back; the traced graph casts per use.
    * A backward that autocast changes: eager runs the backward under autocast when one
      context spans forward and backward, and without it when the context closed after the
      forward (the recipe of torch's AMP docs). Tracing it the first way can give another graph
      (on CPU, attention with dropout runs SDPA's math path, whose fp32 matmuls autocast casts in
      the backward): then the stage's gradients depend on the recipe. ``backward_autocast`` True
      or False: the caller's backward runs under autocast or outside it, and ``joint`` was traced
      so; None: not known yet (``joint`` traced the second way), BackwardRecipeUnknown where the
      two graphs differ (the runtime sees the recipe at the first backward: hierremat.runtime.executor).
    """
    recast = params_cast_more_than_once(joint)
    if recast:
        raise ValueError(f"autocast casts parameter(s) {', '.join(recast)} more than once")
    if backward_autocast is not None:
        return
    under = trace_joint(stage, x, shared, input_requires_grad=input_grad, autocast=autocast,
                        backward_under_autocast=True, resident_grads=resident_grads)
    if under.module.code != joint.module.code:
        raise BackwardRecipeUnknown(
            "autocast would change its backward when one context spans forward and backward, and the caller's recipe "
            "is not known yet (seen at the first backward)"
        )


def params_cast_more_than_once(joint: JointGraph) -> list[str]:
    """Parameters that more than one forward ``_to_copy`` node of the joint graph reads."""
    casts: dict[str, int] = {}
    for node in joint.module.graph.find_nodes(op="call_function", target=torch.ops.aten._to_copy.default):
        source = node.args[0]
        if joint.phase.get(node.name) == FORWARD and isinstance(source, torch.fx.Node):
            target = joint.param_inputs.get(source.name)
            if target is not None:
                casts[target] = casts.get(target, 0) + 1
    return sorted(name for name, count in casts.items() if count > 1)
