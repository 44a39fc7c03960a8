"""ReLU's backward from a 1-bit mask, as a choice the block ILP makes (MONeT's ReLU variant).

In a traced joint graph, ReLU's backward is ``threshold_backward(grad, out, 0)``: it reads
the ReLU's output (4 bytes per element in fp32) only to know where it is positive.
:func:`pack_relu_masks` rewrites every ``threshold_backward`` whose ``self`` is a forward
value into

* ``bits = hierremat.above_bits(out, threshold)`` in the forward, right after ``out``: the
  mask packed to one bit per element (1/32 of an fp32 output);
* ``hierremat.where_bits(grad, bits)`` in the backward, bitwise ``threshold_backward``.

The rewrite costs one pass over ``out`` in the forward and leaves the choice to the ILP (Shah et al., "Memory
optimization for deep networks", ICLR 2021, choose per operator between a backward
from the output and one from a packed mask): ``bits`` is a forward value like any other,
so an option may keep it (and free or never recompute ``out`` where nothing else reads it:
a ResNet block's last ReLU, whose output only the next block reads) or recompute it at
the backward from an ``out`` that is present anyway (a pass over ``out``, no bytes kept).
The forward computes ``bits`` once in every option; the profile charges it (on CPU the C++
kernel takes about three times a ReLU).
"""

from __future__ import annotations

import logging

import torch
from torch import fx

from ...plans.block_graph import BACKWARD, FORWARD
from ...ops import packed_bits
from ..rewrite import joint_after_rewrite

log = logging.getLogger(__name__)

_THRESHOLD_BACKWARD = torch.ops.aten.threshold_backward.default
_DETACH = torch.ops.aten.detach.default


def _forward_value(node: fx.Node, phase: dict) -> tuple[fx.Node, list[fx.Node]] | None:
    """The forward node whose value ``node`` is, through detaches, and the detaches passed;
    None unless that is a forward operator's result."""
    detaches = []
    while node.op == "call_function" and node.target is _DETACH:
        detaches.append(node)
        node = node.args[0]
    if node.op != "call_function" or phase.get(node.name) != FORWARD:
        return None
    return node, detaches


def pack_relu_masks(joint):
    """``joint`` (a hierremat.blocks.joint.JointGraph) with every backward
    ``threshold_backward(grad, self, threshold)`` whose ``self`` is a floating forward value
    of grad's shape rewritten as described above (in place in ``joint.module``); returns the
    updated JointGraph."""
    graph = joint.module.graph
    phase = dict(joint.phase)
    renamed: dict[str, str] = {}
    bits_of: dict[tuple[str, float], fx.Node] = {}
    passed: list[fx.Node] = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _THRESHOLD_BACKWARD or phase.get(node.name) != BACKWARD:
            continue
        grad, self_, threshold = node.args
        found = _forward_value(self_, phase)
        if found is None or not isinstance(threshold, (int, float)) or isinstance(threshold, bool):
            continue
        value, detaches = found
        value_val, grad_val = value.meta.get("val"), grad.meta.get("val")
        if not isinstance(value_val, torch.Tensor) or not isinstance(grad_val, torch.Tensor):
            continue
        if not value_val.is_floating_point() or value_val.shape != grad_val.shape:
            continue
        key = (value.name, float(threshold))
        if key not in bits_of:
            with value_val.fake_mode:
                bits_val = torch.ops.hierremat.above_bits(value_val, float(threshold))
            with graph.inserting_after(value):
                bits = graph.call_function(torch.ops.hierremat.above_bits.default, (value, float(threshold)))
            bits.meta = {**value.meta, "val": bits_val}
            phase[bits.name] = FORWARD
            bits_of[key] = bits
        with graph.inserting_before(node):
            new = graph.call_function(torch.ops.hierremat.where_bits.default, (grad, bits_of[key]))
        new.meta = {**node.meta}
        phase[new.name] = BACKWARD
        node.replace_all_uses_with(new)
        renamed[node.name] = new.name
        graph.erase_node(node)
        del phase[node.name]
        passed += detaches
    if not bits_of:
        return joint
    for detach in passed:  # detaches that only the rewritten backwards read, outermost first
        if detach.name in phase and not detach.users:
            graph.erase_node(detach)
            del phase[detach.name]
    packed_bits.load_cpu_kernels()
    log.debug("%d ReLU backward(s) from packed masks", len(renamed))
    return joint_after_rewrite(joint, phase, renamed)
