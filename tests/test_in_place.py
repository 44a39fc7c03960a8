"""In-place operators (hierremat.blocks.variants.in_place): bitwise results, less memory."""

import pytest
import torch
from torch import nn

from hierremat.blocks.joint import overwritten_argument, run_joint, to_block_graph, trace_joint
from hierremat.runtime.node_profile import profile_nodes
from hierremat.ilp import BlockIlp
from hierremat.ilp.options import forward_only
from hierremat.blocks.variants.dropout import pack_dropout_masks
from hierremat.blocks.variants.relu_masks import pack_relu_masks
from hierremat.blocks.variants.in_place import functional_joint, in_place_overload, out_overload, run_in_place

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


def test_out_overloads_of_pointwise_and_row_wise_ops_only():
    aten, ours = torch.ops.aten, torch.ops.hierremat
    assert out_overload(aten.gelu_backward.default) == (aten.gelu_backward.grad_input, "grad_input")
    assert out_overload(aten.add.Tensor) == (aten.add.out, "out")
    assert out_overload(aten.mul.Scalar) == (aten.mul.Scalar_out, "out")
    assert out_overload(aten._softmax_backward_data.default) == (aten._softmax_backward_data.out, "grad_input")
    assert out_overload(ours.masked_scale.default) == (ours.masked_scale.out, "out")
    assert out_overload(ours.where_bits.default) == (ours.where_bits.out, "out")
    assert out_overload(aten.mm.default) is None  # not pointwise: its output may not be an input
    assert out_overload(aten._softmax.default) is None
    assert out_overload(aten.add.out) is None


def test_gpt2_block_runs_in_place_bitwise_in_less_memory():
    torch.manual_seed(0)
    block, x = _gpt2_block()
    plain = pack_dropout_masks(trace_joint(block, x))
    rewritten = run_in_place(pack_dropout_masks(trace_joint(block, x)))
    changed = _in_place_nodes(rewritten)
    phases = {rewritten.phase[n.name] for n in changed}
    assert len(changed) >= 8 and phases == {"forward", "backward"}  # GELU's chain, the mask, residuals, grads
    # backward kernels write over the gradient they read: attention's dropout and softmax, GELU's tanh
    written = {n.target for n in changed}
    aten, ours = torch.ops.aten, torch.ops.hierremat
    assert {aten._softmax_backward_data.out, ours.masked_scale.out, aten.tanh_backward.grad_input} <= written
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
    # keeping what it likes, the block's backward peaks lower: attention's gradient steps
    before, after = (ilp.solve(kept=10**12, objective="peak", backend="highs").objective for ilp in ilps)
    assert after < 0.95 * before
    # what Inductor compiles is the functional graph again
    functional = functional_joint(rewritten)
    assert not any(overwritten_argument(n) is not None for n in functional.module.graph.nodes)
    c = _results(functional, x, tangent)
    assert same_bits(a.input_grad, c.input_grad)


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


def test_activation_backwards_write_over_their_gradient_bitwise():
    """Each activation's backward kernel writes the input gradient over the output gradient it
    reads (its out= form); the ReLU's from a packed mask too (hierremat::where_bits.out). Every
    overwritten backward value has no reader after the call."""
    torch.manual_seed(0)
    block = nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.SiLU(), nn.Linear(32, 32), nn.Sigmoid(),
        nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 16),
    )
    x, tangent = torch.randn(8, 16), torch.randn(8, 16)
    plain = pack_relu_masks(trace_joint(block, x))
    rewritten = run_in_place(pack_relu_masks(trace_joint(block, x)))
    aten = torch.ops.aten
    written = {n.target for n in _in_place_nodes(rewritten)}
    assert {aten.gelu_backward.grad_input, aten.silu_backward.grad_input, aten.sigmoid_backward.grad_input,
            aten.tanh_backward.grad_input, torch.ops.hierremat.where_bits.out} <= written
    order = {n: i for i, n in enumerate(rewritten.module.graph.nodes)}
    for node in _in_place_nodes(rewritten):
        readers = set(overwritten_argument(node).users) - {node}
        assert all(order[r] < order[node] for r in readers), node.name
        assert not readers or rewritten.phase[node.name] == "backward", node.name
    a, b = _results(plain, x, tangent), _results(rewritten, x, tangent)
    assert same_bits(a.outputs[0], b.outputs[0]) and same_bits(a.input_grad, b.input_grad)
    for name, grad in a.param_grads.items():
        assert same_bits(grad, b.param_grads[name]), name


def test_values_read_again_inputs_and_slices_are_not_overwritten():
    torch.manual_seed(0)
    block, x = _Reads(), torch.randn(4, 16)
    rewritten = run_in_place(trace_joint(block, x))
    inputs = set(rewritten.module.graph.find_nodes(op="placeholder"))
    overwritten = {overwritten_argument(n) for n in _in_place_nodes(rewritten)}
    for node in rewritten.module.graph.nodes:
        if node.op == "call_function" and node.target in (
            torch.ops.aten.tanh_.default, torch.ops.aten.sigmoid_.default, torch.ops.aten.exp_.default,
            torch.ops.aten.tanh.out, torch.ops.aten.sigmoid.out, torch.ops.aten.exp.out,
        ):
            pytest.fail(f"{node.name} overwrites {overwritten_argument(node).name}")
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


class _ReadsResident(nn.Module):
    """``head(h + x * mask)`` with ``h`` a resident read with a gradient: its gradient sum is
    seeded_add(seed, term), which returns the term itself when there is no sum yet."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, 16)

    def forward(self, x, h, mask):
        return self.head(h + x * mask)


def test_a_resident_gradient_sum_is_never_overwritten_by_a_later_call():
    """The backward term of ``h`` (the head's input gradient) is also the input gradient's
    factor: ``mul(term, mask)`` may not write over the term, which seeded_add returned as the
    sum itself where there was no sum yet (that overwrote the resident's gradient)."""
    torch.manual_seed(0)
    block, x, h = _ReadsResident(), torch.randn(4, 16), torch.randn(4, 16)
    mask = (torch.randn(4, 1) > 0).float()
    plain = trace_joint(block, x, (h, mask), resident_grads=(0,))
    rewritten = run_in_place(trace_joint(block, x, (h, mask), resident_grads=(0,)))
    overwritten = {overwritten_argument(n) for n in _in_place_nodes(rewritten)}
    for node in rewritten.module.graph.nodes:
        if node.op == "call_function" and not isinstance(node.target, torch._ops.OpOverload):
            assert not overwritten & set(node.all_input_nodes), node.name
    tangent = torch.randn(4, 16)
    runs = [run_joint(j, x, (h, mask), (tangent,), apply_mutations=False, seeds={0: None}) for j in (plain, rewritten)]
    assert same_bits(runs[0].resident_grads[0], runs[1].resident_grads[0])
    assert same_bits(runs[0].input_grad, runs[1].input_grad)
