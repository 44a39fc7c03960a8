"""Forwards without a tape (hierremat.runtime.tapeless): grad mode, nothing kept for a backward."""

import pytest
import torch
from torch import nn

from hierremat.device import memory_meter
from hierremat.runtime.executor import detach_output
from hierremat.runtime.tapeless import tapeless


def test_a_tapeless_forward_holds_what_a_forward_without_grad_holds_and_cannot_be_backpropagated():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(32, 64)
    peaks, outputs = {}, {}
    for name, context in (("no_grad", torch.no_grad), ("tapeless", tapeless), ("grad", torch.enable_grad)):
        with memory_meter(torch.device("cpu")) as tracker:
            with context():
                out = mlp(x)
            outputs[name] = out
            del out
        peaks[name] = tracker.peak_bytes
    assert peaks["tapeless"] == peaks["no_grad"] < peaks["grad"]
    assert torch.equal(outputs["tapeless"], outputs["grad"])
    assert outputs["tapeless"].grad_fn is not None and detach_output(outputs["tapeless"]).grad_fn is None
    with pytest.raises(RuntimeError, match="without a tape"):
        outputs["tapeless"].sum().backward()
