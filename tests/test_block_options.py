"""ILP block options end to end: each option executed on real tensors, whole models, the cache.

- Every option of a block's menu, run by hierremat.runtime.block_exec, gives exactly the
  stage output and gradients of plain autograd (dropout active), and its measured forward
  and backward peaks (live-tensor tracker) are at most the option's prediction, and close.
- Whole models planned with block_options="ilp": gradients equal plain autograd and the
  measured peak stays within the budget at budgets from the minimum to plain autograd's.
- Solved menus are cached: a second plan solves nothing; a corrupted cache entry is
  detected, logged and solved again.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
import logging

import pytest
import torch

import hierremat as hr
from hierremat.blocks.joint import to_block_graph, trace_joint
from hierremat.runtime.node_profile import profile_nodes
from hierremat.planning.menu_store import cost_model_version
from hierremat.store.cache import default_cache
from hierremat.ilp.options import forward_only, simulate_option, solve_menu
from hierremat.device import LiveTensorTracker
from hierremat.runtime.block_exec import ForwardExecutor, GeneratedForward, OptionExecutor
from hierremat.runtime.option_codegen import StageBinding
from hierremat.runtime.stage_cost_cache import ExecutorSpeeds

from hierremat.blocks.capture import capture
from hierremat.blocks.segment import build_chain_graph
from hierremat.api.planned_shape import chain_inputs

from harness import model_loss, train_step
from models import TinyResNet, tiny_gpt2
from stages import stage_of

MiB = 2**20
KiB = 2**10
pytest.importorskip("transformers")


def _reference(stage, x, shared, seed):
    for p in stage.parameters():
        p.grad = torch.zeros_like(p)
    xi = x.detach().clone().requires_grad_(x.is_floating_point())
    torch.manual_seed(seed)
    y = stage(xi, *shared)
    y.backward(torch.ones_like(y))
    return y.detach(), xi.grad, [p.grad.clone() for p in stage.parameters()]


def _check_forward_only(stage, joint, graph, x, shared, buffers):
    """The generated no-grad forward (F_none / F_ck) gives the stage's output and buffer updates
    bitwise (dropout active, same RNG state), keeps nothing, and peaks at most as predicted."""
    forward = forward_only(graph, also=frozenset(node for node, _ in joint.mutations))
    assert [name for kind, name in forward.ops if kind == "compute"][-1:] and ("free", graph.input_name) not in forward.ops
    executor = ForwardExecutor(GeneratedForward(joint, forward), StageBinding(joint))
    for b, saved in zip(stage.buffers(), buffers):
        b.copy_(saved)
    torch.manual_seed(11)
    with torch.no_grad():
        y_ref = stage(x, *shared)
    updated = [b.clone() for b in stage.buffers()]
    for b, saved in zip(stage.buffers(), buffers):
        b.copy_(saved)
    torch.manual_seed(11)
    with LiveTensorTracker() as tracker:
        y = executor(x.detach().clone(), shared)  # (the input's copy counts from here)
    assert torch.equal(y, y_ref)
    for b, expected in zip(stage.buffers(), updated):
        assert torch.equal(b, expected)
    assert tracker.peak_bytes <= forward.peak_bytes + x.untyped_storage().nbytes() + KiB
    assert tracker.live_bytes == y.untyped_storage().nbytes()  # nothing kept (the input's copy freed)


def _check_menu(stage, x, shared, rewrite=None, **menu_settings):
    """rewrite: a variant's rewrite of the joint graph (hierremat.blocks.variants), or None."""
    buffers = [b.clone() for b in stage.buffers()]
    joint = trace_joint(stage, x, shared, input_requires_grad=x.is_floating_point())
    if rewrite is not None:
        joint = rewrite(joint)
    graph = to_block_graph(joint, profile_nodes(joint, x, shared, method="flops"))
    _check_forward_only(stage, joint, graph, x, shared, buffers)
    menu = solve_menu(graph, **menu_settings)
    assert len(menu.options) >= 2
    y_ref, dx_ref, g_ref = _reference(stage, x, shared, seed=5)
    for option in menu.options:
        for b, saved in zip(stage.buffers(), buffers):
            b.copy_(saved)
        executor = OptionExecutor(joint, option)
        for p in stage.parameters():
            p.grad = torch.zeros_like(p)
        dy = torch.ones_like(y_ref)
        xi = x.detach().clone()
        torch.manual_seed(5)
        with LiveTensorTracker() as tracker:
            y, tape = executor.forward(xi, shared)
            fwd_peak = tracker.peak_bytes
            assert torch.equal(y, y_ref), option.name
            y_bytes = y.untyped_storage().nbytes()
            if option.pins_output:
                del y  # the tape holds it, and the backward frees it after its last use
            tracker.reset_peak()
            dx = executor.backward(tape, dy, shared)
            del tape
        # above what the backward starts with: the kept values and y; x and dy predate the tracker
        bwd_peak = tracker.peak_bytes - option.kept_bytes - y_bytes
        simulated = simulate_option(graph, option)
        if dx_ref is not None:
            torch.testing.assert_close(dx, dx_ref, rtol=1e-6, atol=1e-7)
        for g, r in zip((p.grad for p in stage.parameters()), g_ref):
            torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)
        # the generated code frees each value at its last use, as the op lists do, so measured peaks
        # are at most the ILP's (and the independent simulator's), to a few bytes (BatchNorm's scalar
        # step counter); below them where the model ties the results of a multi-output op together
        # (in the model a kept dropout mask or BatchNorm statistic holds the whole op's bytes)
        for measured, predicted in ((fwd_peak, option.fwd_peak_bytes), (bwd_peak, option.bwd_peak_bytes)):
            assert measured <= predicted + KiB, option.name
        assert simulated.fwd_peak_bytes == option.fwd_peak_bytes, option.name
        assert simulated.bwd_peak_bytes == option.bwd_peak_bytes, option.name
    return menu


def test_every_gpt2_block_option_gives_autograd_gradients_and_its_predicted_peak():
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2)
    ids = torch.randint(0, 256, (2, 64))
    stage, x, shared = stage_of(model, (ids,), {"labels": ids, "use_cache": False}, "transformer.h.0")
    menu = _check_menu(stage, x, shared)
    assert any(o.optimal for o in menu.options)


def test_every_whole_graph_option_gives_autograd_gradients_and_its_predicted_peak():
    """GPT-2 before its head as one stage, recomputation stopping at dropouts: the menu's
    schedules keep kept multi-output elements (``getitem_11``) beside placeholders that fx
    renamed into the same names; the generated code must bind each to its own value."""
    torch.manual_seed(3)
    model = tiny_gpt2(n_layer=2)
    ids = torch.randint(0, 256, (2, 32))
    args, kwargs = (ids,), {"labels": ids, "use_cache": False}
    chain = build_chain_graph(capture(model, args, kwargs, variants=False), model, segmentation="none")
    x0, shared = chain_inputs(chain, args, kwargs)
    menu = _check_menu(chain.stages[0], x0, tuple(shared), recompute_across_dropouts=False)
    assert sum(o.optimal for o in menu.options) > 10


def test_every_resnet_block_option_gives_autograd_gradients_and_its_predicted_peak():
    torch.manual_seed(1)
    model = TinyResNet()
    x, labels = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    stage, xi, shared = stage_of(model, (x,), {"labels": labels}, "layer1.0")
    _check_menu(stage, xi, shared)


def test_the_ilp_chooses_between_relu_outputs_and_their_packed_masks():
    """A feed-forward block with ReLU then dropout (T5's, classic MLPs): with the ReLU's mask
    packed, every option is still autograd's bitwise, and the menu keeps the 1-bit masks
    instead of the ReLU's output where that pays: a smaller least peak than without."""
    from hierremat.blocks.variants.dropout import pack_dropout_masks
    from hierremat.blocks.variants.relu_masks import pack_relu_masks

    torch.manual_seed(2)
    stage = torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(128, 32)
    )
    x = torch.randn(64, 32)
    without = _check_menu(stage, x, (), rewrite=pack_dropout_masks)
    masked = _check_menu(stage, x, (), rewrite=lambda joint: pack_relu_masks(pack_dropout_masks(joint)))
    relu_bytes = 64 * 128 * 4

    def least_peak(menu):
        return min(max(o.fwd_peak_bytes, o.kept_bytes + o.bwd_peak_bytes) for o in menu.options)

    assert least_peak(masked) <= least_peak(without) - relu_bytes // 4
    # what makes it smaller: options that keep the ReLU's mask, not its output
    computed = [{n for kind, n in o.fwd_ops if kind == "compute"} for o in masked.options]
    relu = next(n for n in computed[0] if n.startswith("relu"))
    bits = next(n for n in set().union(*computed) if n.startswith("above_bits"))
    kept = [c - {n for kind, n in o.fwd_ops if kind == "free"} for c, o in zip(computed, masked.options)]
    assert any(bits in k and relu not in k for k in kept)
    # and options that do not keep the mask do not compute it in the forward either
    assert all(bits in k or bits not in c for c, k in zip(computed, kept))
    assert any(bits not in c for c in computed)


def _step(model, args, kwargs, seed=1):
    """(loss, gradients, the larger of the two meters' peaks) of one step, ``.grad`` allocated, the output released
    before the backward."""
    step = train_step(model, args, model_loss, seed=seed, kwargs=kwargs)
    return step.loss, step.grads, max(step.tracker_peak, step.allocator_peak)


def _whole_model(which: str):
    """(model, args, kwargs): a 3-layer GPT-2 (dropout) or a ResNet (BatchNorm)."""
    if which == "gpt2":
        ids = torch.randint(0, 256, (2, 64))
        return tiny_gpt2(n_layer=3), (ids,), {"labels": ids, "use_cache": False}
    return TinyResNet(), (torch.randn(8, 3, 16, 16),), {"labels": torch.randint(0, 10, (8,))}


def _check_steps(module, model, reference, args, kwargs, budget: int):
    """A warm-up step (it tells the plan that the outputs are released), then a step against plain
    autograd's: loss and gradients equal, the peak within the budget. Returns (the plan, the peak)."""
    _step(module, args, kwargs)
    reference.load_state_dict(model.state_dict())
    loss_ref, grads_ref, _ = _step(reference, args, kwargs)
    loss, grads, peak = _step(module, args, kwargs)
    (plan,) = module.plans
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-7)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert peak <= budget, (budget, peak, plan.summary())
    return plan, peak


@pytest.mark.parametrize("which", ["gpt2", "resnet"])
def test_whole_models_with_ilp_options(which, tmp_path):
    torch.manual_seed(2)
    model, args, kwargs = _whole_model(which)
    reference = copy.deepcopy(model)
    loss_ref, grads_ref, plain_peak = _step(reference, args, kwargs)
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan(model, args, kwargs, budget="1KiB", settings=hr.Settings(cache=str(tmp_path)))
    lo = err.value.min_budget_bytes
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan(model, args, kwargs, budget="1KiB", settings=hr.Settings(block_options="autograd"))
    assert lo <= err.value.min_budget_bytes  # more options never raise the minimum
    if which == "gpt2":
        # with the outputs released (as the steps below release them) GPT-2's ILP options lower the
        # minimum far below what autograd's options reach (about 0.6x), so a plan there must use one
        released = hr.Settings(output_held=False, cache=str(tmp_path))
        with pytest.raises(hr.InfeasibleBudgetError) as err:
            hr.plan(model, args, kwargs, budget="1KiB", settings=released)
        lo_released = err.value.min_budget_bytes
        with pytest.raises(hr.InfeasibleBudgetError) as err:
            hr.plan(model, args, kwargs, budget="1KiB", settings=replace(released, block_options="autograd"))
        assert lo_released < 0.8 * err.value.min_budget_bytes
        at_minimum = hr.plan(model, args, kwargs, budget=f"{lo_released}B", settings=released)
        assert any("[" in a for a in at_minimum.chain.stage_actions()), at_minimum.summary()
    for budget in (lo, lo + (plain_peak - lo) // 3, lo + 2 * (plain_peak - lo) // 3, plain_peak):
        module = hr.remat(model, args, kwargs, budget=f"{budget}B", settings=hr.Settings(cache=str(tmp_path)))
        plan, peak = _check_steps(module, model, reference, args, kwargs, budget)
        predicted = plan.predicted_peak_bytes
        assert abs(peak - predicted) <= max(0.1 * predicted, MiB), (budget, peak, predicted)


@pytest.mark.parametrize("which", ["gpt2", "resnet"])
def test_generated_forwards_and_options_preferred_train_exactly_within_budget(which, tmp_path, monkeypatch):
    """Where generated code runs faster than autograd (priced so here), plans run every stage with a
    menu through it (F_none / F_ck as the generated no-grad forward, F_all as the options): gradients
    equal plain autograd's, dropout and BatchNorm included, and the peak stays within the budget."""
    from hierremat.planning import menus

    monkeypatch.setattr(menus, "_executor_speeds", lambda *a, **k: ExecutorSpeeds(1e-6, 1e-9))
    torch.manual_seed(4)
    model, args, kwargs = _whole_model(which)
    reference = copy.deepcopy(model)
    _, _, plain_peak = _step(reference, args, kwargs)
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan(model, args, kwargs, budget="1KiB", settings=hr.Settings(cache=str(tmp_path)))
    lo = err.value.min_budget_bytes
    for budget in (lo, (lo + plain_peak) // 2):
        module = hr.remat(model, args, kwargs, budget=f"{budget}B", settings=hr.Settings(cache=str(tmp_path)))
        (plan,) = module.plans
        forms = [st.nograd_form for st in plan.chain.costs.stages]
        assert forms.count("generated") >= 2, forms
        assert any(st.called_as_module().nograd_fwd_time > st.nograd_fwd_time for st in plan.chain.costs.stages)
        # forwards without grad (F_none/F_ck) run as generated code ("*") where a stage has it (whether the plan
        # at a budget recomputes a stage whole, or uses block options instead, depends on the measured times)
        nograd = [f for a in plan.chain.stage_actions() for f in a.split(", ") if f.startswith(("none", "ck"))]
        assert not nograd or any("*" in f for f in nograd), plan.summary()
        plan, _ = _check_steps(module, model, reference, args, kwargs, budget)
        for a, b in zip(model.buffers(), reference.buffers()):
            assert torch.equal(a, b)
        again = hr.ModelPlan.from_json(plan.to_json())
        assert [st.nograd_form for st in again.chain.costs.stages] == [st.nograd_form for st in plan.chain.costs.stages]


def test_second_plan_solves_nothing_and_a_corrupted_entry_is_solved_again(tmp_path, caplog):
    torch.manual_seed(3)
    model = tiny_gpt2(n_layer=2)
    ids = torch.randint(0, 256, (2, 32))
    kwargs = {"labels": ids, "use_cache": False}
    first = hr.plan(model, (ids,), kwargs, budget="1GiB", settings=hr.Settings(cache=str(tmp_path)))
    assert first.options_solves > 0 and first.menus
    default_cache(str(tmp_path)).forget_memory()  # a new process: disk only
    second = hr.plan(model, (ids,), kwargs, budget="1GiB", settings=hr.Settings(cache=str(tmp_path)))
    assert second.options_solves == 0
    assert second.menus == first.menus
    menu_files = [f for f in tmp_path.glob("*.json") if '"graph"' in f.read_text()]  # menus, not stage costs
    assert menu_files
    data = bytearray(menu_files[0].read_bytes())
    data[len(data) // 2] ^= 0x01
    menu_files[0].write_bytes(bytes(data))
    default_cache(str(tmp_path)).forget_memory()
    with caplog.at_level(logging.WARNING, logger="hierremat"):
        third = hr.plan(model, (ids,), kwargs, budget="1GiB", settings=hr.Settings(cache=str(tmp_path)))
    assert third.options_solves > 0
    assert str(menu_files[0].name) in caplog.text


def test_saved_plan_with_ilp_options_runs_without_solving(tmp_path, caplog):
    torch.manual_seed(4)
    model = tiny_gpt2(n_layer=2)
    ids = torch.randint(0, 256, (2, 32))
    kwargs = {"labels": ids, "use_cache": False}
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan(model, (ids,), kwargs, budget="1KiB", settings=hr.Settings(cache=str(tmp_path)))
    plan = hr.plan(model, (ids,), kwargs, budget=f"{err.value.min_budget_bytes}B",
                   settings=hr.Settings(cache=str(tmp_path)))
    assert plan.budget_bytes == err.value.min_budget_bytes  # the model's budget, shared values included
    again = hr.ModelPlan.from_json(plan.to_json())
    assert again.menus == plan.menus and again.budget_bytes == plan.budget_bytes
    assert again.cost_model == plan.cost_model == cost_model_version()
    reference = copy.deepcopy(model)
    with caplog.at_level(logging.WARNING, logger="hierremat"):
        module = hr.remat(model, (ids,), kwargs, plan=again, settings=hr.Settings(output_held=False))
    assert "plan again" not in caplog.text
    loss, grads, _ = _step(module, (ids,), kwargs)
    loss_ref, grads_ref, _ = _step(reference, (ids,), kwargs)
    torch.testing.assert_close(loss, loss_ref)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # a plan whose costs another cost model measured (or one saved before plans said which) runs, warned about
    for older in ("nodes-3/stage-8/staged-6/torch-2.12.0", ""):
        saved = json.loads(plan.to_json())
        saved["cost_model"] = older
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hierremat"):
            hr.remat(copy.deepcopy(reference), (ids,), kwargs, plan=hr.ModelPlan.from_json(json.dumps(saved)),
                     settings=hr.Settings(output_held=False))
        assert (older or "did not record its cost model") in caplog.text and cost_model_version() in caplog.text


class _ResidualMLP(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, 4 * width)
        self.drop = torch.nn.Dropout(0.1)
        self.fc2 = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(self.drop(torch.nn.functional.gelu(self.fc1(self.norm(x)))))


def test_checkpoint_sequential_with_ilp_options():
    torch.manual_seed(5)
    model = torch.nn.Sequential(*[_ResidualMLP(64) for _ in range(6)])
    reference = copy.deepcopy(model)
    x = torch.randn(128, 64, requires_grad=True)
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan_sequential(model, "1KiB", x)
    lo = err.value.min_budget_bytes
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan_sequential(model, "1KiB", x, block_options="autograd")
    assert lo <= err.value.min_budget_bytes
    used_ilp = False
    for budget in (lo, int(lo * 1.3), int(lo * 1.8)):
        plan = hr.plan_sequential(model, f"{budget}B", x)
        used_ilp |= any("[" in a for a in plan.stage_actions())
        for m in (model, reference):
            for p in m.parameters():
                p.grad = torch.zeros_like(p)
        xs = [x.detach().clone().requires_grad_() for _ in range(2)]
        hr.checkpoint_sequential(model, f"{budget}B", xs[0])  # plans outside the measured step
        torch.manual_seed(6)
        with LiveTensorTracker() as tracker:
            y = hr.checkpoint_sequential(model, f"{budget}B", xs[0])
            y.square().mean().backward()
        torch.manual_seed(6)
        reference(xs[1]).square().mean().backward()
        torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-6, atol=1e-7)
        for a, b in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
        assert tracker.peak_bytes <= budget, (budget, tracker.peak_bytes, plan.summary())
    assert used_ilp, "no plan used an ILP option"


def test_frozen_block_has_a_signature_of_its_own_and_nothing_is_solved_again(tmp_path, caplog):
    """Which parameters need gradients changes a block's joint graph, so it is part of its
    signature: planning the frozen block after the trainable one finds no stale cache entry."""
    from models import tiny_gpt2

    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2)
    ids = torch.randint(0, 256, (2, 32))
    kwargs = {"labels": ids}
    trainable = hr.plan(model, (ids,), kwargs, budget="1GiB", settings=hr.Settings(cache=str(tmp_path)))
    for p in model.transformer.h.parameters():
        p.requires_grad_(False)
    with caplog.at_level("INFO", logger="hierremat"):
        frozen = hr.plan(model, (ids,), kwargs, budget="1GiB", settings=hr.Settings(cache=str(tmp_path)))
        again = hr.plan(model, (ids,), kwargs, budget="1GiB", settings=hr.Settings(cache=str(tmp_path)))
    assert "solving again" not in caplog.text
    assert set(trainable.signatures[1:-1]).isdisjoint(frozen.signatures[1:-1])
    assert again.signatures == frozen.signatures and again.options_solves == 0


class _Gate(torch.nn.Module):
    """Equal printed configuration and parameters whatever ``kind`` is: only its attribute differs."""

    def __init__(self, width: int, kind: str):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.kind = kind

    def forward(self, x):
        y = self.lin(x)
        return x + (torch.tanh(y) if self.kind == "tanh" else torch.nn.functional.gelu(y) * y)


def test_stages_that_differ_only_in_attributes_do_not_share_graphs():
    """A plain chain's stage signature covers what the forward branches on beyond its repr and
    parameters: two such stages sharing one traced graph would run each other's computation."""
    from hierremat.planning.stage_calls import module_signature

    torch.manual_seed(7)
    model = torch.nn.Sequential(_Gate(32, "tanh"), _Gate(32, "gelu"), _Gate(32, "tanh"), _Gate(32, "gelu"))
    x = torch.randn(64, 32, requires_grad=True)
    signatures = [module_signature(stage, x) for stage in model]
    assert repr(model[0]) == repr(model[1]) and signatures[0] != signatures[1]
    assert signatures[0] == signatures[2] and signatures[1] == signatures[3]
    reference = copy.deepcopy(model)
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan_sequential(model, "1KiB", x)
    budget = f"{err.value.min_budget_bytes}B"
    hr.checkpoint_sequential(model, budget, x)  # plans
    hr.checkpoint_sequential(model, budget, x).square().mean().backward()
    reference(x).square().mean().backward()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def test_an_option_saving_no_memory_wins_over_autograds_only_by_more_than_the_noise():
    """Priced as autograd's option and a hair more where it is no leaner and faster by less than
    NOISE_MARGIN; left as measured where it is leaner or clearly faster."""
    from hierremat.planning.chain_menus import NOISE_MARGIN, _priced_within_noise
    from hierremat.plans.costs import OptionCosts

    base = OptionCosts(fwd_time=1.0, bwd_time=2.0, kept_bytes=100, fwd_overhead_bytes=200, bwd_overhead_bytes=50)
    close = replace(base, fwd_time=0.98, bwd_time=1.97)
    priced = _priced_within_noise(close, base)
    assert priced.fwd_time + priced.bwd_time > base.fwd_time + base.bwd_time
    assert (priced.kept_bytes, priced.fwd_overhead_bytes) == (close.kept_bytes, close.fwd_overhead_bytes)
    faster = replace(base, fwd_time=1.0 - 3 * NOISE_MARGIN * 3, bwd_time=2.0 - 3 * NOISE_MARGIN * 3)
    assert _priced_within_noise(faster, base) == faster
    leaner = replace(close, kept_bytes=99)
    assert _priced_within_noise(leaner, base) == leaner


class _SafeSoftmax(torch.nn.Module):
    """Attention's softmax (``_safe_softmax``): on CPU its kernel allocates a mask of its input's size below the
    dispatcher, which the live-tensor tracker cannot see."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(256, 256)

    def forward(self, x):
        return torch.ops.aten._safe_softmax(self.proj(x), -1)


def test_cpu_node_workspace_is_the_scratch_the_allocator_meter_sees():
    stage, x = _SafeSoftmax(), torch.randn(64, 256, 256)
    joint = trace_joint(stage, x, (), input_requires_grad=True)
    costs = profile_nodes(joint, x, (), repeats=1)
    mask = 64 * 256 * 256  # bytes of its bool mask
    assert mask <= costs["_safe_softmax"][1] <= mask + 2**20
    assert costs["addmm"][1] < 2**20  # (a matmul allocates no scratch of its result's size)

