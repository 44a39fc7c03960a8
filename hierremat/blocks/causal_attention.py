"""Give captured attention back its ``is_causal=True`` when tracing materialised the causal mask.

Hugging Face models call ``scaled_dot_product_attention(q, k, v, is_causal=True)`` in eager
mode when no padding mask is given, but while tracing (``torch.export``) they cannot take
that data-dependent shortcut and pass a materialised ``[B, 1, L, S]`` causal mask instead.
The masked call is slower: on CUDA the memory-efficient kernel reads the bias and the flash
kernel is ruled out (measured on an H100, GPT-2 12-layer fp32 batch 8: attention forward
+42%, backward +44%, 4-5% of the whole step); on CPU it leaves the flash path too. So a
remat'd model would run slower than the eager model even when it keeps everything.

The rewrite is exact. A mask qualifies only when it depends on no graph input (it is a
function of the static shapes and of buffers alone), so its value at capture time is its
value at every call with these shapes; it is evaluated once and must equal the top-left
aligned lower-triangular pattern that ``is_causal=True`` means, on a square ``L == S``
score matrix, broadcast over batch and heads. Any other mask (padding, sliding window, a
mask computed from a user's ``attention_mask``) is left as it is.

Grouped-query attention takes the same detour. Without a mask, Hugging Face's SDPA
integration passes the key/value heads as they are with ``enable_gqa=True`` (when both head
dimensions are equal and at most 256, ``use_gqa_in_sdpa``); with the traced mask it repeats
them first (``repeat_kv``: unsqueeze, expand, reshape). The results agree, but not bitwise:
the kernel sums a shared head's gradient over its group in another order and, in bf16,
with other roundings. So where the mask is restored and key and value are such repeats of
``[B, Hkv, S, D]`` heads, the call gets those heads back with ``enable_gqa=True``: the call
eager mode makes.
"""

from __future__ import annotations

import logging

import torch
from torch import fx

log = logging.getLogger(__name__)

_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def ancestors(node: fx.Node) -> list[fx.Node]:
    """``node`` and its ancestors, in graph order."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]


def _input_free_ancestors(node: fx.Node) -> list[fx.Node] | None:
    """``node`` and its ancestors in graph order, or None if any of them is a graph input."""
    nodes = ancestors(node)
    return None if any(n.op == "placeholder" for n in nodes) else nodes


def _evaluate(gm: fx.GraphModule, nodes: list[fx.Node]) -> torch.Tensor | None:
    """The value of the last of ``nodes`` (an input-free subgraph of ``gm``), or None if it fails."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(env[nodes[-1]])
    try:
        with torch.no_grad():
            value = fx.GraphModule(gm, graph)()
    except Exception as err:  # an op we cannot replay here: leave the mask alone
        log.debug("could not evaluate attention mask %s: %s", nodes[-1].name, err)
        return None
    return value if isinstance(value, torch.Tensor) else None


def _is_causal_pattern(mask: torch.Tensor, length: int) -> bool:
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != (length, length):
        return False
    causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():  # additive mask: 0 where allowed, -inf (or the dtype's min) elsewhere
        if not bool(((mask == 0) | (mask <= torch.finfo(mask.dtype).min / 2)).all()):
            return False
        allowed = mask == 0
    else:
        return False
    return bool((allowed == causal).all())


def _square_scores(query: fx.Node, key: fx.Node) -> int | None:
    """L when the query and key of an SDPA call have the same sequence length L."""
    q, k = query.meta.get("val"), key.meta.get("val")
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() < 2 or k.dim() < 2:
        return None
    length = int(q.shape[-2])
    return length if int(k.shape[-2]) == length else None


_HEAD_DIM_LIMIT = 256  # the largest head dimension Hugging Face passes to SDPA with enable_gqa


def _repeated_heads(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(h, n) when ``node`` is ``repeat_kv(h, n)``: h of shape [B, Hkv, S, D] unsqueezed at dim
    2 (through no-op slices), expanded to [B, Hkv, n, S, D] and reshaped to [B, Hkv*n, S, D]."""
    if node.op != "call_function" or node.target not in (torch.ops.aten.reshape.default, torch.ops.aten.view.default):
        return None
    expand = node.args[0]
    if not isinstance(expand, fx.Node) or expand.target is not torch.ops.aten.expand.default:
        return None
    source = _through_full_slices(expand.args[0])
    if not isinstance(source, fx.Node) or source.target is not torch.ops.aten.unsqueeze.default or source.args[1] != 2:
        return None
    heads = _through_full_slices(source.args[0])
    h, e, out = (n.meta.get("val") if isinstance(n, fx.Node) else None for n in (heads, expand, node))
    if not all(isinstance(t, torch.Tensor) for t in (h, e, out)) or h.dim() != 4 or e.dim() != 5:
        return None
    batch, groups, length, dim = h.shape
    n = int(e.shape[2])
    if tuple(e.shape) != (batch, groups, n, length, dim) or tuple(out.shape) != (batch, groups * n, length, dim):
        return None
    return heads, n


def _through_full_slices(node):
    """``node`` with the ``slice`` nodes that take their whole dimension skipped (``x[:, :, None]``
    traces to such slices)."""
    while isinstance(node, fx.Node) and node.target is torch.ops.aten.slice.Tensor:
        source, out = node.args[0].meta.get("val"), node.meta.get("val")
        if not (isinstance(source, torch.Tensor) and isinstance(out, torch.Tensor) and source.shape == out.shape):
            break
        node = node.args[0]
    return node


def _grouped_heads(query: fx.Node, key: fx.Node, value: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """The key/value heads before ``repeat_kv`` when both are repeated alike and Hugging Face
    would call SDPA on them with ``enable_gqa=True``; else None."""
    k, v = _repeated_heads(key), _repeated_heads(value)
    if k is None or v is None or k[1] != v[1] or k[1] < 2:
        return None
    k_val, v_val = k[0].meta["val"], v[0].meta["val"]
    if k_val.shape[-1] != v_val.shape[-1] or k_val.shape[-1] > _HEAD_DIM_LIMIT:
        return None
    return k[0], v[0]


def _erase_if_unused(node: fx.Node) -> None:
    """Erase ``node`` and then its input-free ancestors that nothing else uses any more."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n._erased or n.users or n.op != "call_function":
            continue
        inputs = n.all_input_nodes
        n.graph.erase_node(n)
        stack.extend(inputs)


def restore_causal_attention(gm: fx.GraphModule) -> int:
    """Rewrite SDPA calls whose mask is the plain causal mask into ``is_causal=True``; returns how many."""
    rewritten, dropped_masks = 0, []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        call = node.normalized_arguments(gm, normalize_to_only_use_kwargs=True).kwargs  # the schema's names
        mask = call.get("attn_mask")
        length = _square_scores(call["query"], call["key"])
        if not isinstance(mask, fx.Node) or call.get("is_causal") or length is None:
            continue
        ancestors = _input_free_ancestors(mask)
        value = _evaluate(gm, ancestors) if ancestors is not None else None
        if value is None or not _is_causal_pattern(value, length):
            continue
        node.args = ()
        node.kwargs = {**call, "attn_mask": None, "is_causal": True}
        dropped_masks.append(mask)
        grouped = _grouped_heads(call["query"], call["key"], call["value"])
        if grouped is not None and not call.get("enable_gqa"):
            repeated = (call["key"], call["value"])
            node.kwargs = {**node.kwargs, "key": grouped[0], "value": grouped[1], "enable_gqa": True}
            dropped_masks.extend(repeated)
        rewritten += 1
    for mask in dict.fromkeys(dropped_masks):
        _erase_if_unused(mask)
    if rewritten:
        gm.recompile()
        log.debug("attention: %d scaled_dot_product_attention calls given back is_causal=True", rewritten)
    return rewritten
