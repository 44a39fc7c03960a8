"""checkpoint_sequential on CPU: gradients, RNG, BatchNorm, memory and the plan cache."""

import copy
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import hierremat as hr
from hierremat.api import sequential
from hierremat.device import LiveTensorTracker
from hierremat.device.memory import CpuAllocatorMeter

from harness import Checkpointed, train_step
from models import conv_chain, random_mlp_chain

MiB = 2**20


def _step(model, x, budget=None, seed=0):
    """One training step (the output held through it); returns (output, input grad, param grads, the larger of the
    tracker's and the allocator meter's peak bytes)."""
    run = model if budget is None else Checkpointed(model, budget)
    x = x.detach().clone().requires_grad_(x.requires_grad)
    step = train_step(run, (x,), lambda y: y.sum(), seed=seed, hold_output=True)
    return step.output, x.grad, list(step.grads), max(step.tracker_peak, step.allocator_peak)


def _grads_kept(model):
    """Allocate ``.grad`` before planning, as the steps here keep it (``_step``): budgets then count
    no parameter gradient (tests/test_step_grads.py plans for those the step allocates)."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)


def _budgets(model, x):
    """From the smallest feasible budget to unlimited."""
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan_sequential(model, "1KiB", x)
    lo = err.value.min_budget_bytes
    plain = _step(copy.deepcopy(model), x)[3]
    return [f"{b}B" for b in (lo, int(lo + 0.25 * (plain - lo)), int(lo + 0.6 * (plain - lo)), plain)] + ["64GiB"]


def _assert_same(a, b):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _check_model(model, x):
    reference = copy.deepcopy(model)
    y_ref, gx_ref, g_ref, _ = _step(reference, x)
    for budget in _budgets(model, x):
        plan = hr.plan_sequential(model, budget, x)
        sim = plan.simulate()
        assert sim.peak_bytes == plan.schedule.predicted_peak_bytes
        hr.checkpoint_sequential(model, budget, x)  # plans outside the measured step
        y, gx, g, peak = _step(model, x, budget)
        _assert_same(y, y_ref)
        if x.requires_grad:
            _assert_same(gx, gx_ref)
        for a, b in zip(g, g_ref):
            _assert_same(a, b)
        budget_bytes = hr.parse_budget(budget)
        assert peak <= budget_bytes, (budget, peak, plan.summary())
        cached_plan = sequential.plan_cache.get(sequential.PlanCache.key(list(model), x, budget_bytes, 500)).plan
        predicted = cached_plan.predicted_peak_bytes
        assert abs(peak - predicted) <= max(0.1 * predicted, MiB), (budget, peak, predicted)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mlp_chain_gradients_and_memory(seed):
    torch.manual_seed(seed)
    model = random_mlp_chain(seed)
    _check_model(model, torch.randn(256, 96, requires_grad=True))


def test_conv_chain_gradients_and_memory():
    torch.manual_seed(3)
    _check_model(conv_chain(), torch.randn(16, 3, 24, 24, requires_grad=True))


def test_input_without_grad():
    torch.manual_seed(4)
    _check_model(random_mlp_chain(4), torch.randn(128, 96))


def test_batchnorm_running_stats_updated_once_and_rng_stream_unchanged():
    torch.manual_seed(5)
    model = conv_chain()
    reference = copy.deepcopy(model)
    x = torch.randn(16, 3, 24, 24, requires_grad=True)
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan_sequential(model, "1KiB", x)
    budget = f"{err.value.min_budget_bytes}B"  # forces recomputation of BatchNorm stages
    plan = hr.plan_sequential(model, budget, x)
    assert max(plan.schedule.forward_counts()) > 1

    torch.manual_seed(6)
    reference(x).sum().backward()
    rng_after_reference = torch.get_rng_state()
    torch.manual_seed(6)
    hr.checkpoint_sequential(model, budget, x).sum().backward()  # first call: plans inside
    assert torch.equal(torch.get_rng_state(), rng_after_reference)
    for (name, a), b in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(a, b), name
    for a, b in zip(model.parameters(), reference.parameters()):
        _assert_same(a.grad, b.grad)


def test_rng_states_the_runtime_keeps_are_within_the_budget():
    """The tracker cannot see RNG states (torch.get_rng_state makes them below the dispatcher);
    the CPU allocator meter does. At the smallest budget, with stages replayed, what the meter
    sees beyond the tracker (the recomputed stages' states and the caller's, held through the
    backward) is within what the plan reserves, and the step within the budget."""
    torch.manual_seed(9)
    width = 256
    model = nn.Sequential(*[
        nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(0.2)) for _ in range(6)
    ])
    x = torch.randn(64, width, requires_grad=True)
    _grads_kept(model)
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan_sequential(model, "1KiB", x, output_held=False)
    budget = f"{err.value.min_budget_bytes}B"
    plan = hr.plan_sequential(model, budget, x, output_held=False)
    assert max(plan.schedule.forward_counts()) > 1
    peaks = {}
    for meter in (LiveTensorTracker(), LiveTensorTracker(), CpuAllocatorMeter()):  # the first step warms up
        for p in model.parameters():
            p.grad = torch.zeros_like(p)  # accumulated into in place: not part of the step's peak
        with meter:
            hr.checkpoint_sequential(model, budget, x, output_held=False).sum().backward()
        peaks[type(meter)] = meter.peak_bytes
    hidden = peaks[CpuAllocatorMeter] - peaks[LiveTensorTracker]
    assert 0 < hidden <= plan.reserved_bytes, (hidden, plan.summary())
    assert peaks[CpuAllocatorMeter] <= plan.predicted_peak_bytes <= err.value.min_budget_bytes


def test_plan_cache_hit_does_not_resolve(monkeypatch):
    calls = []
    real_plan = sequential.plan_from_profile
    monkeypatch.setattr(sequential, "plan_from_profile", lambda *a, **k: calls.append(1) or real_plan(*a, **k))
    sequential.plan_cache.clear()
    model = random_mlp_chain(7)
    x = torch.randn(64, 96, requires_grad=True)
    for _ in range(3):  # the output is released at the loss, as declared: no re-plan for its use either
        hr.checkpoint_sequential(model, "2MiB", x, output_held=False).sum().backward()
    assert len(calls) == 1
    assert (sequential.plan_cache.misses, sequential.plan_cache.hits) == (1, 2)
    hr.checkpoint_sequential(model, "2MiB", torch.randn(32, 96), output_held=False).sum().backward()  # new shape
    assert len(calls) == 2


def test_infeasible_budget_names_the_minimum():
    model = random_mlp_chain(8)
    x = torch.randn(128, 96)
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.checkpoint_sequential(model, "10KiB", x)
    minimum = err.value.min_budget_bytes
    assert err.value.budget_bytes == 10 * 1024
    assert str(minimum) in str(err.value) and "smallest feasible budget" in str(err.value)
    plan = hr.plan_sequential(model, f"{minimum}B", x)
    assert plan.predicted_peak_bytes <= minimum


def test_segment_count_is_rejected():
    with pytest.raises(ValueError, match="segment count"):
        hr.checkpoint_sequential(random_mlp_chain(9), 4, torch.randn(8, 96))


def test_no_grad_mode_runs_plainly():
    model = random_mlp_chain(10).eval()
    x = torch.randn(8, 96)
    with torch.no_grad():
        y = hr.checkpoint_sequential(model, "1GiB", x)
    torch.testing.assert_close(y, model(x))
    assert not y.requires_grad


def test_autocast_is_kept_for_recomputation():
    torch.manual_seed(11)
    model = random_mlp_chain(11)
    reference = copy.deepcopy(model)
    x = torch.randn(128, 96, requires_grad=True)
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan_sequential(model, "1KiB", x)
    budget = f"{err.value.min_budget_bytes}B"
    for m in (model, reference):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.manual_seed(12)
            y = m(x) if m is reference else hr.checkpoint_sequential(m, budget, x)
        assert y.dtype == torch.bfloat16
        y.float().sum().backward()
    for a, b in zip(model.parameters(), reference.parameters()):
        _assert_same(a.grad, b.grad)


def test_stage_returning_a_tuple_is_unsupported():
    class Pair(nn.Module):
        def forward(self, x):
            return x, x

    with pytest.raises(hr.UnsupportedModelError, match="Pair"):
        hr.checkpoint_sequential([nn.Linear(4, 4), Pair(), nn.Linear(4, 4)], "1GiB", torch.randn(2, 4, requires_grad=True))


def test_last_stage_may_return_several_tensors():
    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(96, 10), nn.Linear(96, 3)

        def forward(self, x):
            return self.a(x), self.b(x).tanh()

    torch.manual_seed(14)
    model = nn.Sequential(*list(random_mlp_chain(14))[:-1], Heads())
    reference = copy.deepcopy(model)
    x = torch.randn(128, 96, requires_grad=True)
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan_sequential(model, "1KiB", x)
    for m in (model, reference):
        torch.manual_seed(15)
        a, b = m(x) if m is reference else hr.checkpoint_sequential(m, f"{err.value.min_budget_bytes}B", x)
        (a.sum() + b.pow(2).sum()).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        _assert_same(p.grad, q.grad)
    # an unused output gets no gradient, like plain autograd
    a, _ = hr.checkpoint_sequential(model, f"{err.value.min_budget_bytes}B", x)
    a.sum().backward()


def test_plan_summary_and_json_roundtrip():
    model = random_mlp_chain(13)
    plan = hr.plan_sequential(model, "3MiB", torch.randn(128, 96))
    text = plan.summary()
    assert "predicted peak" in text and "Linear" in text
    assert hr.SequentialPlan.from_json(plan.to_json()) == plan


def test_tracker_counts_new_storages_only():
    base = torch.zeros(1024)
    with LiveTensorTracker() as tracker:
        a = torch.ones(256)  # 1 KiB
        view = a[:10]
        base.add_(1)  # in place on a pre-existing tensor: not counted
        b = a * 2  # 1 KiB
        del b
        c = torch.empty(512)  # 2 KiB
        assert tracker.live_bytes == 1024 + 2048
        del a, view, c
    assert tracker.peak_bytes == 1024 + 2048
    assert tracker.live_bytes == 0


def test_profiler_detects_which_tensors_autograd_keeps():
    from hierremat.runtime.profile import profile_chain

    stages = [nn.Linear(64, 256), nn.ReLU(), nn.Dropout(0.5), nn.GELU(), nn.Linear(256, 8)]
    costs = profile_chain(stages, torch.randn(32, 64, requires_grad=True), repeats=1).costs
    pins = [(st.options[0].pins_input, st.options[0].pins_output) for st in costs.stages]
    # Linear saves its input; ReLU its output; Dropout a mask only; GELU its input.
    assert pins == [(True, False), (False, True), (False, False), (True, False), (True, False)]
    assert costs.stages[2].options[0].kept_bytes > 0  # the dropout mask


def test_a_slow_stage_is_timed_by_the_runs_that_measure_its_memory(monkeypatch):
    """Above SLOW_STAGE_SECONDS a stage runs 4 forwards and 2 backwards to profile (warm-up and
    memory runs, one of them with .grad None: OptionCosts.bwd_overhead_new_grads_bytes), not 4 + 3
    timed repeats and their warm-up; the memory figures are the same."""
    from hierremat.runtime import profile as profile_module

    class Counted(nn.Linear):
        forwards = 0

        def forward(self, x):
            Counted.forwards += 1
            return super().forward(x)

    torch.manual_seed(0)
    stages, x = [Counted(64, 64), nn.ReLU()], torch.randn(32, 64, requires_grad=True)
    normal = profile_module.profile_chain(stages, x, repeats=3).costs.stages[0]
    normal_forwards, Counted.forwards = Counted.forwards, 0
    monkeypatch.setattr(profile_module, "SLOW_STAGE_SECONDS", 0.0)
    slow = profile_module.profile_chain(stages, x, repeats=3).costs.stages[0]
    assert Counted.forwards == 4 < normal_forwards
    a, b = normal.options[0], slow.options[0]
    memory = ("kept_bytes", "fwd_overhead_bytes", "bwd_overhead_bytes", "bwd_overhead_new_grads_bytes")
    assert [getattr(a, m) for m in memory] == [getattr(b, m) for m in memory]
    assert b.fwd_time > 0 and b.bwd_time > 0 and slow.nograd_fwd_time > 0


def _relu_dropout_chain():
    torch.manual_seed(4)
    layers = [nn.Linear(32, 128)]
    for _ in range(3):
        layers += [nn.LayerNorm(128), nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Dropout(0.1), nn.Linear(512, 128))]
    layers.append(nn.Linear(128, 16))  # (the last stage runs autograd's option only)
    return nn.Sequential(*layers), torch.randn(256, 32)


def test_relu_masks_lower_the_floor_of_a_relu_dropout_chain_and_train_exactly(monkeypatch):
    """Feed-forward blocks with ReLU then dropout: with ReLU's backward from a packed mask
    (a choice of the block ILP, hierremat.blocks.variants.relu_masks) the smallest feasible budget
    drops, and the plans from it up still give plain autograd's gradients within budget.
    (In-place operators are off for the comparison: they let the ReLU backward write over its
    gradient, which saves memory in another step of the same block.)"""
    from hierremat.planning import menus

    model, x = _relu_dropout_chain()
    with monkeypatch.context() as patch:
        patch.setattr(menus, "run_in_place", lambda joint: joint)
        with pytest.raises(hr.InfeasibleBudgetError) as masked:
            hr.plan_sequential(model, "1KiB", x)
        patch.setattr(menus, "pack_relu_masks", lambda joint: joint)
        with pytest.raises(hr.InfeasibleBudgetError) as without:
            hr.plan_sequential(model, "1KiB", x)
    assert masked.value.min_budget_bytes < 0.97 * without.value.min_budget_bytes
    _check_model(model, x)


def test_smallest_budget_does_not_move_with_which_no_grad_forward_is_measured_faster(monkeypatch, tmp_path):
    """F_none / F_ck run in the faster of the stage called without grad and its generated forward,
    as measured; here the generated one peaks lower (packed masks, in-place ops). The smallest
    feasible budget is planned with the leaner form (StageCosts.leaner_nograd), so it is the same
    whichever form is measured faster, and the plan there runs the leaner form, exactly and
    within the budget."""
    from hierremat.planning import menus
    from hierremat.runtime.stage_cost_cache import ExecutorSpeeds

    model, x = _relu_dropout_chain()
    reference = copy.deepcopy(model)
    _grads_kept(model)
    floors = []
    for forward_seconds in (1e-9, 10.0):  # the generated forward priced faster, then slower
        monkeypatch.setenv("HIERREMAT_CACHE_DIR", str(tmp_path / str(forward_seconds)))
        monkeypatch.setattr(menus, "_executor_speeds", lambda *a, s=forward_seconds, **k: ExecutorSpeeds(1.0, s))
        with pytest.raises(hr.InfeasibleBudgetError) as err:
            hr.plan_sequential(model, "1KiB", x)
        floors.append(err.value.min_budget_bytes)
    assert floors[0] == floors[1]
    loose = hr.plan_sequential(model, "64GiB", x).costs.stages
    assert {st.nograd_form for st in loose} == {"autograd"} and any(st.leaner_nograd for st in loose)
    budget = f"{floors[1]}B"
    assert "generated" in [st.nograd_form for st in hr.plan_sequential(model, budget, x).costs.stages]
    sequential.plan_cache.clear()
    hr.checkpoint_sequential(model, budget, x)  # plans outside the measured step
    y_ref, _, g_ref, _ = _step(reference, x)
    y, _, g, peak = _step(model, x, budget)
    _assert_same(y, y_ref)
    for a, b in zip(g, g_ref):
        _assert_same(a, b)
    assert peak <= floors[1]



class _Residual(nn.Module):
    """``x + mlp(x)``: the sum is written over the MLP's output (hierremat.blocks.variants.in_place), so
    the block's output is an in-place result, its storage the MLP output's."""

    def __init__(self, width: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.mlp(x)


def test_the_last_block_of_a_chain_offers_its_block_options(monkeypatch):
    """A chain of identical blocks: the last block returns one tensor, so it offers the others'
    menu too (the chain's output is the one tensor its graph returns). Its floor was autograd's
    whole stage; with the options the smallest feasible budget drops, the plan there runs an
    option on the last block, and steps from it up give plain autograd's gradients within
    budget."""
    from hierremat.planning.chain_menus import ChainMenus

    torch.manual_seed(11)
    width = 128
    model = nn.Sequential(*[_Residual(width) for _ in range(3)])
    x = torch.randn(64, width, requires_grad=True)
    _grads_kept(model)
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan_sequential(model, "1KiB", x)
    floor = err.value.min_budget_bytes
    with monkeypatch.context() as patch:  # the last stage on option 0 only, as before
        fits = ChainMenus._output_fits_menu
        patch.setattr(ChainMenus, "_output_fits_menu",
                      lambda self, i, costs: i < len(self.executors) - 1 and fits(self, i, costs))
        sequential.plan_cache.clear()
        with pytest.raises(hr.InfeasibleBudgetError) as before:
            hr.plan_sequential(model, "1KiB", x)
    sequential.plan_cache.clear()
    assert floor < 0.9 * before.value.min_budget_bytes
    plan = hr.plan_sequential(model, f"{floor}B", x)
    last = len(model) - 1
    assert any(op.stage == last and getattr(op, "option", 0) > 0 for op in plan.schedule.ops), plan.summary()
    _check_model(model, x)


def test_a_plan_that_keeps_everything_loads_the_dp_kernel_for_the_next(tmp_path):
    """Where keeping everything fits, no DP runs, but its Numba kernel is loaded (about 90 MiB and 0.3 s once per
    process): a later shape that does not fit, a longer sequence in a growing loop, pays none of it. In a process of
    its own, where nothing else loaded the kernel."""
    script = (
        "import torch, hierremat as hr\n"
        "from torch import nn\n"
        "model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))\n"
        "x = torch.randn(4, 8, requires_grad=True)\n"
        "plan = hr.plan_sequential(model, '1GiB', x, block_options='autograd')\n"
        "assert plan.schedule.keeps_everything\n"
        "from hierremat.dp.kernel import fill_tables\n"
        "assert fill_tables.signatures, 'the kernel was not loaded'\n"
    )
    env = {**os.environ, "HIERREMAT_CACHE_DIR": str(tmp_path)}
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert ran.returncode == 0, ran.stderr[-2000:]
