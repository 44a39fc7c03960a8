"""Offloading checkpoints as a planner choice, run: the runner executes Offload/Fetch with a second
tier, ``offload=`` and ``offload_limit=`` plan and run with it, the summary says what moves.

Checked on CPU with the disk tier: gradients bitwise plain autograd's (dropout replayed); the live-tensor
tracker and the allocator meter at most the plan's predicted peak; the tier's peak equals the plan's and it
holds nothing after a step, or after a forward whose backward never runs; a plan over ``offload_limit`` is
planned without offloading; bad arguments and an unwritable directory are refused before training; the
transfer plan's stall equals the simulator's and its prefetches never raise an op above the simulated peak.
"""

import contextlib
import gc
import logging
import os
from dataclasses import replace

import numpy as np
import pytest
import torch

import hierremat as hr
from hierremat.api.sequential import _plan
from hierremat.device import LiveTensorTracker
from hierremat.device.memory import CpuAllocatorMeter, CudaPeakMeter
from hierremat.dp import min_peak_schedule, solve_chain
from hierremat.plans.costs import TierBandwidth
from hierremat.plans.schedule import Backward, ChainSchedule, FAll, FCk, Fetch, FetchKept, Loss, Offload, OffloadKept
from hierremat.plans.simulate import simulate
from hierremat.plans.transfers import TransferPlan, transfer_plan
from hierremat.runtime.executor import ChainRunner
from hierremat.runtime.offload import Offloading, check_offload, second_tier
from hierremat.runtime.second_tier import DiskTier, HostMemoryTier, OffloadError

from chains import random_chain

FREE = TierBandwidth("disk", 1e12, 1e12)  # transfers that cost nothing: the DP offloads wherever it saves time


def _chain(n: int = 10, width: int = 64):
    """Stages whose activations weigh as much as what they keep: without a second tier a tight budget
    recomputes."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[
        torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Dropout(0.1)) for _ in range(n)
    ])


def _reference(chain, x):
    for p in chain.parameters():
        p.grad = torch.zeros_like(p)
    x = x.detach().requires_grad_()
    torch.manual_seed(7)
    chain(x).sum().backward()
    return [p.grad.clone() for p in chain.parameters()], x.grad.clone()


def _free_tier(limit="64MiB") -> Offloading:
    offloading = Offloading(True, limit, torch.device("cpu"), cache=None)
    offloading.bandwidth = FREE
    return offloading


def _floor(chain, x, offloading) -> int:
    try:
        _plan(list(chain), 2**20, x, slots=200, block_options="autograd", offloading=offloading)
    except hr.InfeasibleBudgetError as err:
        return err.min_budget_bytes
    raise AssertionError("1 MiB fits")


@pytest.mark.parametrize("above_floor", [1.15, 1.3])
def test_runner_offloads_exact_and_within_the_predicted_peak(above_floor):
    chain, x = _chain(), torch.randn(2048, 64)
    grads, x_grad = _reference(chain, x)
    offloading = _free_tier()
    budget = int(_floor(chain, x, offloading) * above_floor)
    planned = _plan(list(chain), budget, x, slots=200, block_options="autograd", offloading=offloading)
    plan = planned.plan
    assert plan.offloads, plan.summary()
    assert "offloading: x_" in plan.summary()
    transfers = transfer_plan(plan.costs, plan.schedule)
    for p in chain.parameters():
        p.grad.zero_()
    xr = x.detach().requires_grad_()
    tier = planned.runner.tier
    tier.peak_bytes = 0  # (from this step on: measuring the bandwidth held more)
    with CpuAllocatorMeter() as meter, LiveTensorTracker() as tracker:
        torch.manual_seed(7)
        planned.run(xr).sum().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(chain.parameters(), grads))
    assert torch.equal(xr.grad, x_grad)
    assert tracker.peak_bytes <= plan.predicted_peak_bytes
    assert meter.peak_bytes <= plan.predicted_peak_bytes
    assert tier.peak_bytes == transfers.tier_peak_bytes > 0
    assert tier.held_bytes == 0 and tier.file_bytes == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_prefetched_values_come_back_exact(device):
    """A schedule run op by op with every fetch prefetched as early as possible (right after its offload):
    the disk tier on CPU, the pinned host memory tier on CUDA (copies on its side stream)."""
    chain, x = _chain(4).to(device), torch.randn(256, 64, device=device)
    grads, x_grad = _reference(chain, x)
    ops = (FCk(0), FCk(1), Offload(1), FCk(2), Offload(2), FAll(3), Loss(), Backward(3), Fetch(2), FAll(2),
           Backward(2), Fetch(1), FAll(1), Backward(1), FAll(0), Backward(0))
    schedule = ChainSchedule(ops, 4, predicted_time=0.0, predicted_peak_bytes=0, budget_bytes=0, memory_unit_bytes=1)
    transfers = TransferPlan(copy_starts=frozenset({1, 3}), prefetches=((3, 1), (5, 2)), offloaded=(1, 2))
    tier = DiskTier(2**24) if device == "cpu" else HostMemoryTier(2**24, device)
    try:
        runner = ChainRunner(list(chain), schedule, [()] * 4, tier=tier, transfers=transfers)
        for p in chain.parameters():
            p.grad.zero_()
        xr = x.detach().requires_grad_()
        torch.manual_seed(7)
        runner.run(xr).sum().backward()
        assert all(torch.equal(p.grad, g) for p, g in zip(chain.parameters(), grads))
        assert torch.equal(xr.grad, x_grad)
        assert tier.peak_bytes == 2 * 256 * 64 * 4 and tier.held_bytes == 0
    finally:
        tier.close()


@contextlib.contextmanager
def _no_host_waits():
    """Any wait of the host for the GPU raises: CUDA's sync debug mode (synchronizing copies, stream and device
    synchronizations) and event, stream and device ``synchronize`` calls, which that mode does not see."""

    def waited(*args, **kwargs):
        raise AssertionError("the host waited for the GPU")

    previous = torch.cuda.get_sync_debug_mode()
    with pytest.MonkeyPatch.context() as patch:
        for owner, name in ((torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"),
                            (torch.cuda, "synchronize")):
            patch.setattr(owner, name, waited)
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)


@pytest.mark.cuda
@pytest.mark.parametrize("above_floor", [1.15, 1.3])
def test_cuda_host_memory_tier_offloads_exactly_within_the_predicted_peak(above_floor):
    """``offload=True`` on CUDA: the pinned pool, copies on a side stream ordered by events. Gradients bitwise
    plain autograd's (dropout replayed from the CUDA generator), the allocator's peak at most the plan's
    (blocks rounded to 512 bytes), the tier's peak the plan's and nothing left in it after the step. The
    step's host never waits for the GPU: a copy out is waited for by the compute stream before the value
    is freed, a fetch's by the stream that reads it."""
    device = torch.device("cuda")
    chain, x = _chain().to(device), torch.randn(2048, 64, device=device)
    grads, x_grad = _reference(chain, x)
    offloading = Offloading(True, "64MiB", device, cache=None)
    assert offloading.kind == "host memory", offloading.describe()
    offloading.bandwidth = TierBandwidth("host memory", 1e12, 1e12)
    budget = int(_floor(chain, x, offloading) * above_floor)
    planned = _plan(list(chain), budget, x, slots=200, block_options="autograd", offloading=offloading)
    plan = planned.plan
    assert plan.offloads, plan.summary()
    transfers = transfer_plan(plan.costs, plan.schedule)
    for p in chain.parameters():
        p.grad.zero_()
    xr = x.detach().requires_grad_()
    tier = planned.runner.tier
    tier.peak_bytes = 0
    with CudaPeakMeter(device) as meter:
        torch.manual_seed(7)
        with _no_host_waits():
            planned.run(xr).sum().backward()
    diffs = [float((p.grad - g).abs().max()) for p, g in zip(chain.parameters(), grads)]
    assert all(torch.equal(p.grad, g) for p, g in zip(chain.parameters(), grads)), diffs
    assert torch.equal(xr.grad, x_grad)
    assert meter.peak_bytes <= plan.predicted_peak_bytes + 512 * 64, (meter.peak_bytes, plan.predicted_peak_bytes)
    assert tier.peak_bytes == transfers.tier_peak_bytes > 0
    assert tier.held_bytes == 0


class _Doubling(torch.nn.Module):
    """Doubles its input in place on its first call (the forward sweep's), as a careless stage might."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 1:
            x.detach().mul_(2)
        return x * 2


def test_an_input_changed_while_offloaded_is_an_error():
    """A stage that writes over its input (here, when run without grad) would tear the copy being written."""
    chain = [torch.nn.Linear(8, 8), _Doubling(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)]
    ops = (FCk(0), FCk(1), Offload(1), FCk(2), FAll(3), Loss(), Backward(3), FAll(2), Backward(2), Fetch(1), FAll(1),
           Backward(1), FAll(0), Backward(0))
    schedule = ChainSchedule(ops, 4, predicted_time=0.0, predicted_peak_bytes=0, budget_bytes=0, memory_unit_bytes=1)
    with DiskTier(2**20) as tier:
        runner = ChainRunner(chain, schedule, [()] * 4, tier=tier,
                             forward_executors=[None, lambda x, shared: chain[1](x), None, None],  # (as generated code)
                             transfers=TransferPlan(copy_starts=frozenset({1}), offloaded=(1,)))
        x = torch.randn(4, 8, requires_grad=True)
        with pytest.raises(RuntimeError, match="modified in place while it was being offloaded"):
            runner.run(x)
        assert tier.held_bytes == 0  # (the failed step left nothing)


def test_a_forward_without_its_backward_leaves_nothing_in_the_tier():
    chain, x = _chain(), torch.randn(2048, 64)
    offloading = _free_tier()
    budget = int(_floor(chain, x, offloading) * 1.15)
    planned = _plan(list(chain), budget, x, slots=200, block_options="autograd", offloading=offloading)
    assert planned.plan.offloads
    tier = planned.runner.tier
    y = planned.run(x.detach().requires_grad_())
    assert tier.held_bytes > 0
    del y
    gc.collect()  # (its values are dropped by the tier's next use, on this thread)
    planned.run(x.detach().requires_grad_()).sum().backward()  # the next step runs
    assert tier.held_bytes == 0 and tier.file_bytes == 0


@pytest.mark.parametrize("setup", ["bf16 autocast", "zero_grad(set_to_none=True)"])
def test_offloading_under_autocast_and_gradients_made_in_the_step(setup):
    """bf16 autocast (planned and run under it): gradients bitwise plain autocast's; ``.grad`` None at the
    step's start (PyTorch's default zero_grad): the plan for the gradients the step allocates offloads too,
    and the step stays within its predicted peak."""
    chain, x = _chain(), torch.randn(2048, 64)
    bf16 = setup == "bf16 autocast"
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    for p in chain.parameters():
        p.grad = torch.zeros_like(p)
    xr = x.detach().requires_grad_()
    torch.manual_seed(7)
    with autocast():
        out = chain(xr)
    out.float().sum().backward()
    grads = [p.grad.clone() for p in chain.parameters()]
    offloading = _free_tier()
    with autocast():
        budget = int(_floor(chain, x, offloading) * 1.3)
        planned = _plan(list(chain), budget, x, slots=200, block_options="autograd", offloading=offloading)
    for p in chain.parameters():
        p.grad = None if not bf16 else p.grad.zero_()
    xr = x.detach().requires_grad_()
    with LiveTensorTracker() as tracker:
        torch.manual_seed(7)
        with autocast():
            out = planned.run(xr)
        out.float().sum().backward()
    plan = planned.plan
    assert plan.offloads, plan.summary()
    assert bool(sum(plan.costs.step_grad_bytes)) != bf16  # (the plan made for the gradients the step allocates)
    assert all(torch.equal(p.grad, g) for p, g in zip(chain.parameters(), grads))
    assert tracker.peak_bytes <= plan.predicted_peak_bytes


def test_over_the_limit_plans_without_offloading(caplog):
    chain, x = _chain(), torch.randn(2048, 64)
    offloading = _free_tier()
    budget = int(_floor(chain, x, offloading) * 1.15)
    assert _plan(list(chain), budget, x, slots=200, block_options="autograd", offloading=offloading).plan.offloads
    offloading.limit_bytes = 4096  # less than one activation (512 KiB)
    with caplog.at_level(logging.WARNING):
        plan = _plan(list(chain), budget, x, slots=200, block_options="autograd", offloading=offloading).plan
    assert not plan.offloads and "over offload_limit" in caplog.text


def test_a_saved_plan_that_offloads_needs_a_tier():
    chain, x = _chain(), torch.randn(2048, 64)
    offloading = _free_tier()
    budget = int(_floor(chain, x, offloading) * 1.15)
    planned = _plan(list(chain), budget, x, slots=200, block_options="autograd", offloading=offloading)
    from hierremat.planning.chain_plan import PlannedChain
    from hierremat.plans.sequential_plan import SequentialPlan

    saved = SequentialPlan.from_json(planned.plan.to_json())
    assert saved.offloads and saved.costs.tier == FREE
    with pytest.raises(ValueError, match="offload=True"):
        PlannedChain(list(chain), saved, slots=200)


def test_whole_model_with_offload_is_exact_and_summarized(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*_chain(), torch.nn.Linear(64, 1))
    x = torch.randn(2048, 64)
    grads, _ = _reference(model, x)
    offloading = second_tier(str(tmp_path), None, "cpu", None)  # the tier remat finds for these arguments
    offloading.bandwidth = FREE
    explorer = hr.explore(model, (x,), settings=hr.Settings(block_options="autograd", offload=str(tmp_path)))
    plan = explorer.plan(int(explorer.smallest_feasible_bytes * 1.15))
    assert plan.chain.offloads and "offloading: x_" in plan.summary()
    assert explorer.smallest_feasible_bytes <= explorer.smallest_feasible(offload=False)
    without = explorer.plan(int(explorer.smallest_feasible_bytes * 1.15), offload=False)
    assert plan.predicted_step_time <= without.predicted_step_time
    module = hr.remat(model, (x,), plan=plan, settings=hr.Settings(offload=str(tmp_path)))
    runner = next(iter(module._planned.values())).chain_module.planned.runner
    assert runner.tier is offloading.tier_for(transfer_plan(plan.chain.costs, plan.chain.schedule))
    runner.tier.peak_bytes = 0
    for p in model.parameters():
        p.grad.zero_()
    with LiveTensorTracker() as tracker:
        torch.manual_seed(7)
        module(x).sum().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert tracker.peak_bytes <= plan.predicted_peak_bytes
    assert runner.tier.peak_bytes > 0 and runner.tier.held_bytes == 0
    assert [str(tmp_path)] == [os.path.dirname(runner.tier.directory)]


def test_a_compiled_training_step_offloads_exactly(tmp_path):
    """``torch.compile`` of a whole training step around a module whose plan offloads: the chain runs eagerly
    inside it (a graph break), gradients bitwise plain autograd's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*_chain(), torch.nn.Linear(64, 1))
    x = torch.randn(2048, 64)
    grads, _ = _reference(model, x)
    second_tier(str(tmp_path), None, "cpu", None).bandwidth = FREE
    # (compiled code keeps the model's output alive through the backward: planned so)
    explorer = hr.explore(model, (x,),
                          settings=hr.Settings(block_options="autograd", output_held=True, offload=str(tmp_path)))
    plan = explorer.plan(int(explorer.smallest_feasible_bytes * 1.15))
    assert plan.chain.offloads
    module = hr.remat(model, (x,), plan=plan, settings=hr.Settings(offload=str(tmp_path)))

    def train_step(m):
        m(x).sum().backward()

    compiled = torch.compile(train_step, backend="aot_eager")
    for _ in range(2):
        for p in model.parameters():
            p.grad.zero_()
        torch.manual_seed(7)
        compiled(module)
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


def test_bad_offload_arguments_are_refused_before_training(tmp_path):
    with pytest.raises(ValueError, match="offload_limit"):
        check_offload(False, "1GiB")
    with pytest.raises(ValueError, match="offload=''"):
        check_offload("", None)
    with pytest.raises(TypeError, match="offload must be"):
        check_offload(3, None)
    with pytest.raises(ValueError, match="offload_limit"):
        check_offload(True, 12)  # (looks like a count, not bytes)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    chain, x = _chain(2), torch.randn(8, 64)
    with pytest.raises(OffloadError, match="cannot make a directory"):
        hr.plan_sequential(chain, "64MiB", x, offload=str(blocker / "sub"))
    with pytest.raises(OffloadError, match="free"):
        hr.checkpoint_sequential(chain, "64MiB", x.requires_grad_(), offload=str(tmp_path), offload_limit="1000TiB")


@pytest.mark.parametrize("seed", range(6))
def test_transfer_plan_agrees_with_the_simulator(seed):
    rng = np.random.default_rng(seed)
    offloading_schedules = kept_offloading_schedules = 0
    for _ in range(20):
        costs = random_chain(rng, int(rng.integers(3, 8)), 3, offload=True)
        floor = min_peak_schedule(costs).predicted_peak_bytes
        schedule = solve_chain(costs, max(floor, int(sum(costs.activation_bytes) * 0.6)), slots=10**3).schedule
        transfers = transfer_plan(costs, schedule)
        result = simulate(costs, schedule)
        free = simulate(replace(costs, tier=FREE), schedule)
        assert result.time - free.time == pytest.approx(transfers.stall_seconds, abs=1e-6)
        offloads = [op.stage for op in schedule.ops if isinstance(op, Offload)]
        options = {}
        kept = []
        for op in schedule.ops:
            if isinstance(op, FAll):
                options[op.stage] = op.option
            elif isinstance(op, OffloadKept):
                kept.append((op.stage, options[op.stage]))
        offloading_schedules += bool(offloads)
        kept_offloading_schedules += bool(kept)
        assert list(transfers.offloaded) == offloads
        assert [(i, k) for i, k, _ in transfers.kept_offloaded] == kept
        kept_bytes = {i: costs.stages[i].options[k].kept_bytes + (costs.activation_bytes[i] if sent else 0)
                      for i, k, sent in transfers.kept_offloaded}
        assert transfers.moved_bytes == sum(costs.activation_bytes[i] for i in offloads) + sum(kept_bytes.values())
        peaks = [e.peak_bytes for e in result.timeline]
        for prefetches, fetch, offload, nbytes in (
            (transfers.prefetches, Fetch, Offload, costs.activation_bytes),
            (transfers.kept_prefetches, FetchKept, OffloadKept, kept_bytes),
        ):
            for start, stage in prefetches:
                end = min(i for i, op in enumerate(schedule.ops) if isinstance(op, fetch) and op.stage == stage and i > start)
                assert not any(isinstance(op, offload) and op.stage == stage for op in schedule.ops[start:end])
                for k in range(start, end):
                    peaks[k] += nbytes[stage]
        assert max(peaks) <= result.peak_bytes
    assert offloading_schedules >= 3 and kept_offloading_schedules >= 3
