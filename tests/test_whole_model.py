"""hierremat.plan / hierremat.remat on whole models: GPT-2, a ResNet-style CNN, an MLP."""

import copy

import pytest
import torch
from torch import nn

import hierremat as hr
from hierremat.runtime import profile as profile_module

from hierremat.plans.schedule import FCk

from harness import model_loss, train_step
from models import TinyResNet, random_mlp_chain, tiny_gpt2

pytest.importorskip("transformers")
MiB = 2**20


def _step(model, args, kwargs, seed=1):
    """(loss, gradients, the larger of the two meters' peaks) of one step, ``.grad`` allocated."""
    step = train_step(model, args, model_loss, seed=seed, kwargs=kwargs)
    return step.loss, step.grads, max(step.tracker_peak, step.allocator_peak)


def _check(model, args, kwargs, **settings):
    reference = copy.deepcopy(model)
    loss_ref, grads_ref, plain_peak = _step(reference, args, kwargs)
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan(model, args, kwargs, budget="1KiB", settings=hr.Settings(**settings))
    lo = err.value.min_budget_bytes
    for budget in (lo, lo + (plain_peak - lo) // 3, plain_peak, 2**36):
        module = hr.remat(model, args, kwargs, budget=f"{budget}B", settings=hr.Settings(**settings))
        (plan,) = module.plans
        loss, grads, peak = _step(module, args, kwargs)
        torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-7)
        for a, b in zip(grads, grads_ref):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert peak <= budget, (budget, peak, plan.summary())
        predicted = plan.predicted_peak_bytes
        assert abs(peak - predicted) <= max(0.1 * predicted, MiB), (budget, peak, predicted)
    return plan


def test_gpt2_gradients_and_memory():
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=3)
    ids = torch.randint(0, 256, (2, 64))
    _check(model, (ids,), {"labels": ids, "use_cache": False})


@pytest.mark.parametrize("variants", [True, False])
def test_whole_graph_segmentation_solves_everything_before_the_head_as_one_block(variants, unhurried_ilp):
    torch.manual_seed(3)
    model = tiny_gpt2(n_layer=2)
    ids = torch.randint(0, 256, (2, 32))
    plan = _check(model, (ids,), {"labels": ids, "use_cache": False}, segmentation="none", variants=variants)
    assert plan.segmentation == "none" and len(plan.stages) == 2
    assert plan.stages[0].name.endswith("transformer.h.1") and len(plan.menus) == 1
    (menu,) = plan.menus.values()
    # with variants too: recomputation stops at dropouts, and every ILP solve is proven optimal
    assert not menu["coarse"], menu["coarse"]
    assert all(o["optimal"] for o in menu["options"] if o["name"].startswith("ilp")), menu["options"]
    if not variants:
        return
    assert hr.ModelPlan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match="segmentation must be 'blocks'.*got 'layers'"):
        hr.plan(model, (ids,), {"labels": ids, "use_cache": False}, budget="1GiB",
                settings=hr.Settings(segmentation="layers"))


def test_gpt2_with_attention_mask_keyword():
    torch.manual_seed(1)
    model = tiny_gpt2(n_layer=2)
    ids = torch.randint(0, 256, (2, 64))
    mask = torch.ones(2, 64, dtype=torch.long)
    mask[1, 40:] = 0
    _check(model, (ids,), {"attention_mask": mask, "labels": ids, "use_cache": False})


def test_resnet_style_cnn_gradients_batchnorm_and_memory():
    torch.manual_seed(2)
    model = TinyResNet()
    reference = copy.deepcopy(model)
    x, labels = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    plan = _check(model, (x,), {"labels": labels})
    names = [s.name for s in plan.stages]
    assert names[:-1] == ["stem.0", "stem.1", "stem.2", "layer1.0", "layer1.1", "layer2.0", "layer2.1"], names
    assert plan.stages[4].signature == plan.stages[3].signature
    # running statistics after one step equal plain autograd's
    model = copy.deepcopy(reference)
    lo = None
    try:
        hr.plan(model, (x,), {"labels": labels}, budget="1KiB")
    except hr.InfeasibleBudgetError as err:
        lo = err.min_budget_bytes
    module = hr.remat(model, (x,), {"labels": labels}, budget=f"{lo}B")
    assert max(module.plans[0].chain.schedule.forward_counts()) > 1
    torch.manual_seed(3)
    module(x, labels=labels)[0].backward()
    torch.manual_seed(3)
    reference(x, labels=labels)[0].backward()
    for (name, a), b in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(a, b), name


def test_mlp_chain_gradients_and_memory():
    torch.manual_seed(4)
    _check(random_mlp_chain(4), (torch.randn(256, 96, requires_grad=True),), {})


def test_a_first_stage_equal_to_later_ones_is_measured_apart():
    """The first stage's input needs no gradient: its costs (no input gradient in its backward) are not
    those of the identical stages after it (measured so, they were: an invalid chain cost)."""
    torch.manual_seed(5)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)], nn.Linear(64, 1))
    plan = _check(model, (torch.randn(512, 64),), {})
    costs = plan.chain.costs
    same = [i for i in range(1, costs.length) if plan.stages[i].signature == plan.stages[0].signature]
    assert same, [s.signature for s in plan.stages]
    assert all(costs.stages[i].options[0].bwd_overhead_bytes >= costs.grad_bytes(i) > 0 for i in same)


def test_gpt2_12_layers_segments_into_blocks_profiled_once(monkeypatch):
    calls = []
    real = profile_module._profile_stage
    monkeypatch.setattr(profile_module, "_profile_stage", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    model = tiny_gpt2(n_layer=12, n_embd=32, n_positions=32)
    ids = torch.randint(0, 256, (1, 32))
    plan = hr.plan(model, (ids,), {"labels": ids, "use_cache": False}, budget="1GiB", settings=hr.Settings(cache=False))
    names = [s.name for s in plan.stages]
    assert len(names) == 14
    assert names[1:13] == [f"transformer.h.{i}" for i in range(12)]
    assert len({s.signature for s in plan.stages[1:13]}) == 1
    assert len(calls) == 3  # prologue, one decoder block, epilogue
    assert "transformer.h.11" in plan.summary()


def test_a_second_plan_measures_nothing_again_unless_the_cache_is_off(monkeypatch, tmp_path):
    from hierremat.planning import menus

    profiled, timed = [], []
    real_profile, real_speeds = profile_module._profile_stage, menus._executor_speeds
    monkeypatch.setattr(profile_module, "_profile_stage", lambda *a, **k: profiled.append(a[0]) or real_profile(*a, **k))
    monkeypatch.setattr(menus, "_executor_speeds", lambda *a, **k: timed.append(1) or real_speeds(*a, **k))
    torch.manual_seed(5)
    model = tiny_gpt2(n_layer=2)
    ids = torch.randint(0, 256, (2, 32))
    kwargs = {"labels": ids, "use_cache": False}
    first = hr.plan(model, (ids,), kwargs, budget="1GiB", settings=hr.Settings(cache=str(tmp_path)))
    # prologue, decoder block, head profiled; one block executor timed per distinct menu (the prologue
    # ends in a dropout: with its mask packed it has block options too)
    assert len(profiled) == 3 and len(timed) == len(first.menus) >= 1
    profiled.clear(), timed.clear()
    second = hr.plan(model, (ids,), kwargs, budget="1GiB", settings=hr.Settings(cache=str(tmp_path)))
    assert profiled == [] and timed == [] and second.options_solves == 0
    assert second.chain.costs == first.chain.costs and second.chain.schedule == first.chain.schedule
    hr.plan(model, (ids,), kwargs, budget="1GiB", settings=hr.Settings(cache=False))
    assert len(profiled) == 3 and len(timed) == len(first.menus)


def test_plan_json_roundtrip_and_reuse():
    model = tiny_gpt2(n_layer=2)
    ids = torch.randint(0, 256, (2, 32))
    kwargs = {"labels": ids, "use_cache": False}
    plan = hr.plan(model, (ids,), kwargs, budget="64MiB")
    again = hr.ModelPlan.from_json(plan.to_json())
    assert again == plan
    module = hr.remat(model, (ids,), kwargs, plan=again)
    assert module.plans[0] is again
    module(ids, **kwargs).loss.backward()
    with pytest.raises(ValueError, match="signatures"):
        hr.remat(tiny_gpt2(n_layer=3), (ids,), kwargs, plan=again)


def test_new_input_shape_replans_or_raises():
    model = random_mlp_chain(5)
    module = hr.remat(model, (torch.randn(64, 96),), budget="64MiB")
    module(torch.randn(32, 96)).sum().backward()
    assert len(module.plans) == 2
    strict = hr.remat(model, (torch.randn(64, 96),), budget="64MiB", settings=hr.Settings(on_new_shape="error"))
    with pytest.raises(ValueError, match="differ"):
        strict(torch.randn(32, 96))


def test_data_dependent_control_flow_is_unsupported():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            h = self.a(x)
            if h.sum() > 0:
                return self.b(h)
            return h

    with pytest.raises(hr.UnsupportedModelError, match="Branchy"):
        hr.plan(Branchy(), (torch.randn(4, 8),), budget="1GiB")


@pytest.mark.parametrize("strategy", ["none", "segments=2", "segments=4"])
def test_baseline_strategies_run_through_the_same_runtime(strategy):
    torch.manual_seed(6)
    model = tiny_gpt2(n_layer=3)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 256, (2, 64))
    kwargs = {"labels": ids, "use_cache": False}
    loss_ref, grads_ref, _ = _step(reference, (ids,), kwargs)
    module = hr.remat(model, (ids,), kwargs, budget="1GiB", settings=hr.Settings(strategy=strategy))
    (plan,) = module.plans
    loss, grads, peak = _step(module, (ids,), kwargs)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-7)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert peak <= plan.predicted_peak_bytes + MiB
    if strategy == "none":
        assert max(plan.chain.schedule.forward_counts()) == 1
    else:
        assert plan.chain.schedule.ops[0] == FCk(0)  # the first segment keeps only its input


def test_unknown_strategy_is_rejected():
    with pytest.raises(ValueError, match="strategy"):
        hr.plan(random_mlp_chain(7), (torch.randn(8, 96),), budget="1GiB", settings=hr.Settings(strategy="fastest"))
