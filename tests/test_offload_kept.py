"""Offloading what a block option keeps: ``Offload_kept(i)`` after ``F_all(i, k)`` sends the tape's kept
storages to the second tier while the later stages run, ``Fetch_kept(i)`` brings them back before ``B(i)``.

Checked on CPU with the disk tier: views of one kept storage come back viewing one storage; storages the stage's
input, output or parameters hold stay; a planned chain with block options (ILP menus) that offloads kept values
gives gradients bitwise plain autograd's (dropout replayed), the live-tensor tracker and the allocator meter at
most the predicted peak, and the tier's peak equal to the plan's; option 0 (autograd's saved tensors) cannot be
offloaded this way.
"""

import contextlib

import pytest
import torch

import hierremat as hr
from hierremat.api.sequential import _plan
from hierremat.device import LiveTensorTracker
from hierremat.device.memory import CpuAllocatorMeter
from hierremat.plans.costs import TierBandwidth
from hierremat.plans.schedule import Backward, ChainSchedule, FAll, FetchKept, Loss, OffloadKept
from hierremat.plans.transfers import TransferPlan, transfer_plan
from hierremat.runtime.block_exec import OptionTape
from hierremat.runtime.executor import ChainRunner
from hierremat.runtime.kept_offload import bring_back_kept, send_kept
from hierremat.runtime.offload import Offloading
from hierremat.runtime.second_tier import DiskTier

from harness import CALLERS_LOSS_BYTES

FREE = TierBandwidth("disk", 1e12, 1e12)  # transfers that cost nothing: the DP offloads wherever it saves time


def test_kept_views_of_one_storage_come_back_viewing_one_storage():
    base = torch.randn(6, 8)
    alone = torch.randn(5).to(torch.bfloat16)
    weight = torch.randn(8, 8)
    tape = OptionTape([base, base.t(), base[2:, 1::2], alone, weight.t(), torch.empty(0)], None, None)
    expected = [(v.clone(), v.stride()) for v in tape.kept]
    with DiskTier(2**20) as tier:
        away = send_kept(tier, ("step", 3, "kept"), tape, [weight])
        assert [v is None for v in tape.kept] == [True, True, True, True, False, False]
        assert tier.held_bytes == base.numel() * 4 + alone.numel() * 2 == tier.file_bytes
        del base, alone
        bring_back_kept(tier, away, tape)
        assert tier.held_bytes == 0
    for value, (want, stride) in zip(tape.kept, expected):
        assert value.dtype == want.dtype and value.stride() == stride and torch.equal(value, want)
    storages = {v.untyped_storage().data_ptr() for v in tape.kept[:3]}
    assert len(storages) == 1  # (one storage, viewed three ways, as the option kept it)
    assert tape.kept[4].untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()


@pytest.mark.parametrize("with_input", [False, True])
def test_a_pinned_input_goes_with_the_kept_values_only_where_the_plan_says(with_input):
    x = torch.randn(4, 8)
    tape = OptionTape([x[:, :4], torch.randn(3)], x, None)
    with DiskTier(2**20) as tier:
        away = send_kept(tier, ("step", 1, "kept"), tape, [] if with_input else [x], with_input)
        assert (tape.x is None) == with_input and (tape.kept[0] is None) == with_input and tape.kept[1] is None
        assert tier.held_bytes == 12 + (32 * 4 if with_input else 0)
        bring_back_kept(tier, away, tape)
    assert torch.equal(tape.x, x) and torch.equal(tape.kept[0], x[:, :4])
    assert tape.kept[0].untyped_storage().data_ptr() == tape.x.untyped_storage().data_ptr()


def test_a_failed_copy_leaves_nothing_in_the_tier():
    tape = OptionTape([torch.randn(64), torch.randn(64)], None, None)
    with DiskTier(300) as tier:  # room for the first value only
        with pytest.raises(hr.OffloadError):
            send_kept(tier, ("step", 0, "kept"), tape, [])
        assert tier.held_bytes == 0 and all(v is not None for v in tape.kept)


def test_autograd_options_kept_values_cannot_be_offloaded():
    chain = [torch.nn.Linear(4, 4) for _ in range(2)]
    ops = (FAll(0, 0), OffloadKept(0), FAll(1, 0), Loss(), Backward(1), FetchKept(0), Backward(0))
    schedule = ChainSchedule(ops, 2, predicted_time=0.0, predicted_peak_bytes=0, budget_bytes=0, memory_unit_bytes=1)
    with DiskTier(2**20) as tier, pytest.raises(ValueError, match="option 0"):
        ChainRunner(chain, schedule, [()] * 2, tier=tier, transfers=TransferPlan(kept_offloaded=((0, 0, False),)))


def _chain(n: int = 8, width: int = 96):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[
        torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(), torch.nn.Dropout(0.1),
                            torch.nn.Linear(2 * width, width), torch.nn.Tanh())
        for _ in range(n)
    ])


def _floor(chain, x, offloading) -> int:
    try:
        _plan(list(chain), 2**16, x, slots=200, compile=False, offloading=offloading)
    except hr.InfeasibleBudgetError as err:
        return err.min_budget_bytes
    raise AssertionError("64 KiB fits")


@pytest.mark.parametrize("setup", ["fp32", "bf16 autocast, .grad None"])
def test_planned_chain_offloads_kept_values_exactly_within_the_predicted_peak(tmp_path, setup):
    """A chain of ILP block options planned with a free second tier offloads kept values; one step gives plain
    autograd's gradients bitwise, at most the predicted peak on the tracker and the allocator. Under bf16 autocast
    (planned and run under it) with ``.grad`` None at the step's start (PyTorch's default zero_grad) as well."""
    bf16 = setup != "fp32"
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    chain, x = _chain(), torch.randn(1024, 96).requires_grad_()
    for p in chain.parameters():
        p.grad = None if bf16 else torch.zeros_like(p)
    xr = x.detach().requires_grad_()
    torch.manual_seed(7)
    with autocast():
        out = chain(xr)
    out.float().sum().backward()
    grads, x_grad = [p.grad.clone() for p in chain.parameters()], xr.grad.clone()

    offloading = Offloading(str(tmp_path), "64MiB", torch.device("cpu"), cache=None)
    offloading.bandwidth = FREE
    for p in chain.parameters():
        p.grad = None if bf16 else p.grad.zero_()
    with autocast():
        budget = int(_floor(chain, x, None) * 1.1)
        planned = _plan(list(chain), budget, x, slots=200, compile=False, offloading=offloading)
        without = _plan(list(chain), budget, x, slots=200, compile=False).plan
    plan = planned.plan
    transfers = transfer_plan(plan.costs, plan.schedule)
    assert transfers.kept_offloaded, plan.summary()
    assert "(off)" in ", ".join(plan.stage_actions()) and "values kept by the forwards with grad" in plan.summary()
    assert plan.predicted_step_time < without.predicted_step_time
    assert bool(sum(plan.costs.step_grad_bytes)) == bf16  # (the plan made for the gradients the step allocates)
    xr = x.detach().requires_grad_()
    tier = planned.runner.tier
    tier.peak_bytes = 0  # (from this step on: measuring the bandwidth held more)
    with CpuAllocatorMeter() as meter, LiveTensorTracker() as tracker:
        torch.manual_seed(7)
        with autocast():
            out = planned.run(xr)
        out.float().sum().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(chain.parameters(), grads))
    assert torch.equal(xr.grad, x_grad)
    assert tracker.peak_bytes <= plan.predicted_peak_bytes
    assert meter.peak_bytes <= plan.predicted_peak_bytes + CALLERS_LOSS_BYTES
    assert 0 < tier.peak_bytes <= transfers.tier_peak_bytes
    assert tier.held_bytes == 0 and tier.file_bytes == 0
