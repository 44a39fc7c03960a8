"""Hugging Face models called the way Hugging Face's docs call them.

Each model is built from a small config (nothing downloaded), wrapped with ``hr.remat``
on the same call it is trained with, and trained at its smallest feasible budget and
between that and plain autograd's peak: gradients bitwise equal to plain autograd's and
the live-tensor peak within the budget. Decoders return no key/value cache in training
(``use_cache=False``, as Hugging Face's gradient checkpointing does) without being told.
"""

import copy

import pytest
import torch

import hierremat as hr
from hierremat.device import LiveTensorTracker

from harness import train_step
from models import same_bits, tiny_bert, tiny_gpt2, tiny_llama, tiny_qwen2, tiny_vit

pytest.importorskip("transformers")


def _causal_lm_call():
    ids = torch.randint(0, 256, (2, 40))
    return {"input_ids": ids, "labels": ids}


def _masked_lm_call():
    """What a tokenizer and DataCollatorForLanguageModeling give: padding, token types, -100 labels."""
    ids = torch.randint(5, 256, (2, 40))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 30:] = 0
    labels = torch.full_like(ids, -100)
    labels[:, ::7] = ids[:, ::7]
    return {"input_ids": ids, "attention_mask": attention_mask, "token_type_ids": torch.zeros_like(ids), "labels": labels}


def _image_classification_call():
    return {"pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.randint(0, 10, (4,))}


MODELS = {
    "llama": (tiny_llama, _causal_lm_call),
    "qwen2": (tiny_qwen2, _causal_lm_call),
    "bert": (tiny_bert, _masked_lm_call),
    "vit": (tiny_vit, _image_classification_call),
}


def _step(model, inputs, hold_outputs: bool, seed=3):
    """One step as Hugging Face's docs write it (``outputs = model(**inputs); outputs.loss.backward()``,
    the outputs held through the backward) or as its Trainer does (the loss alone is kept)."""
    caches = []  # (the cache the outputs return is held through the backward, as a caller holds it)

    def loss(outputs):
        caches.append(getattr(outputs, "past_key_values", None))
        return outputs.loss

    step = train_step(model, (), loss, seed=seed, kwargs=inputs, hold_output=hold_outputs, meters="device")
    names = [n for n, _ in model.named_parameters()]
    return caches[0], dict(zip(names, step.grads, strict=True)), step.device_peak


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_hugging_face_model_trains_bitwise_within_budget(name, device):
    """On CUDA: gradients within 1e-5 relative (CUDA's embedding backward accumulates with
    atomics), peaks within the allocator's 512-byte rounding of the budget."""
    make, call = MODELS[name]
    torch.manual_seed(0)
    model = make().to(device)
    inputs = {k: v.to(device) for k, v in call().items()}
    reference = copy.deepcopy(model)
    _, grads_ref, plain_peak = _step(reference, inputs, hold_outputs=True)
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan(model, (), inputs, budget="1KiB")
    low = err.value.min_budget_bytes  # the smallest budget, if the caller keeps only the loss
    assert low < plain_peak
    for budget, hold in ((low, False), ((low + plain_peak) // 2, True)):
        module = hr.remat(model, (), inputs, budget=f"{budget}B")
        cache, grads, peak = _step(module, inputs, hold)
        assert peak <= budget + (0 if device == "cpu" else 512 * 64), (name, budget, peak, module.plans[0].summary())
        assert cache is None
        for key, g in grads.items():
            ref = grads_ref[key.removeprefix("model.")]
            if device == "cpu":
                assert same_bits(g, ref), (name, budget, key)
            else:
                torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6)
    assert any(not p.chain.schedule.keeps_everything for p in module.plans)


def test_decoder_in_training_gets_use_cache_false_with_one_log_line(caplog, fresh_session):
    # (logged once per planner session and model class, as HF's warning_once)
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2)
    ids = torch.randint(0, 256, (2, 32))
    with caplog.at_level("INFO", logger="hierremat.blocks.hf"):
        module = hr.remat(model, (ids,), {"labels": ids}, budget="1GiB")  # HF's natural call: use_cache unset
        for _ in range(3):
            out = module(ids, labels=ids)
            out.loss.backward()
        module(ids, labels=ids, use_cache=False).loss.backward()  # the explicit call plans nothing new
    assert out.past_key_values is None and len(module.plans) == 1
    lines = [r for r in caplog.records if "use_cache=False" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]


def test_model_returning_a_cache_is_captured_not_refused():
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2).eval()
    ids = torch.randint(0, 256, (2, 32))
    module = hr.remat(model, (ids,), budget="1GiB")
    with torch.no_grad():
        out, ref = module(ids), model(ids)
    assert type(out.past_key_values) is type(ref.past_key_values)
    assert torch.equal(out.logits, ref.logits)
    assert torch.equal(out.past_key_values.layers[1].values, ref.past_key_values.layers[1].values)


def _lora(model):
    """LoRA adapters (rank 4) on the attention projections; everything else frozen."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(model, config)


def test_lora_fine_tune_plans_in_less_memory_and_leaves_frozen_parameters_without_grad():
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (1, 16))  # few tokens, wide layers: the weight gradients LoRA avoids matter
    inputs = {"input_ids": ids, "labels": ids}
    full = tiny_llama(hidden_size=256)
    lora = _lora(copy.deepcopy(full))
    lora.train()
    smallest = {}
    for kind, model in (("full", full), ("lora", lora)):
        with pytest.raises(hr.InfeasibleBudgetError) as err:
            hr.plan(model, (), inputs, budget="1KiB")
        smallest[kind] = err.value.min_budget_bytes
    assert smallest["lora"] < smallest["full"], smallest

    reference = copy.deepcopy(lora)
    for p in reference.parameters():
        p.grad = None
    torch.manual_seed(3)
    reference(**inputs).loss.backward()
    module = hr.remat(lora, (), inputs, budget=f"{smallest['lora']}B")
    assert not module.plans[0].chain.schedule.keeps_everything
    for p in lora.parameters():  # as in any step after the first: the trained parameters have .grad
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    torch.manual_seed(3)
    with LiveTensorTracker() as tracker:
        module(**inputs).loss.backward()
    assert tracker.peak_bytes <= smallest["lora"]
    trained = 0
    for (name, p), q in zip(lora.named_parameters(), reference.parameters()):
        if p.requires_grad:
            trained += 1
            assert same_bits(p.grad, q.grad), name
        else:
            assert p.grad is None, name
    assert trained == 4 * 2  # A and B of q_proj and v_proj in 2 layers
