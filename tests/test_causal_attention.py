"""Captured attention gets is_causal=True back only where the traced mask is exactly the causal one."""

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hierremat.blocks.capture import capture

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _sdpa_calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is SDPA]


def _mask_and_causal(node):
    call = node.normalized_arguments(node.graph.owning_module, normalize_to_only_use_kwargs=True).kwargs
    return call.get("attn_mask"), call.get("is_causal", False)


class MaskedAttention(nn.Module):
    """Attention with a mask made from shapes alone (as traced Hugging Face models do)."""

    def __init__(self, kind: str, dim: int = 16):
        super().__init__()
        self.kind = kind
        self.qkv = nn.Linear(dim, 3 * dim)

    def mask(self, length: int, device) -> torch.Tensor:
        i = torch.arange(length, device=device)
        if self.kind == "bool_causal":
            return (i[None, :] <= i[:, None])[None, None]
        if self.kind == "float_causal":
            allowed = i[None, :] <= i[:, None]
            return torch.zeros(length, length, device=device).masked_fill(~allowed, float("-inf"))[None, None]
        if self.kind == "strict_past":  # not the causal pattern: the diagonal is masked too, except row 0
            return ((i[None, :] < i[:, None]) | (i[None, :] == 0))[None, None]
        raise ValueError(self.kind)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(x.shape[1], x.device), dropout_p=0.0)
        return out.transpose(1, 2).flatten(2)


@pytest.mark.parametrize("kind", ["bool_causal", "float_causal"])
def test_materialised_causal_mask_becomes_is_causal_and_outputs_match(kind):
    torch.manual_seed(0)
    model = MaskedAttention(kind)
    x = torch.randn(2, 12, 16)
    captured = capture(copy.deepcopy(model), (x,))
    (call,) = _sdpa_calls(captured.module)
    mask, is_causal = _mask_and_causal(call)
    assert mask is None and is_causal is True
    torch.testing.assert_close(captured.module(x), model(x), rtol=0, atol=0)


def test_other_constant_masks_are_left_alone():
    model = MaskedAttention("strict_past")
    x = torch.randn(2, 12, 16)
    captured = capture(model, (x,))
    (call,) = _sdpa_calls(captured.module)
    mask, is_causal = _mask_and_causal(call)
    assert mask is not None and not is_causal


def test_gpt2_runs_causal_attention_without_a_mask_and_keeps_a_padding_mask():
    pytest.importorskip("transformers")
    from models import tiny_gpt2

    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2)
    ids = torch.randint(0, 256, (2, 32))
    captured = capture(model, (ids,), {"labels": ids, "use_cache": False})
    calls = _sdpa_calls(captured.module)
    assert len(calls) == 2 and all(_mask_and_causal(c) == (None, True) for c in calls)
    torch.manual_seed(1)
    got = captured.module(ids, labels=ids, use_cache=False).loss
    torch.manual_seed(1)
    want = model(ids, labels=ids, use_cache=False).loss
    torch.testing.assert_close(got, want, rtol=0, atol=0)

    padding = torch.ones(2, 32, dtype=torch.long)
    padding[1, 24:] = 0
    captured = capture(model, (ids,), {"attention_mask": padding, "labels": ids, "use_cache": False})
    assert all(_mask_and_causal(c)[0] is not None for c in _sdpa_calls(captured.module))
