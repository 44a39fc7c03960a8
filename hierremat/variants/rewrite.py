"""Replacing an operator's calls in a captured graph by a variant's (the variants' shared rewrite step)."""

from __future__ import annotations

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
