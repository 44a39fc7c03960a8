"""torch.compile composes with hierremat.

* ``torch.compile(hierremat.remat(model, ...))`` trains: Dynamo compiles the orchestrator's
  code around the chain and graph-breaks exactly where hierremat says (planning, the chain
  runner), with gradients equal to eager hierremat's and the peak within the budget.
* ``hierremat.checkpoint_sequential`` inside a compiled function is one graph break.
* hierremat's operators are ``torch.library`` ops that ``opcheck`` accepts, and Dynamo
  traces them into one graph.
"""

import copy

import pytest
import torch
from torch import nn

import hierremat as hr
from hierremat.ops import packed_bits  # noqa: F401  (defines the hierremat:: ops)
from hierremat.ops.cross_entropy import row_blocked_cross_entropy

from harness import model_loss, train_step
from models import random_mlp_chain, tiny_gpt2


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _graph_break_reasons() -> list[str]:
    return list(torch._dynamo.utils.counters["graph_break"])


def _ops():
    x = torch.randn(37, 11, requires_grad=True)
    bits = torch.ops.hierremat.dropout_bits(x.detach(), 0.3)
    return {
        "masked_scale": (torch.ops.hierremat.masked_scale.default, (x, bits, 1 / 0.7)),
        "pack_mask": (torch.ops.hierremat.pack_mask.default, (torch.rand(37, 11) > 0.5,)),
        "row_blocked_cross_entropy": (
            torch.ops.hierremat.row_blocked_cross_entropy.default, (x, torch.randint(0, 11, (37,)), 1, -100)
        ),
    }


@pytest.mark.parametrize("name", ["masked_scale", "pack_mask", "row_blocked_cross_entropy"])
def test_operators_pass_torch_library_opcheck(name):
    op, args = _ops()[name]
    torch.library.opcheck(op, args)


def test_random_operator_has_a_schema_and_a_fake_kernel():
    x = torch.randn(37, 11)
    torch.library.opcheck(torch.ops.hierremat.dropout_bits.default, (x, 0.3), test_utils=("test_schema", "test_faketensor"))


def test_dynamo_traces_the_operators_into_one_graph():
    def loss_fn(logits, target, bits):
        dropped = torch.ops.hierremat.masked_scale(logits, bits, 2.0)
        return row_blocked_cross_entropy(dropped, target)

    logits = torch.randn(64, 17, requires_grad=True)
    target = torch.randint(0, 17, (64,))
    bits = torch.ops.hierremat.dropout_bits(logits.detach(), 0.5)
    expected = loss_fn(logits, target, bits)
    (grad_expected,) = torch.autograd.grad(expected, logits)
    compiled = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)
    got = compiled(logits, target, bits)
    (grad,) = torch.autograd.grad(got, logits)
    assert torch.equal(got, expected) and torch.equal(grad, grad_expected)


def _step(module, ids, meters="cpu"):
    """(loss, gradients, peak) of one step, ``.grad`` allocated: the tracker's peak under both CPU meters, the
    allocator meter's alone (a compiled module: the tracker is a dispatch mode, under which Dynamo does not
    compile)."""
    step = train_step(module, (ids,), model_loss, kwargs={"labels": ids, "use_cache": False}, meters=meters)
    peak = step.tracker_peak if meters == "cpu" else step.allocator_peak
    return step.loss, list(step.grads), peak


def test_compiled_remat_model_trains_like_eager_hierremat_within_budget():
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2)
    ids = torch.randint(0, 256, (2, 48))
    kwargs = {"labels": ids, "use_cache": False}
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan(model, (ids,), kwargs, budget="1KiB")
    budget = err.value.min_budget_bytes
    module = hr.remat(model, (ids,), kwargs, budget=f"{budget}B")
    assert not module.plans[0].chain.schedule.keeps_everything
    eager_copy = copy.deepcopy(module)
    _, _, tracked_peak = _step(eager_copy, ids)
    assert tracked_peak <= budget
    loss_ref, grads_ref, eager_peak = _step(eager_copy, ids, meters="allocator")
    compiled = torch.compile(module)  # Inductor
    for _ in range(2):
        loss, grads, peak = _step(compiled, ids, meters="allocator")
        torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-7)
        for a, b in zip(grads, grads_ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        # the allocator also sees kernels' scratch buffers, which the budget's tracker does not
        # count: compiling must not add to the eager hierremat step's allocator peak
        assert peak <= eager_peak, (peak, eager_peak, budget)
    reasons = _graph_break_reasons()
    assert len(reasons) == 2 and all("hierremat" in r and "torch.compiler.disable" in r for r in reasons), reasons


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_compiled_training_step_with_backward_inside_is_exact(autocast):
    """``torch.compile`` of a whole training step, ``backward()`` included: Dynamo would compile
    any frame the backward calls, hierremat's recomputations (and their dropout draws) too,
    unless the runner's backward is left eager."""
    from models import same_bits

    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2)
    ids = torch.randint(0, 256, (2, 48))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        # compiled code keeps the model's outputs alive through the backward: plan for it
        module = hr.remat(model, (ids,), {"labels": ids}, budget="1.4MiB", settings=hr.Settings(output_held=True))
    assert not module.plans[0].chain.schedule.keeps_everything  # recomputes (stages or within blocks)
    eager_copy = copy.deepcopy(module)

    def training_step(m):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = m(ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    def grads(m, step):
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
        torch.manual_seed(1)
        loss = step(m)
        return [loss] + [p.grad.clone() for p in m.parameters()]

    expected = grads(eager_copy, training_step)
    compiled = torch.compile(training_step, backend="aot_eager")
    for _ in range(2):
        assert all(same_bits(a, b) for a, b in zip(grads(module, compiled), expected))


def test_checkpoint_sequential_in_a_compiled_function_is_one_graph_break():
    torch.manual_seed(5)
    chain = random_mlp_chain(5)
    reference = copy.deepcopy(chain)
    x = torch.randn(128, 96, requires_grad=True)

    def training_step(model, x):
        y = hr.checkpoint_sequential(model, "2MiB", x * 2)
        return y.pow(2).mean()

    for m, fn in ((reference, lambda m, x: m(x * 2).pow(2).mean()), (chain, torch.compile(training_step, backend="aot_eager"))):
        torch.manual_seed(6)
        fn(m, x).backward()
    for p, q in zip(chain.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    reasons = _graph_break_reasons()
    assert reasons and all("torch.compiler.disable" in r for r in reasons), reasons


def test_remat_of_a_compiled_model_captures_the_original(caplog):
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2)
    ids = torch.randint(0, 256, (2, 32))
    reference = copy.deepcopy(model)
    with caplog.at_level("INFO", logger="hierremat.blocks.capture"):
        module = hr.remat(torch.compile(model), (ids,), {"labels": ids, "use_cache": False}, budget="1GiB")
    assert "captures the original module" in caplog.text
    _, grads, _ = _step(module, ids)
    _, grads_ref, _ = _step(reference, ids)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_compiled_module_inside_a_chain_stage_is_left_to_dynamo():
    """A stage that is itself torch.compile'd runs compiled inside hierremat's runner."""
    torch.manual_seed(8)
    layers = [nn.Linear(64, 64) for _ in range(6)]
    chain = [torch.compile(layer, backend="aot_eager") if i % 2 else layer for i, layer in enumerate(layers)]
    reference = copy.deepcopy(nn.Sequential(*layers))
    x = torch.randn(32, 64, requires_grad=True)
    hr.checkpoint_sequential(chain, "1MiB", x, block_options="autograd").pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    for layer, ref in zip(layers, reference):
        torch.testing.assert_close(layer.weight.grad, ref.weight.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.cuda
def test_cuda_compiled_remat_model_trains_like_eager_hierremat_within_budget():
    from hierremat.device import CudaPeakMeter

    device = torch.device("cuda")
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2).to(device)
    ids = torch.randint(0, 256, (2, 48), device=device)
    kwargs = {"labels": ids, "use_cache": False}
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan(model, (ids,), kwargs, budget="1KiB")
    budget = err.value.min_budget_bytes + (1 << 20)
    module = hr.remat(model, (ids,), kwargs, budget=f"{budget}B")
    eager_copy = copy.deepcopy(module)
    compiled = torch.compile(module)

    def step(m):
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
        torch.manual_seed(1)
        with CudaPeakMeter(device) as meter:
            m(ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in m.parameters()], meter.peak_bytes

    step(eager_copy)
    grads_ref, _ = step(eager_copy)
    for _ in range(2):
        grads, peak = step(compiled)
        for a, b in zip(grads, grads_ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert peak <= budget + 512 * 64  # the allocator rounds blocks up to 512 bytes


def test_compiled_remat_model_trains_at_every_length_within_budget():
    """``torch.compile(hierremat.remat(...))`` over dynamically changing lengths: Dynamo recompiles the
    orchestrator's code (then with dynamic sizes), hierremat plans each new length in its graph break
    (the fifth from fitted costs); gradients equal eager hierremat's, the allocator's peak within budget.
    Every length from the second on runs one size-generic orchestrator (hierremat.blocks.generic), so Dynamo
    compiles nothing after the third length (the first's, the second's and a dynamic one), not again at each
    length until its recompile limit (8) stops compiling."""
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2)
    ids = torch.randint(0, 256, (2, 48))
    budget = 1200 * 1024
    module = hr.remat(model, (ids,), {"labels": ids, "use_cache": False}, budget=f"{budget}B",
                      settings=hr.Settings(cache=False))
    eager = copy.deepcopy(module)
    compiled = torch.compile(module)
    lengths = (48, 32, 40, 24, 36, 20, 44, 28, 30, 26)
    for length in lengths:
        ids = torch.randint(0, 256, (2, length))
        loss_ref, grads_ref, _ = _step(eager, ids, meters="allocator")
        loss, grads, peak = _step(compiled, ids, meters="allocator")
        torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-7)
        for a, b in zip(grads, grads_ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        assert peak <= budget, (length, peak)
        if length == lengths[2]:
            frames = dict(torch._dynamo.utils.counters["frames"])
    assert len(module.plans) == len(lengths) and module.plans[-1].times != "measured"
    # nothing compiled after the third length (before: three frames at each, until the ninth hit the limit)
    assert dict(torch._dynamo.utils.counters["frames"]) == frames
