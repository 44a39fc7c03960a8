"""One stage of a model's chain, as hierremat cuts it, with the input it receives (test helper)."""

from __future__ import annotations

from torch import nn

from hierremat.blocks.capture import capture
from hierremat.blocks.segment import build_chain_graph
from hierremat.planning.stage_calls import stage_inputs
from hierremat.api.planned_shape import chain_inputs


def stage_of(model: nn.Module, args: tuple, kwargs: dict, name: str):
    """(stage, its input x, the shared values) of the stage called ``name`` (e.g. "transformer.h.0")."""
    chain = build_chain_graph(capture(model, args, kwargs), model)
    x0, shared = chain_inputs(chain, args, kwargs)
    i = [info.name for info in chain.infos].index(name)
    return chain.stages[i], stage_inputs(chain.stages, x0, tuple(shared))[i].detach(), tuple(shared)
