"""Give a captured attention bias back eager mode's shortcut for batches without padding.

Hugging Face models that add a learned bias to the attention scores (T5's relative position
bias) hand SDPA ``where(mask, bias, min)``, the mask built from the batch's padding mask
(``[B, 1, q, kv]``). In eager mode a batch with no padding at all skips the padding mask
(``masking_utils._ignore_bidirectional_mask_sdpa`` / ``_ignore_causal_mask_sdpa`` test
``padding_mask.all()``), so the bias reaches SDPA masked by the causal pattern alone, or not
at all: ``[1, H, q, kv]``, and SDPA's backward sums the bias gradient over the batch in fp32
before rounding it to the autocast dtype. torch.export cannot take a branch on tensor values
and keeps the ``[B, H, q, kv]`` mask, whose gradient is rounded per batch row before the sum:
equal in fp32, not bitwise under bf16 autocast.

:func:`restore_unpadded_bias_masks` puts the branch back into the captured graph. A
``where(cond, bias, fill)`` whose ``bias`` depends on a trained parameter and is broadcast over
the batch, and whose ``cond`` is computed from the padding-mask inputs (placeholders named
``*attention_mask``, Hugging Face's names) and from no other input, becomes
``masked_bias(cond, first_row_unpadded, bias, fill, *masks)``: ``first_row_unpadded`` is the
same computation on all-ones masks, first batch row (the causal pattern, or all true). At run
time it takes that one when every mask is all ones, as eager mode does. The all-ones test is
also part of the key plans are cached under (:func:`padding_key`, hierremat.api.whole_model), so a
plan runs the branch it was profiled with. A stage holding such a branch runs as autograd runs
it (no block options: their graphs are traced, and a trace cannot branch on values).
"""

from __future__ import annotations

import inspect

import torch
from torch import fx

from .rewrite import replace_calls
from .causal_attention import ancestors


#: Inputs whose name ends so are padding masks (Hugging Face: attention_mask, decoder_attention_mask, ...).
MASK_SUFFIX = "attention_mask"

_WHERE = (torch.ops.aten.where.self, torch.ops.aten.where.ScalarOther)


def masked_bias(cond: torch.Tensor, first_row_unpadded: torch.Tensor, bias: torch.Tensor, fill, *masks: torch.Tensor):
    """``where(cond, bias, fill)``; when every padding mask is all ones (no padding in the batch, eager
    mode's test), ``where(first_row_unpadded, bias, fill)``: the bias masked as eager mode masks it."""
    if all(bool(m.all()) for m in masks):
        return torch.where(first_row_unpadded, bias, fill)
    return torch.where(cond, bias, fill)


def padding_key(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
    """Which padding-mask arguments of ``model(*args, **kwargs)`` are all ones, by name, passed by
    keyword or by position: part of the key a plan is cached under."""
    named = dict(kwargs)
    try:
        signature = inspect.signature(model.forward)
        bound = signature.bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):  # no signature to bind to: the keyword arguments only
        bound = {}
    for name, value in bound.items():
        if signature.parameters[name].kind is not inspect.Parameter.VAR_KEYWORD:  # (those are in kwargs)
            named[name] = value
    return tuple(
        (name, bool(value.all())) for name, value in sorted(named.items())
        if name.endswith(MASK_SUFFIX) and isinstance(value, torch.Tensor)
    )


def has_value_branch(gm: fx.GraphModule) -> bool:
    """Whether the graph holds a :func:`masked_bias` (a branch on tensor values: not traceable)."""
    return any(n.op == "call_function" and n.target is masked_bias for n in gm.graph.nodes)


def _trained(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` depends on a parameter that requires grad."""
    params = dict(gm.named_parameters())
    return any(n.op == "get_attr" and n.target in params and params[n.target].requires_grad for n in ancestors(node))


def _batch_broadcast(node: fx.Node, cond: fx.Node, bias: fx.Node) -> bool:
    vals = [n.meta.get("val") for n in (node, cond, bias)]
    if not all(isinstance(v, torch.Tensor) and v.dim() >= 1 for v in vals):
        return False
    out, cond_val, bias_val = vals
    return out.dim() == bias_val.dim() == cond_val.dim() and bias_val.shape[0] == 1 < out.shape[0] == cond_val.shape[0]


def _unpadded_first_row(gm: fx.GraphModule, cond: fx.Node, masks: list[fx.Node], before: fx.Node) -> fx.Node:
    """Nodes computing ``cond`` on all-ones masks, its first batch row, inserted before ``before``."""
    graph = gm.graph
    computed = ancestors(cond)
    depends = set(masks)
    for n in computed:
        if any(a in depends for a in n.all_input_nodes):
            depends.add(n)
    # the new nodes belong to the module of the node they feed (segmentation reads the stack)
    stack = {"nn_module_stack": before.meta["nn_module_stack"]} if "nn_module_stack" in before.meta else {}
    env: dict[fx.Node, fx.Node] = {}
    with graph.inserting_before(before):
        for m in masks:
            env[m] = graph.call_function(torch.ops.aten.ones_like.default, (m,))
            env[m].meta = {**m.meta, **stack}
        for n in computed:
            if n in depends and n not in env:
                env[n] = graph.node_copy(n, lambda a: env.get(a, a))
                env[n].meta = {**n.meta, **stack}
        first = graph.call_function(torch.ops.aten.slice.Tensor, (env[cond], 0, 0, 1))
    first.meta = {**stack, "val": cond.meta["val"][:1]}
    return first


def restore_unpadded_bias_masks(gm: fx.GraphModule) -> int:
    """Rewrite each attention-bias mask of the kind the module docstring describes; returns how many."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    masks = [p for p in placeholders if p.name.endswith(MASK_SUFFIX)]
    if not masks:
        return 0

    def arguments(node: fx.Node, gm: fx.GraphModule) -> tuple | None:
        if len(node.args) != 3:
            return None
        cond, bias, fill = node.args
        if not isinstance(cond, fx.Node) or not isinstance(bias, fx.Node) or not _batch_broadcast(node, cond, bias):
            return None
        inputs = [n for n in ancestors(cond) if n.op == "placeholder"]
        if not inputs or any(p not in masks for p in inputs) or not _trained(gm, bias):
            return None
        return (cond, _unpadded_first_row(gm, cond, inputs, node), bias, fill, *inputs)

    return replace_calls(gm, _WHERE, masked_bias, arguments, "attention bias masks given eager mode's shortcut")
