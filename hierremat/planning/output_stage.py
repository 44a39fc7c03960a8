"""The model's last stage in another form, as an option of the chain DP: the fused LM head.

The chain's last stage returns the model's outputs (often several), so it gets no block-ILP
menu: option 0, the stage under autograd, is all it offers. Where its graph computes a
linear head and a cross-entropy that nothing else reads (a model that returns only its
loss, or ``outputs="loss"``), it also offers option 1: the same graph with the head fused
with the loss (hierremat.ops.linear_cross_entropy), which never materializes the
logits and computes the head's matmul once more in the backward. Option 1 runs under
autograd too (the fused op has its own backward), its costs are measured as option 0's
are, and the chain DP picks between the two by budget.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable

import torch
from torch import fx

from ..blocks.segment import GraphStage
from ..plans.costs import OptionCosts
from ..runtime.executor import as_tuple, check_stage_output, detach_output, gradient_edges
from ..runtime.grad_taps import backward_through, tap_input
from ..runtime.profile import profile_stage
from ..runtime.stage_cost_cache import StageCostCache
from ..plans.sequential_plan import NAMED_OPTIONS
from ..blocks.variants.linear_cross_entropy import fuse_linear_cross_entropy

log = logging.getLogger(__name__)

#: The name of the fused head's option in a plan (StageCosts.options[1].name of the last stage).
FUSED_HEAD = NAMED_OPTIONS[0]


def fused_head_stage(stage) -> GraphStage | None:
    """``stage`` (the chain's last) with its LM head fused with the loss, or None where the
    fused head does not apply (see hierremat.ops.linear_cross_entropy)."""
    if not isinstance(stage, GraphStage):
        return None
    gm = stage.graph_module
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    fused = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    if not fuse_linear_cross_entropy(fused):
        return None
    return GraphStage(fused, stage.shared_indices, stage.stage_name)


class AutogradStageExecutor:
    """Runs a stage in another form (a callable) under autograd, with a block option's interface
    (hierremat.runtime.block_exec.OptionExecutor): the forward returns the output and a tape of
    the output's gradient edges and the input's gradient sink; the backward backpropagates."""

    def __init__(self, stage, index: int, last: bool):
        self.stage = stage
        self.index = index
        self.last = last

    def forward(self, x: torch.Tensor, shared: tuple):
        anchor = torch.empty(0, device=x.device, requires_grad=True)
        inp, sink = tap_input(x, anchor)
        with torch.enable_grad():
            out = check_stage_output(self.index, self.stage, self.stage(inp, *shared), self.last)
        del inp
        tape = (gradient_edges(out), sink)
        return detach_output(out), tape

    def backward(self, tape, grad, shared: tuple) -> torch.Tensor | None:
        edges, sink = tape
        backward_through(edges, as_tuple(grad))
        return sink.grad


def fused_head_option(
    stages, x: torch.Tensor, shared: tuple, signature: str, cost_cache: StageCostCache,
    make: Callable = fused_head_stage,
) -> tuple[OptionCosts, tuple[bool, ...], AutogradStageExecutor] | None:
    """The last stage's fused-head option: (its costs, the output gradient mask they were
    measured with, its executor), or None where the fused head does not apply. Costs come
    from the cache under ``signature`` when measured before. make: the fused stage of the last stage, or None
    (:func:`fused_head_stage`; its family's, made once: hierremat.planning.family_programs)."""
    index = len(stages) - 1
    fused = make(stages[index])
    if fused is None:
        return None
    requires_grad = index > 0 or x.requires_grad
    key = f"{signature}+{FUSED_HEAD}"
    cached = cost_cache.get_stage(key, x, requires_grad, None)
    if cached is not None and cached[1] is not None:
        costs, mask, _ = cached
    else:
        costs, mask = profile_stage(index, fused, x, shared, last=True, requires_grad=requires_grad)
        cost_cache.put_stage(key, x, requires_grad, None, costs, mask)
    log.info("the output stage also offers its LM head fused with the loss (the logits never exist whole)")
    return replace(costs.options[0], name=FUSED_HEAD), mask, AutogradStageExecutor(fused, index, last=True)
