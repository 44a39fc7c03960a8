"""Replacing an operator's calls in a captured graph by a variant's (the variants' shared rewrite step)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from torch import fx

log = logging.getLogger(__name__)


def replace_calls(gm: fx.GraphModule, targets, replacement: Callable, arguments: Callable, what: str) -> int:
    """Replace, in place, every call of one of ``targets`` (an operator, or a set of them) in
    ``gm`` for which ``arguments(node, gm)`` gives the replacement's arguments (a tuple; None
    leaves the call alone; it may insert nodes before ``node``) by a call of ``replacement``
    with the node's metadata; returns how many (logged with ``what``)."""
    targets = targets if isinstance(targets, (set, frozenset, tuple)) else (targets,)
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in targets:
            continue
        args = arguments(node, gm)
        if args is None:
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(replacement, args)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.recompile()
        log.debug("%s: %d call(s) rewritten", what, rewritten)
    return rewritten


def joint_after_rewrite(joint, phase: dict, renamed: dict):
    """``joint`` (a hierremat.blocks.joint.JointGraph) after a rewrite of its module's graph in
    place: the module recompiled, the phases of the graph's nodes (``phase``: name -> phase, new
    nodes included) in graph order, and every name the JointGraph gives renamed by ``renamed``
    (old -> new)."""
    joint.module.recompile()
    rename = lambda name: renamed.get(name, name)
    return dataclasses.replace(
        joint,
        phase={n.name: phase[n.name] for n in joint.module.graph.nodes if n.op == "call_function"},
        output_names=tuple(rename(n) for n in joint.output_names),
        input_grad_name=rename(joint.input_grad_name),
        param_grad_names={k: rename(v) for k, v in joint.param_grad_names.items()},
        mutations=tuple((rename(n), t) for n, t in joint.mutations),
        resident_grads={k: rename(v) for k, v in joint.resident_grads.items()},
    )
