"""The same runtime checks on a CUDA device (skipped where there is none)."""

import copy

import pytest
import torch

import hierremat as hr
from hierremat.device import CudaPeakMeter
from hierremat.device.memory import memory_meter

from harness import Checkpointed, model_loss, train_step
from models import conv_chain, random_mlp_chain

pytestmark = pytest.mark.cuda


def _step(model, x, budget=None, seed=0):
    """(input gradient, parameter gradients, the CUDA meter's peak) of one step, the output held through it."""
    run = model if budget is None else Checkpointed(model, budget)
    step = train_step(run, (x,), lambda y: y.sum(), seed=seed, input_grad=True, hold_output=True, meters="device")
    return step.input_grad, list(step.grads), step.device_peak


@pytest.mark.parametrize("make, shape", [(lambda: random_mlp_chain(0, width=256), (512, 256)), (conv_chain, (32, 3, 32, 32))])
def test_cuda_gradients_equal_autograd_and_peak_within_budget(make, shape):
    """cuDNN deterministic and without TF32: PyTorch lets cuDNN convolutions run in TF32 by default, and its
    heuristics may pick another algorithm for a recomputation than for the plain forward (1.7e-3 apart on
    an H200, torch 2.11), which an exactness check cannot tell from a wrong gradient."""
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True, allow_tf32=False):
        _check_gradients_and_peak(make, shape)


def _check_gradients_and_peak(make, shape):
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = make().to(device)
    reference = copy.deepcopy(model)
    x = torch.randn(*shape, device=device)
    gx_ref, g_ref, plain_peak = _step(reference, x)
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan_sequential(model, "1KiB", x.requires_grad_())
    lo = err.value.min_budget_bytes
    for budget in (lo, (lo + plain_peak) // 2, plain_peak, 2**36):
        budget = f"{budget}B"
        hr.checkpoint_sequential(model, budget, x)  # plan outside the measured step
        gx, g, peak = _step(model, x, budget)
        # (fp32 sums in another order: the first convolution's weight gradient came 1.7e-6 from plain's)
        torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"input, {budget}: {m}")
        for a, b in zip(g, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{budget}: {m}")
        # the allocator rounds blocks up to 512 bytes
        assert peak <= hr.parse_budget(budget) + 512 * 64


def test_cuda_rng_state_unchanged_by_recomputation():
    device = torch.device("cuda")
    model = random_mlp_chain(1, width=128).to(device)
    reference = copy.deepcopy(model)
    x = torch.randn(256, 128, device=device, requires_grad=True)
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan_sequential(model, "1KiB", x)
    budget = f"{err.value.min_budget_bytes}B"
    torch.manual_seed(3)
    reference(x).sum().backward()
    after_reference = torch.cuda.get_rng_state()
    torch.manual_seed(3)
    hr.checkpoint_sequential(model, budget, x).sum().backward()
    assert torch.equal(torch.cuda.get_rng_state(), after_reference)
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_memory_meter_is_allocator_based_on_cuda():
    assert isinstance(memory_meter("cuda"), CudaPeakMeter)


def test_cuda_whole_gpt2_with_ilp_options(tmp_path):
    """ILP block options executed op by op on the GPU: gradients equal autograd's, peak within budget."""
    pytest.importorskip("transformers")
    from models import tiny_gpt2

    device = torch.device("cuda")
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=3).to(device)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 256, (2, 64), device=device)
    kwargs = {"labels": ids, "use_cache": False}
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan(model, (ids,), kwargs, budget="1KiB", settings=hr.Settings(cache=str(tmp_path)))
    budget = err.value.min_budget_bytes + (1 << 20)
    module = hr.remat(model, (ids,), kwargs, budget=f"{budget}B", settings=hr.Settings(cache=str(tmp_path)))
    assert module.plans[0].menus

    def step(m):
        taken = train_step(m, (ids,), model_loss, kwargs=kwargs, meters="device")
        return list(taken.grads), taken.device_peak

    step(module)  # the first step tells the plan how the output is used
    grads, peak = step(module)
    grads_ref, _ = step(reference)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert peak <= budget + 512 * 64  # the allocator rounds blocks up to 512 bytes


def _dropout_chain(width: int = 256) -> torch.nn.Sequential:
    return torch.nn.Sequential(*[
        torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Dropout(0.1)) for _ in range(6)
    ])


def _tight_budget(model, x, block_options: str = "ilp") -> str:
    """A budget between the smallest feasible and plain autograd's peak: something is recomputed."""
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan_sequential(model, "1KiB", x, block_options=block_options)
    lo = err.value.min_budget_bytes
    return f"{lo + lo // 4}B"


@pytest.mark.parametrize("block_options", ["ilp", "autograd"])
def test_cuda_step_does_not_synchronize_the_host(block_options):
    """Recomputations, replays (RNG states) and block options run without a host synchronization:
    with CUDA's sync debug mode set to error, any synchronizing call in a planned step raises. With ILP menus
    the tight budget may be met by block options that recompute inside their blocks; with autograd's options
    alone, whole stages are recomputed."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = _dropout_chain().to(device)
    x = torch.randn(512, 256, device=device, requires_grad=True)
    budget = _tight_budget(model, x, block_options)
    hr.checkpoint_sequential(model, budget, x, block_options=block_options).sum().backward()  # plans (and syncs)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        hr.checkpoint_sequential(model, budget, x, block_options=block_options).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    schedule = list(hr.plan_cache._plans.values())[-1].plan.schedule
    stages_recomputed = max(schedule.forward_counts()) > 1
    options_recomputing = any(getattr(op, "option", 0) > 0 for op in schedule.ops)
    assert stages_recomputed or options_recomputing, schedule
    if block_options == "autograd":
        assert stages_recomputed, schedule


def test_cuda_stages_run_on_the_callers_stream():
    """A step on a side stream gives the gradients of the same step on the default stream."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = _dropout_chain().to(device)
    x = torch.randn(512, 256, device=device)
    budget = _tight_budget(model, x.clone().requires_grad_())
    results = []
    for stream in (torch.cuda.current_stream(device), torch.cuda.Stream(device)):
        for p in model.parameters():
            p.grad = None
        xi = x.clone().requires_grad_()
        torch.cuda.synchronize(device)
        with torch.cuda.stream(stream):
            torch.manual_seed(1)
            hr.checkpoint_sequential(model, budget, xi).square().sum().backward()
        stream.synchronize()
        results.append([xi.grad.clone()] + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
