"""Dropout with a packed mask, and an output that can be recomputed (MONeT's dropout variant).

In a traced joint graph, ``native_dropout(x, p, True)`` is one random operator with two
results, the output and a bool mask (1 byte per element); its backward
``native_dropout_backward(grad, mask, scale)`` reads the mask. Random operators are never
recomputed, and the block ILP keeps or frees an operator's results together, so a block
option must keep the output (4 bytes per element in fp32) or recompute nothing after it.

:func:`pack_dropout_masks` rewrites each such dropout into

* ``bits = hierremat.dropout_bits(x, p)``: the random draw alone, its mask packed to one bit
  per element (the same random numbers ``native_dropout`` draws);
* ``out = hierremat.masked_scale(x, bits, 1 / (1 - p))``: deterministic, so the ILP may free
  it and recompute it from ``x`` and the kept bits;
* ``hierremat.masked_scale(grad, bits, scale)`` for the backward.

Every result is bitwise what the original ops give (tests/test_variants.py), so gradients
do not change; the mask costs 1/8 of its bool bytes (1/32 of an fp32 output), and an
attention block whose ``x`` (the softmax) is kept anyway need not keep the dropout's output.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch import fx

from ...plans.block_graph import BACKWARD, FORWARD
from ...ops import packed_bits
from ..rewrite import joint_after_rewrite

log = logging.getLogger(__name__)

_NATIVE_DROPOUT = torch.ops.aten.native_dropout.default
_DROPOUT_BACKWARD = torch.ops.aten.native_dropout_backward.default


def _results(node: fx.Node) -> dict[int, fx.Node] | None:
    """getitem index -> node for a multi-output node, or None if something else reads it."""
    results = {}
    for user in node.users:
        if user.target is not operator.getitem or user.args[1] in results:
            return None
        results[user.args[1]] = user
    return results


def pack_dropout_masks(joint):
    """``joint`` (a hierremat.blocks.joint.JointGraph) with every training-mode
    ``native_dropout`` whose mask only its backward reads rewritten as described above
    (in place in ``joint.module``); returns the updated JointGraph."""
    gm = joint.module
    phase = dict(joint.phase)
    renamed: dict[str, str] = {}
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _NATIVE_DROPOUT or phase.get(node.name) != FORWARD:
            continue
        x, p, train = (list(node.args) + [None, None])[:3]
        results = _results(node)
        if train is not True or not isinstance(p, float) or not 0.0 < p < 1.0 or not results or 1 not in results:
            continue
        mask = results[1]
        backwards = list(mask.users)
        if not backwards or any(u.target is not _DROPOUT_BACKWARD or u.args[1] is not mask for u in backwards):
            continue
        x_val = x.meta["val"]
        scale = 1.0 / (1.0 - p)  # native_dropout's own scale (in double, as its kernel computes it)
        with x_val.fake_mode:
            bits_val = torch.ops.hierremat.dropout_bits(x_val, p)
        graph = gm.graph
        with graph.inserting_before(node):
            bits = graph.call_function(torch.ops.hierremat.dropout_bits.default, (x, p))
            bits.meta = {**node.meta, "val": bits_val}
            phase[bits.name] = FORWARD
            if 0 in results:
                out = graph.call_function(torch.ops.hierremat.masked_scale.default, (x, bits, scale))
                out.meta = {**results[0].meta}
                phase[out.name] = FORWARD
                results[0].replace_all_uses_with(out)
                renamed[results[0].name] = out.name
        for backward in backwards:
            grad, _, backward_scale = backward.args
            with graph.inserting_before(backward):
                new = graph.call_function(torch.ops.hierremat.masked_scale.default, (grad, bits, backward_scale))
            new.meta = {**backward.meta}
            phase[new.name] = BACKWARD
            backward.replace_all_uses_with(new)
            renamed[backward.name] = new.name
            graph.erase_node(backward)
            del phase[backward.name]
        for result in results.values():
            graph.erase_node(result)
            phase.pop(result.name, None)
        graph.erase_node(node)
        del phase[node.name]
        rewritten += 1
    if not rewritten:
        return joint
    packed_bits.load_cpu_kernels()
    log.debug("%d dropout(s) with packed masks", rewritten)
    return joint_after_rewrite(joint, phase, renamed)
