"""Joint forward+backward ATen graphs of single stages (hierremat.blocks.joint, node_profile).

Stages come from hierremat's own capture + segmentation of: a 2-layer GPT-2 (dropout
active: attention-probability and residual dropout), a ResNet-style CNN (BatchNorm in
training mode, ReLU, residual) and a chain of MLP blocks with dropout.
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
from torch import nn

from hierremat.plans.block_graph import BACKWARD, FORWARD, BlockGraph
from hierremat.blocks.joint import (
    is_view_node, run_joint, saved_for_backward, storage_layout, to_block_graph, trace_joint,
)
from hierremat.runtime.node_profile import profile_nodes

from models import TinyResNet, tiny_gpt2
from stages import stage_of


class MLPBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(self.drop(self.act(self.fc1(self.norm(x)))))


def mlp_model(width: int = 32) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), MLPBlock(width), MLPBlock(width), nn.Linear(width, 10))


def _build(kind: str, device: str = "cpu"):
    torch.manual_seed(0)
    if kind == "gpt2":
        model = tiny_gpt2(n_layer=2).to(device)
        ids = torch.randint(0, 256, (2, 32), device=device)
        return stage_of(model, (ids,), {"labels": ids, "use_cache": False}, "transformer.h.0")
    if kind == "resnet":
        model = TinyResNet().to(device)
        return stage_of(model, (torch.randn(4, 3, 16, 16, device=device),), {}, "layer2.0")
    model = mlp_model().to(device)
    return stage_of(model, (torch.randn(64, 32, device=device),), {}, "1")


#: (forward, backward) node count ranges that a correct trace falls in.
PLAUSIBLE = {"gpt2": ((50, 120), (60, 140)), "resnet": ((15, 50), (10, 50)), "mlp": ((10, 40), (10, 50))}
KINDS = list(PLAUSIBLE)


@pytest.fixture(scope="module")
def traced():
    cache = {}

    def get(kind):
        if kind not in cache:
            stage, x, shared = _build(kind)
            cache[kind] = (stage, x, shared, trace_joint(stage, x, shared))
        return cache[kind]

    return get


def _eager(stage, x, shared, dy, seed):
    xr = x.detach().requires_grad_()
    params = dict(stage.named_parameters())
    torch.manual_seed(seed)
    y = stage(xr, *shared)
    grads = torch.autograd.grad(y, [xr, *params.values()], dy)
    return y.detach(), grads[0], dict(zip(params, grads[1:]))


def _check_against_autograd(stage, x, shared, joint, seed=123, rtol=1e-5, atol=1e-6):
    (tangent,) = joint.tangent_names.values()
    meta = next(n for n in joint.placeholders() if n.name == tangent).meta["val"]
    torch.manual_seed(seed + 1)
    dy = torch.randn(meta.shape, dtype=meta.dtype, device=x.device)
    buffers0 = {k: v.clone() for k, v in stage.named_buffers()}

    y, dx, dparams = _eager(stage, x, shared, dy, seed)
    buffers_eager = {k: v.clone() for k, v in stage.named_buffers()}
    with torch.no_grad():
        for k, v in stage.named_buffers():
            v.copy_(buffers0[k])

    torch.manual_seed(seed)
    result = run_joint(joint, x, shared, dy)
    (out,) = result.outputs
    torch.testing.assert_close(out, y, rtol=rtol, atol=atol)
    torch.testing.assert_close(result.input_grad, dx, rtol=rtol, atol=atol)
    assert set(result.param_grads) == set(dparams)
    for name, g in dparams.items():
        torch.testing.assert_close(result.param_grads[name], g, rtol=rtol, atol=atol, msg=name)
    for name, value in stage.named_buffers():  # BatchNorm running stats updated as eager does
        torch.testing.assert_close(value, buffers_eager[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("kind", KINDS)
def test_joint_graph_reproduces_autograd_with_dropout_active(kind, traced):
    stage, x, shared, joint = traced(kind)
    _check_against_autograd(stage, x, shared, joint)


@pytest.mark.parametrize("kind", KINDS)
def test_block_graph_valid_roundtrips_and_plausible(kind, traced):
    stage, x, shared, joint = traced(kind)
    bg = to_block_graph(joint, profile_nodes(joint, x, shared, method="flops"))
    assert BlockGraph.from_dict(bg.to_dict()) == bg
    (lo_f, hi_f), (lo_b, hi_b) = PLAUSIBLE[kind]
    assert lo_f <= len(bg.forward_nodes) <= hi_f, len(bg.forward_nodes)
    assert lo_b <= len(bg.backward_nodes) <= hi_b, len(bg.backward_nodes)
    assert bg.input_bytes == x.numel() * x.element_size()
    y = stage(x, *shared)
    assert bg.output_grad_bytes == y.numel() * y.element_size()
    assert bg.node(bg.input_grad_name).phase == BACKWARD
    # forward nodes never read the gradient; every backward node is reachable from dy or forward results
    assert all(bg.output_grad_name not in n.inputs for n in bg.forward_nodes)
    assert any(bg.output_grad_name in n.inputs for n in bg.backward_nodes)
    # parameters, buffers and shared values are not inputs
    hidden = set(joint.param_inputs) | set(joint.buffer_inputs) | set(joint.shared_names)
    assert not any(hidden & set(n.inputs) for n in bg.nodes)
    # views: no bytes of their own; alias_of names the storage's owner (a node, x or dy),
    # or is "" when the owner is a parameter, buffer or shared value
    layout = storage_layout(joint)
    by_name = {n.name: n for n in joint.compute_nodes()}
    views = [n for n in bg.nodes if is_view_node(by_name[n.name]) and n.op != "aten.split.Tensor"]
    assert views
    names = {n.name for n in bg.nodes} | {bg.input_name, bg.output_grad_name}
    # an element of a multi-output op belongs to the op: the op owns its bytes
    element_of = {
        n.name: n.args[0].name
        for n in joint.compute_nodes()
        if n.target is operator.getitem and n.args[0].name in layout.unused_bytes and n.name not in layout.alias_of
    }
    for n in views:
        assert n.out_bytes == 0, n
        owner = element_of.get(layout.alias_of[n.name], layout.alias_of[n.name])
        assert n.alias_of == (owner if owner in names else ""), n
        assert n.alias_of or owner in hidden, n
        if n.alias_of in bg._index:
            assert bg.node(n.alias_of).out_bytes > 0 and not bg.node(n.alias_of).alias_of, n
    assert any(n.alias_of for n in views)
    # sizes of compute results
    assert sum(n.out_bytes for n in bg.nodes) == sum(layout.out_bytes.values())
    assert bg.node(bg.output_name).out_bytes > 0 or bg.node(bg.output_name).alias_of


def test_gpt2_block_shape_and_random_nodes(traced):
    stage, x, shared, joint = traced("gpt2")
    bg = to_block_graph(joint)
    random = [n for n in bg.nodes if n.random]
    # attention-probability dropout, and the two residual dropouts
    assert [n.op for n in random] == ["aten.native_dropout.default"] * 3
    assert all(n.phase == FORWARD for n in random)
    ops = [n.op for n in bg.nodes]
    assert ops.count("aten.addmm.default") == 4  # c_attn, c_proj, c_fc, mlp c_proj
    assert ops.count("aten.native_dropout_backward.default") == 3
    assert sum(n.op == "aten.native_layer_norm_backward.default" for n in bg.backward_nodes) == 2
    # a residual dropout (shaped like x) owns its output and its bool mask (1 byte per element);
    # the getitems that pick them are views of it
    dropout_bytes = x.numel() * x.element_size() + x.numel()
    assert sum(1 for n in random if n.out_bytes == dropout_bytes) == 2
    getitems = [n for n in bg.nodes if n.op == "getitem" and n.inputs[0].startswith("native_dropout")]
    assert getitems and all(n.out_bytes == 0 and n.alias_of == n.inputs[0] for n in getitems)
    # shared (the attention mask) is an input of the joint graph but not of any BlockGraph node
    assert joint.shared_names


def test_mlp_dropout_flagged_random_and_nothing_else(traced):
    _, _, _, joint = traced("mlp")
    bg = to_block_graph(joint)
    assert [n.name for n in bg.nodes if n.random] == ["native_dropout"]
    _, _, _, joint = traced("resnet")
    assert not any(n.random for n in to_block_graph(joint).nodes)
    assert len(joint.mutations) == 9  # three BatchNorms: num_batches_tracked, running mean, running var


def test_dropout_p0_exact_without_seeding():
    """With dropout off the joint graph agrees with autograd without any RNG care."""
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    ids = torch.randint(0, 256, (2, 16))
    stage, x, shared = stage_of(model, (ids,), {"labels": ids, "use_cache": False}, "transformer.h.1")
    joint = trace_joint(stage, x, shared)
    bg = to_block_graph(joint)
    # CPU attention without dropout is the fused kernel, whose op is tagged random but draws nothing
    assert any(n.op.startswith("aten._scaled_dot_product") for n in bg.forward_nodes)
    assert not any(n.random for n in bg.nodes)
    dy = torch.randn_like(x)
    y, dx, dparams = _eager(stage, x, shared, dy, seed=1)
    result = run_joint(joint, x, shared, dy)
    torch.testing.assert_close(result.outputs[0], y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(result.input_grad, dx, rtol=1e-5, atol=1e-6)
    for name, g in dparams.items():
        torch.testing.assert_close(result.param_grads[name], g, rtol=1e-5, atol=1e-6)


#: What plain autograd saves differs from the joint graph only by implementation choices:
#: * eager CPU dropout (``at::dropout`` -> ``input * noise``) saves the float noise where
#:   the joint graph's ``native_dropout`` keeps a bool mask: 3 more bytes per element in
#:   eager; we add exactly that back before comparing;
#: * the joint graph's ``native_batch_norm_backward`` reads the *updated* running
#:   statistics (2 x channels floats per BatchNorm) where eager reads the buffers
#:   themselves, which are not counted.
#: What remains must agree within 1%.
SAVED_TOLERANCE = 0.01


@pytest.mark.parametrize("kind", KINDS)
def test_saved_bytes_match_saved_tensor_hooks(kind, traced):
    stage, x, shared, joint = traced(kind)
    bg = to_block_graph(joint)
    saved = saved_for_backward(joint)
    for name, b in saved.items():  # forward owners; an op's element (a getitem) is a view of the op, which owns it
        node = bg.node(name)
        assert node.phase == FORWARD and (node.out_bytes == b or (node.op == "getitem" and node.alias_of)), node
    joint_bytes = sum(saved.values())

    before = {t.untyped_storage().data_ptr() for t in [*stage.parameters(), *stage.buffers(), x, *shared]}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in before:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    state = copy.deepcopy(dict(stage.named_buffers()))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage(x.detach().requires_grad_(), *shared)
    with torch.no_grad():
        for k, v in stage.named_buffers():
            v.copy_(state[k])
    eager_bytes = sum(seen.values())
    fx_nodes = {n.name: n for n in joint.compute_nodes()}
    masks = [  # native_dropout returns (output, bool mask)
        n for n in bg.forward_nodes
        if n.name in saved and n.op == "getitem" and bg.node(n.inputs[0]).random and fx_nodes[n.name].args[1] == 1
    ]
    float_noise_extra = 3 * sum(saved[n.name] for n in masks)
    assert (len(masks) > 0) == (kind != "resnet")
    assert abs(joint_bytes + float_noise_extra - eager_bytes) <= SAVED_TOLERANCE * eager_bytes, (
        joint_bytes, float_noise_extra, eager_bytes,
    )


@pytest.mark.parametrize("kind", KINDS)
def test_profile_nodes_measures_every_compute_node(kind, traced):
    stage, x, shared, joint = traced(kind)
    rng = torch.get_rng_state()
    buffers = {k: v.clone() for k, v in stage.named_buffers()}
    costs = profile_nodes(joint, x, shared, repeats=3)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, buffers[k]) for k, v in stage.named_buffers())
    assert set(costs) == {n.name for n in joint.compute_nodes()}
    assert all(t > 0 and workspace == scratch >= 0 for t, workspace, scratch in costs.values())  # (CPU: all scratch)
    bg = to_block_graph(joint, costs)
    assert all(n.time > 0 for n in bg.nodes)
    # the deterministic model: reproducible, positive for compute, zero for views and getitems
    flops = profile_nodes(joint, x, shared, method="flops")
    assert flops == profile_nodes(joint, x, shared, method="flops")
    by_name = {n.name: n for n in joint.compute_nodes()}
    for name, (t, _) in flops.items():
        free = is_view_node(by_name[name]) or by_name[name].target.__name__ == "getitem"
        assert (t == 0) if free else (t > 0), name
    mm = [n for n in bg.nodes if n.op in ("aten.mm.default", "aten.addmm.default", "aten.convolution.default")]
    elementwise = [n for n in bg.nodes if n.op in ("aten.relu.default", "aten.add.Tensor")]
    if mm and elementwise:
        assert max(flops[n.name][0] for n in mm) > min(flops[n.name][0] for n in elementwise)


def test_tracing_touches_neither_buffers_nor_rng():
    stage, x, shared = _build("resnet")
    buffers = {k: v.clone() for k, v in stage.named_buffers()}
    rng = torch.get_rng_state()
    trace_joint(stage, x, shared)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, buffers[k]) for k, v in stage.named_buffers())


def test_gpt2_trace_and_profile_cost_every_node():
    """(How long tracing and profiling take is benchmarks/bench_plan.py's to measure.)"""
    stage, x, shared = _build("gpt2")
    joint = trace_joint(stage, x, shared)
    costs = profile_nodes(joint, x, shared, repeats=5)
    graph = to_block_graph(joint, costs)
    computed = [n for n in joint.module.graph.nodes if n.op == "call_function"]
    assert set(costs) == {n.name for n in computed}
    assert all(seconds > 0 and workspace >= 0 for seconds, workspace, *_ in costs.values())
    assert len(graph.nodes) > 0


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_joint_graph_and_profile(kind):
    stage, x, shared = _build(kind, device="cuda")
    joint = trace_joint(stage, x, shared)
    # CUDA kernels may differ from eager's in reduction order (e.g. fused vs decomposed
    # attention), so compare with a looser tolerance; the RNG draws are still replayed.
    _check_against_autograd(stage, x, shared, joint, rtol=1e-4, atol=1e-5)
    costs = profile_nodes(joint, x, shared, repeats=3)
    assert set(costs) == {n.name for n in joint.compute_nodes()}
    assert all(t > 0 and w >= 0 for t, w in costs.values())
    bg = to_block_graph(joint, costs)
    assert BlockGraph.from_dict(bg.to_dict()) == bg
