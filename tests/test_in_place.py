"""In-place pointwise operators (hierremat.variants.in_place): bitwise results, less memory."""

import pytest
import torch
from torch import nn

from hierremat.blocks.joint import overwritten_argument, run_joint, to_block_graph, trace_joint
from hierremat.blocks.node_profile import profile_nodes
from hierremat.ilp import BlockIlp
from hierremat.ilp.options import forward_only
from hierremat.variants.dropout import pack_dropout_masks
from hierremat.variants.in_place import in_place_overload, run_in_place

from models import same_bits, tiny_gpt2


class _GPT2Block(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out


def _gpt2_block():
    model = tiny_gpt2(n_layer=1, n_embd=64)
    model.train()
    return _GPT2Block(model.transformer.h[0]), torch.randn(2, 128, 64)


def _in_place_nodes(joint) -> list:
    return [n for n in joint.module.graph.nodes if overwritten_argument(n) is not None]


def _results(joint, x, tangent, seed=5):
    torch.manual_seed(seed)
    return run_joint(joint, x, (), (tangent,), apply_mutations=False)


def test_overloads_are_the_in_place_forms_of_pointwise_ops_only():
    aten = torch.ops.aten
    assert in_place_overload(aten.add.Tensor) is aten.add_.Tensor
    assert in_place_overload(aten.tanh.default) is aten.tanh_.default
    assert in_place_overload(aten.mul.Scalar) is aten.mul_.Scalar
    assert in_place_overload(aten.mm.default) is None  # not pointwise
    assert in_place_overload(aten.add_.Tensor) is None  # in place already
    assert in_place_overload(torch.ops.hierremat.masked_scale.default) is None  # not aten


def test_gpt2_block_runs_in_place_bitwise_in_less_memory():
    torch.manual_seed(0)
    block, x = _gpt2_block()
    plain = pack_dropout_masks(trace_joint(block, x))
    rewritten = run_in_place(pack_dropout_masks(trace_joint(block, x)))
    changed = _in_place_nodes(rewritten)
    phases = {rewritten.phase[n.name] for n in changed}
    assert len(changed) >= 8 and phases == {"forward", "backward"}  # GELU's chain, the mask, residuals, grads
    tangent = torch.randn(2, 128, 64)
    a, b = _results(plain, x, tangent), _results(rewritten, x, tangent)
    assert same_bits(a.outputs[0], b.outputs[0]) and same_bits(a.input_grad, b.input_grad)
    for name, grad in a.param_grads.items():
        assert same_bits(grad, b.param_grads[name]), name
    graph = to_block_graph(rewritten, profile_nodes(rewritten, x, method="flops"))
    in_place = [n for n in graph.nodes if n.in_place]
    assert {n.name for n in in_place} == {n.name for n in changed}
    assert all(n.out_bytes == 0 and n.alias_of and n.time > 0 for n in in_place)
    plain_graph = to_block_graph(plain, profile_nodes(plain, x, method="flops"))
    # the forward without grad (F_none / F_ck) adds the mask to the scores in their storage
    assert forward_only(graph).peak_bytes < forward_only(plain_graph).peak_bytes
    # no option needs more memory: the smallest peak of each kept-bytes row is no higher
    ilps = BlockIlp(plain_graph), BlockIlp(graph)
    least = int(ilps[0].solve(objective="kept", backend="highs").objective)
    for kept in (least, 4 * least):
        before, after = (ilp.solve(kept=kept, objective="peak", backend="highs") for ilp in ilps)
        assert before.optimal and after.optimal and after.objective <= before.objective


class _Reads(nn.Module):
    """Values an in-place call must not overwrite: read again, the block input, part of a storage."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x)
        again = torch.tanh(h) * h  # h is read twice
        own = torch.sigmoid(x)  # x is the caller's
        part = torch.exp(self.lin(x)[:, :8])  # a slice: half its storage
        return again + own.sum() + part.sum()


def test_values_read_again_inputs_and_slices_are_not_overwritten():
    torch.manual_seed(0)
    block, x = _Reads(), torch.randn(4, 16)
    rewritten = run_in_place(trace_joint(block, x))
    inputs = set(rewritten.module.graph.find_nodes(op="placeholder"))
    overwritten = {n.args[0] for n in _in_place_nodes(rewritten)}
    for node in rewritten.module.graph.nodes:
        if node.op == "call_function" and node.target in (
            torch.ops.aten.tanh_.default, torch.ops.aten.sigmoid_.default, torch.ops.aten.exp_.default,
        ):
            pytest.fail(f"{node.name} overwrites {node.args[0].name}")
    assert not overwritten & inputs
    plain = trace_joint(block, x)
    tangent = torch.randn(4, 16)
    a, b = _results(plain, x, tangent), _results(rewritten, x, tangent)
    assert same_bits(a.outputs[0], b.outputs[0]) and same_bits(a.input_grad, b.input_grad)


def test_profiling_an_in_place_node_times_it_on_copies():
    torch.manual_seed(0)
    block, x = _gpt2_block()
    joint = run_in_place(pack_dropout_masks(trace_joint(block, x)))
    tangent = torch.randn(2, 128, 64)
    before = _results(joint, x, tangent)
    costs = profile_nodes(joint, x, repeats=3)
    assert all(costs[n.name][0] > 0 for n in _in_place_nodes(joint))
    after = _results(joint, x, tangent)  # profiling changed nothing the graph reads
    assert same_bits(before.input_grad, after.input_grad)
