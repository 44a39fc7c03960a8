"""A parameter read by several stages (GPT-2's and T5's tied embedding and LM head) reaches its
``AccumulateGrad`` once per step, with the complete gradient, as in plain autograd
(hierremat.runtime.tied): post-accumulate-grad hooks fire once, DistributedDataParallel with
its defaults accepts the step (tests/test_distributed.py: with one rank its reducer does not
check), and the gradients stay plain autograd's bit for bit."""

import copy

import pytest
import torch

import hierremat as hr
from hierremat.blocks.capture import capture
from hierremat.blocks.hf import call_kwargs
from hierremat.blocks.segment import build_chain_graph
from hierremat.device import LiveTensorTracker
from hierremat.runtime.tied import TiedParameters

from models import same_bits, seq2seq_call, tiny_gpt2, tiny_t5

pytest.importorskip("transformers")


def _gpt2():
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=3)
    ids = torch.randint(0, 256, (4, 128))  # activations outweigh the gradients the first step allocates
    return model, (ids,), {"labels": ids, "use_cache": False}


def _t5():
    torch.manual_seed(0)
    return tiny_t5(layers=2, d_model=64), (), seq2seq_call()


def _smallest_budget(model, args, kwargs, **settings) -> int:
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan(model, args, kwargs, budget="1KiB", settings=hr.Settings(**settings))
    return err.value.min_budget_bytes


def _steps(model, args, kwargs, hooked, steps: int = 2):
    """``steps`` steps, the first with ``.grad`` None, the next with it zeroed in place; per step:
    the gradients, how often each parameter's post-accumulate-grad hook fired, the peak."""
    calls: dict[str, int] = {}
    handles = [p.register_post_accumulate_grad_hook(lambda _, n=n: calls.__setitem__(n, calls.get(n, 0) + 1))
               for n, p in hooked.named_parameters()]
    out = []
    try:
        for step in range(steps):
            if step:
                for p in model.parameters():
                    p.grad.zero_()
            calls.clear()
            torch.manual_seed(5 + step)
            with LiveTensorTracker() as tracker:
                model(*args, **kwargs).loss.backward()
            out.append(({n: p.grad.clone() for n, p in hooked.named_parameters()}, dict(calls), tracker.peak_bytes))
    finally:
        for h in handles:
            h.remove()
    return out


@pytest.mark.parametrize("name, variants", [("gpt2", True), pytest.param("gpt2", False, marks=pytest.mark.slow),
                                           ("t5", True)])
def test_tied_weights_accumulate_once_per_step_with_plain_autograds_gradient(name, variants):
    model, args, kwargs = {"gpt2": _gpt2, "t5": _t5}[name]()
    reference = copy.deepcopy(model)
    expected = _steps(reference, args, kwargs, reference)
    budget = _smallest_budget(model, args, kwargs, variants=variants)
    chain = build_chain_graph(capture(model, args, call_kwargs(model, kwargs)), model)
    assert TiedParameters([[s] for s in chain.stages]), "the embedding and the LM head are read by two stages"
    module = hr.remat(model, args, kwargs, budget=f"{budget}B", settings=hr.Settings(variants=variants))
    (plan,) = module.plans
    assert max(plan.chain.schedule.forward_counts()) > 1, plan.summary()
    got = _steps(module, args, kwargs, model)
    for (grads, calls, _), (grads_ref, calls_ref, _) in zip(got, expected):
        assert calls == calls_ref and set(calls.values()) == {1}, calls
        assert all(same_bits(grads[n], g) for n, g in grads_ref.items())
    assert got[-1][2] <= budget  # (the budget's convention: .grad allocated before the step)

