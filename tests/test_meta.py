"""Models planned without their weights: built on meta, planned, then materialized.

A model built under ``torch.device("meta")`` is captured on meta and planned with real weights lent
per distinct stage on ``device=`` (hierremat.runtime.lent_weights); after ``to_empty`` and
initialization the module computes with the model's own weights. Checked: the memory the plan is
made from is the materialized twin's, to the byte; the lent copies are dropped after planning; the
materialized model trains with gradients bitwise plain autograd's and both CPU meters within the
prediction and the budget; wrong uses are refused with what to do.
"""

import contextlib
import operator

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import hierremat as hr
from hierremat.device import LiveTensorTracker
from hierremat.device.memory import CpuAllocatorMeter

from models import tiny_gpt2, tiny_llama

pytest.importorskip("transformers")

FIGURES = ("kept_bytes", "fwd_overhead_bytes", "bwd_overhead_bytes", "bwd_overhead_new_grads_bytes")


def _on_meta(make):
    with torch.device("meta"):
        return make()


def _gpt2():
    return tiny_gpt2(n_layer=3, n_embd=64, vocab_size=512)


def _llama():
    return tiny_llama(n_layer=3, hidden_size=64)


def test_a_model_on_meta_is_planned_from_its_materialized_twins_memory():
    torch.manual_seed(0)
    real, meta = _gpt2(), _on_meta(_gpt2)
    ids = torch.randint(0, 512, (2, 32))
    planned = hr.plan(real, (ids,), {"labels": ids}, budget="1500KiB", settings=hr.Settings(cache=False))
    on_meta = hr.plan(meta, (ids,), {"labels": ids}, budget="1500KiB", device="cpu", settings=hr.Settings(cache=False))
    assert on_meta.signatures == planned.signatures
    a, b = planned.chain.costs, on_meta.chain.costs
    assert a.activation_bytes == b.activation_bytes and a.output_grad_bytes == b.output_grad_bytes
    assert a.step_grad_bytes == b.step_grad_bytes != ()  # the model's own gradients, not the shared lent copies
    for x, y in zip(a.stages, b.stages):
        assert [getattr(x.options[0], f) for f in FIGURES] == [getattr(y.options[0], f) for f in FIGURES]
    # one copy per distinct stage: the three identical blocks share theirs
    block = sum(p.numel() * p.element_size() for p in real.transformer.h[0].parameters())
    total = sum(p.numel() * p.element_size() for p in real.parameters())
    assert 0 < on_meta.lent_weight_bytes <= total - block and "planned without its weights" in on_meta.summary()
    assert planned.lent_weight_bytes == 0 and "planned without its weights" not in planned.summary()
    assert hr.ModelPlan.from_json(on_meta.to_json()).lent_weight_bytes == on_meta.lent_weight_bytes
    peaks = on_meta.chain.stage_peaks()  # each stage's predicted peak, in the summary (the plan's may be at the Loss)
    assert len(peaks) == len(on_meta.stages) and 0 < max(peaks) <= on_meta.chain.predicted_peak_bytes


@pytest.mark.parametrize("make, autocast", [(_gpt2, False), pytest.param(_llama, True, marks=pytest.mark.slow)],
                         ids=["gpt2-fp32", "llama-bf16"])
def test_a_model_planned_on_meta_trains_bitwise_within_budget_once_materialized(make, autocast):
    def context():
        return torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()

    torch.manual_seed(0)
    reference, model = make(), _on_meta(make)
    vocab = reference.config.vocab_size
    ids = torch.randint(0, vocab, (2, 32))
    with context():
        low = hr.explore(reference, (ids,), {"labels": ids}, settings=hr.Settings(cache=False)).smallest_feasible_bytes
        budget = int(low * 1.15)
        module = hr.remat(model, (ids.to("meta"),), {"labels": ids.to("meta")}, budget=f"{budget}B", device="cpu",
                          settings=hr.Settings(cache=False),
                          )
    plan = module.plans[0]
    assert plan.lent_weight_bytes > 0 and not plan.chain.schedule.keeps_everything
    compiled = next(iter(module._planned.values()))
    for graph in compiled.graphs():  # the lent copies were given back: every graph reads the model's meta tensors
        gm = getattr(graph, "graph_module", graph)
        for node in gm.graph.find_nodes(op="get_attr"):
            value = operator.attrgetter(node.target)(gm)
            assert not isinstance(value, torch.Tensor) or value.is_meta, node.target
    with pytest.raises(hr.UnsupportedModelError, match="to_empty"), context():
        module(ids, labels=ids)
    model.to_empty(device="cpu")
    model.tie_weights()  # (Hugging Face ties the embedding and the head again after to_empty)
    model.load_state_dict(reference.state_dict())  # the initialization: the reference's weights,
    with torch.no_grad():  # and its buffers outside the state dict (Llama's rotary frequencies)
        for name, buffer in reference.named_buffers():
            model.get_buffer(name).copy_(buffer)
    for step in range(2):
        for m in (model, reference):
            for p in m.parameters():
                p.grad = None
        for m in (module, reference):
            torch.manual_seed(step)
            with context():
                loss = m(ids, labels=ids).loss
            loss.backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters())), step
    assert len(module.plans) == 1  # the plan made on meta, not a new one
    # (under bf16 autocast the CPU allocator also sees the bf16 kernels' scratch, which the profile's meter, the
    # tracker, does not: about 2% above the prediction here, for this model planned with its own weights too)
    for meter in (LiveTensorTracker(), CpuAllocatorMeter()) if not autocast else (LiveTensorTracker(),):
        for p in model.parameters():
            p.grad = None
        with meter:
            with context():
                loss = module(ids, labels=ids).loss
            loss.backward()
        assert meter.peak_bytes <= module.plans[0].predicted_peak_bytes <= budget, (type(meter).__name__, meter.peak_bytes)


def test_a_model_built_under_fake_tensor_mode_is_planned_on_the_device_its_fakes_stand_for():
    """FakeTensorMode instead of meta: device= defaults to the device its fake tensors say they are on, and
    the example inputs may be fake too. The plan's memory is the real twin's to the byte; once the model
    holds real weights (``load_state_dict(..., assign=True)``: fake tensors have no ``to_empty``) the
    module trains with gradients bitwise plain autograd's."""
    torch.manual_seed(0)
    reference = _gpt2()
    with FakeTensorMode():
        model = _gpt2()
        fake_ids = torch.randint(0, 512, (2, 32))
    ids = torch.randint(0, 512, (2, 32))
    planned = hr.plan(reference, (ids,), {"labels": ids}, budget="1500KiB", settings=hr.Settings(cache=False))
    module = hr.remat(model, (fake_ids,), {"labels": fake_ids}, budget="1500KiB", settings=hr.Settings(cache=False))
    plan = module.plans[0]
    assert plan.lent_weight_bytes > 0 and "planned without its weights" in plan.summary()
    assert plan.chain.costs.activation_bytes == planned.chain.costs.activation_bytes
    for x, y in zip(planned.chain.costs.stages, plan.chain.costs.stages):
        assert [getattr(x.options[0], f) for f in FIGURES] == [getattr(y.options[0], f) for f in FIGURES]
    with pytest.raises(hr.UnsupportedModelError, match="to_empty"):
        module(ids, labels=ids)
    model.load_state_dict(reference.state_dict(), assign=True)
    model.tie_weights()  # (assign=True gives each name a parameter of its own)
    for m in (module, reference):
        torch.manual_seed(1)
        m(ids, labels=ids).loss.backward()
    grads = dict(reference.named_parameters())
    assert all(torch.equal(p.grad, grads[name].grad) for name, p in model.named_parameters())
    assert len(module.plans) == 1


def test_wrong_uses_of_device_are_refused_with_what_to_do():
    ids = torch.randint(0, 256, (2, 16))
    with pytest.raises(hr.UnsupportedModelError, match="device="):
        hr.plan(_on_meta(lambda: tiny_gpt2(n_layer=1)), (ids,), budget="1GiB", settings=hr.Settings(cache=False))
    with pytest.raises(ValueError, match="device="):
        hr.plan(tiny_gpt2(n_layer=1), (ids,), budget="1GiB", device="cuda", settings=hr.Settings(cache=False))
    with pytest.raises(ValueError, match="device"):
        hr.plan(tiny_gpt2(n_layer=1), (ids,), budget="1GiB", device="tpu", settings=hr.Settings(cache=False))


def test_weights_that_cannot_be_lent_are_named_with_their_bytes(monkeypatch):
    from hierremat.runtime import lent_weights

    def no_room(like, device, generator=None):
        raise RuntimeError("DefaultCPUAllocator: not enough memory")

    monkeypatch.setattr(lent_weights, "lent_value", no_room)
    ids = torch.randint(0, 256, (2, 16))
    with pytest.raises(hr.UnsupportedModelError, match=r"MiB\) could not be allocated"):
        hr.plan(_on_meta(lambda: tiny_gpt2(n_layer=1)), (ids,), budget="1GiB", device="cpu",
                settings=hr.Settings(cache=False))


def test_without_weights_gives_meta_tensors_of_whole_shapes_keeps_ties_and_puts_everything_back():
    """hierremat.runtime.fsdp.without_weights (a new shape of an FSDP2-sharded model is planned through it): within,
    every parameter and buffer is a meta tensor of its shape and dtype, tied weights one tensor; after, even on an
    error inside, the model's own tensors again (the FSDP2 case runs in tests/test_distributed.py)."""
    from hierremat.runtime.fsdp import without_weights

    model = tiny_gpt2(n_layer=1)
    own = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    with pytest.raises(RuntimeError, match="inside"):
        with without_weights(model):
            for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
                assert t.is_meta and t.shape == own[name].shape and t.dtype == own[name].dtype, name
            assert model.lm_head.weight is model.transformer.wte.weight
            assert all(p.requires_grad for p in model.parameters())
            raise RuntimeError("inside")
    now = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    assert now.keys() == own.keys() and all(now[k] is own[k] for k in own)
