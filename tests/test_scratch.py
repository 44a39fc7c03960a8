"""What the CPU allocator holds beside the tracked tensors, in the plan: an operator's scratch wherever in a run it
falls (hierremat.device.memory.allocator_transients_in_marks, read from profiler events built here), and the chain
output that the caller holds through the last stage's backward, where that stage's tape was its only other holder
when it was profiled alone (hierremat.plans.costs.ChainCosts.bwd_overhead)."""

import pytest
import torch

from hierremat.api.sequential import _plan
from hierremat.device import LiveTensorTracker
from hierremat.device.memory import CpuAllocatorMeter, allocator_transients_in_marks

from harness import CALLERS_LOSS_BYTES

PREFIX = "mark:"
CPU = torch.autograd.DeviceType.CPU


class _Event:
    """The parts of a torch.profiler kineto event that allocator_transients_in_marks reads."""

    def __init__(self, name, start, end=None, nbytes=0, thread=1):
        self._name, self._start, self._end, self._nbytes, self._thread = name, start, start if end is None else end, \
            nbytes, thread

    def name(self):
        return self._name

    def start_ns(self):
        return self._start

    def end_ns(self):
        return self._end

    def duration_ns(self):
        return self._end - self._start

    def nbytes(self):
        return self._nbytes

    def start_thread_id(self):
        return self._thread

    def device_type(self):
        return CPU


def _memory(at, nbytes):
    return _Event("[memory]", at, nbytes=nbytes)


def test_an_operators_scratch_counts_wherever_in_the_run_it_falls():
    events = [
        _Event(PREFIX + "backward", 0, 100),
        _Event("aten::mm", 10, 20), _memory(11, 400), _memory(12, 50), _memory(13, -50),  # output 400, scratch 50
        _Event("aten::linear", 30, 60),  # (a composite: its inner ops' outputs are no scratch of its own)
        _Event("aten::t", 31, 32),
        _Event("aten::addmm", 40, 50), _memory(41, 200), _memory(42, 300), _memory(43, -300),  # scratch 300
        _memory(55, -400),  # (a free between operators)
        _Event("aten::sum", 70, 80), _memory(71, 8), _memory(72, 120), _memory(73, -120), _memory(74, -8),
        _Event("aten::mm", 110, 120), _memory(111, 999), _memory(112, -999),  # (after the range)
    ]
    assert allocator_transients_in_marks(events, PREFIX) == {"backward": 300}


def _chain(n: int = 4, width: int = 96):
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(n)]


@pytest.mark.parametrize("grads", ["allocated", "None"])
def test_the_output_the_caller_holds_is_in_the_last_backwards_peak(grads):
    """Plain autograd's schedule (keeping everything), the chain's output held by the caller through the
    backward: Tanh's tape pins it, and alone its backward freed it. Both meters at most the predicted peak
    (beside the test's own loss)."""
    chain, x = _chain(), torch.randn(512, 96, requires_grad=True)
    for p in (p for stage in chain for p in stage.parameters()):
        p.grad = torch.zeros_like(p) if grads == "allocated" else None
    planned = _plan(chain, 2**30, x, slots=200, block_options="autograd", compile=False)
    assert planned.plan.schedule.keeps_everything
    with CpuAllocatorMeter() as meter, LiveTensorTracker() as tracker:
        out = planned.run(x)
        out.sum().backward()
    predicted = planned.plan.predicted_peak_bytes
    assert tracker.peak_bytes <= predicted and meter.peak_bytes <= predicted + CALLERS_LOSS_BYTES, planned.plan.summary()
