"""Values carried along the chain beside its activation (residents): an encoder's output read by
every decoder layer, T5's position bias, a UNet's skip tensors.

Each layer of T5, BART and a small UNet is a stage of its own (identical layers share a
signature); trained at four budgets from the smallest feasible one to twice plain autograd's
peak, gradients are bitwise those of plain autograd and the live-tensor peak is within the
budget. The resident gradients are summed in the order plain autograd sums them.
"""

import contextlib
import copy
import json

import pytest
import torch
from torch import nn

import hierremat as hr
from hierremat.blocks.capture import capture
from hierremat.blocks.eager_masks import has_value_branch
from hierremat.blocks.hf import call_kwargs
from hierremat.blocks.segment import build_chain_graph
from hierremat.plans.model_plan import ModelPlan
from hierremat.device import memory_meter
from hierremat.plans.schedule import FCk, FNone, Loss
from hierremat.runtime import executor

from harness import train_step
from models import TinyUNet, same_bits, seq2seq_call, tiny_bart, tiny_t5


def _unet_call():
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(2, 3, 32, 32, generator=generator), torch.randn(2, 3, 32, 32, generator=generator)), {}


def _t5():
    return tiny_t5(), (), seq2seq_call()


def _bart():
    return tiny_bart(), (), seq2seq_call()


def _unet():
    return (TinyUNet(), *_unet_call())


MODELS = {"t5": _t5, "bart": _bart, "unet": _unet}


def _step(model, args, kwargs, hold: bool = True):
    """(gradients by parameter name, the larger of the two meters' peaks, loss) of one step, ``.grad`` allocated,
    the output held through the backward where ``hold``."""
    step = train_step(model, args, lambda out: out if isinstance(out, torch.Tensor) else out.loss, seed=3,
                      kwargs=kwargs, hold_output=hold)
    names = [n for n, _ in model.named_parameters()]
    return dict(zip(names, step.grads, strict=True)), max(step.tracker_peak, step.allocator_peak), step.loss


def _chain(model, args, kwargs):
    kwargs = call_kwargs(model, kwargs)
    return build_chain_graph(capture(model, args, kwargs), model)


def test_t5_layers_are_stages_of_their_own_reading_the_encoder_output_and_position_bias():
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    chain = _chain(*_t5())
    names = [info.name for info in chain.infos]
    assert [n for n in names if n != "(top)"] == [f"{stack}.block.{k}" for stack in ("encoder", "decoder") for k in range(3)]
    signature = {info.name: info.signature for info in chain.infos}
    assert signature["encoder.block.1"] == signature["encoder.block.2"] != signature["encoder.block.0"]
    assert signature["decoder.block.1"] == signature["decoder.block.2"] != signature["decoder.block.0"]
    layout = chain.residents
    at = names.index
    # the encoder's position bias (made by its first layer), the encoder output (read by every decoder
    # layer and returned by the model), the decoder's position bias
    assert (at("encoder.block.0"), (at("encoder.block.1"), at("encoder.block.2"))) in zip(layout.producers, layout.readers)
    decoder_layers = tuple(at(f"decoder.block.{k}") for k in range(3))
    encoder_output = layout.readers.index(decoder_layers)
    assert layout.exported == (encoder_output,)


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_two_layer_t5_cuts_between_its_layers(padded):
    """A second layer is the last reader of both the first layer's output and the position bias
    it made: the carry is the value shaped like the activation carried into the first layer,
    the bias a resident. Unpadded batches (eager mode's mask shortcut, whose nodes capture
    inserts) cut the same way."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    kwargs = seq2seq_call()
    if not padded:
        kwargs["attention_mask"] = torch.ones_like(kwargs["attention_mask"])
    chain = _chain(tiny_t5(layers=2, d_model=64), (), kwargs)
    names = [info.name for info in chain.infos if info.name != "(top)"]
    assert names == [f"{stack}.block.{k}" for stack in ("encoder", "decoder") for k in range(2)]


@pytest.mark.slow
def test_menus_of_stages_with_residents_name_ops_the_same_in_every_process():
    """A resident's gradient sum starts with hierremat's own function: its op name is its
    qualified name, not a repr with this process's address (a cached menu would never match)."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, args, kwargs = _t5()
    plan = hr.plan(model, args, kwargs, budget="1GiB")
    ops = {node["op"] for menu in plan.menus.values() for node in menu["graph"]["nodes"]}
    assert "hierremat.blocks.joint.seeded_add" in ops
    assert not any(" at 0x" in op for op in ops)


def test_bart_layers_are_stages_of_their_own_with_the_encoder_output_carried_past_the_decoder_embedding():
    """The decoder's embedding reads nothing of the encoder's last layer: the encoder output is
    carried to it unread, and is the resident every decoder layer reads."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    chain = _chain(*_bart())
    names = [info.name for info in chain.infos]
    layers = [f"model.{stack}.layers.{k}" for stack in ("encoder", "decoder") for k in range(2)]
    assert [n for n in names if n != "(top)"] == layers
    at = names.index
    layout = chain.residents
    encoder_output = layout.producers.index(at("model.encoder.layers.1"))
    assert layout.readers[encoder_output] == (at("model.decoder.layers.0"), at("model.decoder.layers.1"))
    assert layout.exported == (encoder_output,)


def test_unet_levels_are_stages_and_skip_tensors_residents():
    torch.manual_seed(0)
    chain = _chain(*_unet())
    names = [info.name for info in chain.infos]
    assert names[1:-1] == [*(f"down_blocks.{k}" for k in range(3)), "mid.0", "mid.1",
                           *(f"up_blocks.{k}" for k in range(3))]
    layout = chain.residents
    # the skip tensor of down level k is read by up level 2 - k only
    assert layout.producers == (1, 2, 3) and layout.readers == ((8,), (7,), (6,)) and layout.exported == ()


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "t5" else n for n in sorted(MODELS)])
def test_model_with_residents_trains_bitwise_within_budget_at_four_budgets(name):
    if name != "unet":
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, args, kwargs = MODELS[name]()
    reference = copy.deepcopy(model)
    grads_ref, plain_peak, loss_ref = _step(reference, args, kwargs)
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan(model, args, kwargs, budget="1KiB")
    low = err.value.min_budget_bytes
    assert low < plain_peak
    recomputed = False
    for budget in (low, (low + plain_peak) // 2, plain_peak, 2 * plain_peak):
        module = hr.remat(model, args, kwargs, budget=f"{budget}B")
        plan = module.plans[0]
        assert plan.resident_peak_bytes > 0 and "residents" in plan.summary()
        grads, peak, loss = _step(module, args, kwargs, hold=budget != low)
        assert peak <= budget, (name, budget, peak, plan.summary())
        assert same_bits(loss, loss_ref)
        for key, g in grads.items():
            assert same_bits(g, grads_ref[key.removeprefix("model.")]), (name, budget, key)
        recomputed |= any(c > 1 for c in plan.chain.schedule.forward_counts())
    assert recomputed


def test_t5_under_bf16_autocast_trains_bitwise_within_budget():
    """The fresh-context recipe (autocast around the forward only). The decoder's position bias is
    masked as in eager mode (hierremat.blocks.hf.eager_mask_decisions): with a mask materialised over
    the batch, as torch.export's path of Hugging Face's mask code makes it, the bias gradient would be
    summed over the batch after SDPA's bf16 rounding instead of before it."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, args, kwargs = _t5()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)

    def step(m):
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
        torch.manual_seed(3)
        with memory_meter(torch.device("cpu")) as tracker:
            with autocast:
                loss = m(*args, **kwargs).loss
            loss.backward()
        return {n.removeprefix("model."): p.grad.clone() for n, p in m.named_parameters()}, tracker.peak_bytes

    grads_ref, plain_peak = step(copy.deepcopy(model))
    with autocast:
        low = hr.explore(model, args, kwargs).smallest_feasible_bytes
    for budget in (low, plain_peak):
        with autocast:
            module = hr.remat(model, args, kwargs, budget=f"{budget}B")
        grads, peak = step(module)
        assert peak <= budget
        assert [k for k, g in grads.items() if not same_bits(g, grads_ref[k])] == []


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_t5_without_dropout_checkpoints_with_the_kernels_of_its_forward_with_grad(autocast):
    """Without dropout, CPU attention runs its fused kernel unless the mask needs a gradient (T5's
    position bias does), and the two round differently: a checkpointed layer's forward without grad
    must choose as its forward with grad does (hierremat.runtime.tapeless), else the recomputed
    plan's gradients differ from plain autograd's (by 3e-8 in fp32, 2e-3 in bf16)."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tiny_t5(layers=2, d_model=128, dropout=0.0)
    kwargs = seq2seq_call(4, 48, 24)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()

    def grads_of(m):
        for p in m.parameters():
            p.grad = torch.zeros_like(p)  # kept between steps: the 2.5 MiB are the activations'
        with context:
            loss = m(**kwargs).loss
        loss.backward()
        return {n.removeprefix("model."): p.grad for n, p in m.named_parameters()}

    reference = grads_of(copy.deepcopy(model))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with context:
        module = hr.remat(model, (), kwargs, budget="2.5MiB")
    grads = grads_of(module)
    assert any(isinstance(op, (FNone, FCk)) for op in module.plans[0].chain.schedule.ops)
    assert [k for k, g in grads.items() if not same_bits(g, reference[k])] == []


@pytest.mark.parametrize("masks_by", [pytest.param("keyword", marks=pytest.mark.slow), "position"])
def test_t5_batches_without_padding_take_eager_modes_mask_shortcut_bitwise_under_bf16(masks_by):
    """With no padding at all eager mode skips the padding masks, a branch on their values: the
    captured graph takes it too (hierremat.blocks.eager_masks), plans are kept per all-ones state
    (the encoder's mask passed by keyword or by position), and padded and unpadded batches
    alternate, each bitwise equal to plain autocast."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, _, padded = _t5()
    unpadded = {**padded, "attention_mask": torch.ones_like(padded["attention_mask"]),
                "decoder_attention_mask": torch.ones_like(padded["labels"])}
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    reference = copy.deepcopy(model)

    def call(kwargs):
        if masks_by == "keyword":
            return (), kwargs
        # (the decoder's mask left out: the call's structure is then the same padded or not)
        rest = {k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask", "decoder_attention_mask")}
        return (kwargs["input_ids"], kwargs["attention_mask"]), rest

    def grads_of(m, kwargs):
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
        torch.manual_seed(3)
        args, kwargs = call(kwargs)
        with autocast:
            loss = m(*args, **kwargs).loss
        loss.backward()
        return {n.removeprefix("model."): p.grad.clone() for n, p in m.named_parameters()}

    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # kept between steps (grads_of): the 3 MB are the activations'
    with autocast:
        module = hr.remat(model, *call(unpadded), budget="3MB")
        assert has_value_branch(capture(model, (), call_kwargs(model, unpadded)).module)
    for kwargs in (unpadded, padded, unpadded):
        grads, grads_ref = grads_of(module, kwargs), grads_of(reference, kwargs)
        assert [k for k, g in grads.items() if not same_bits(g, grads_ref[k])] == []
    assert len(module.plans) == 2


def test_plan_with_residents_round_trips_and_runs_from_json():
    torch.manual_seed(0)
    model, args, kwargs = _unet()
    plan = hr.plan(model, args, kwargs, budget="4MB")
    again = ModelPlan.from_json(plan.to_json())
    assert again.chain.costs.residents == plan.chain.costs.residents != ()
    older = json.loads(plan.to_json())  # as saved before residents were counted while live
    older["resident_bytes"], older["chain"]["costs"]["residents"] = 1, []
    with pytest.raises(ValueError, match="older hierremat"):
        ModelPlan.from_json(json.dumps(older))
    assert again.budget_bytes == plan.budget_bytes and again.predicted_peak_bytes == plan.predicted_peak_bytes
    module = hr.remat(model, args, kwargs, plan=again)
    grads, peak, _ = _step(module, args, kwargs)
    grads_ref, _, _ = _step(copy.deepcopy(model), args, kwargs)
    assert peak <= plan.budget_bytes
    assert all(same_bits(g, grads_ref[k.removeprefix("model.")]) for k, g in grads.items())


class _SharedContext(nn.Module):
    """A layer that reads the context a first layer made (like a decoder reading an encoder's output)."""

    def __init__(self, width: int, makes_context: bool):
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.context = nn.Linear(width, width) if makes_context else None

    def forward(self, x, context):
        if self.context is not None:
            context = torch.tanh(self.context(x))
        return torch.relu(self.inner(x)) * context + x, context


class _ContextChain(nn.Module):
    """Four layers; the first makes a context every later one reads; the model returns it too."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.layers = nn.ModuleList(_SharedContext(width, k == 0) for k in range(4))

    def forward(self, x, context):
        for layer in self.layers:
            x, context = layer(x, context)
        return x.pow(2).mean(), context


def test_exported_resident_gets_the_callers_gradient_too():
    """The model returns the resident (as T5 returns its encoder's output) and the loss uses it:
    its gradient from the caller is summed with those of the layers that read it."""
    torch.manual_seed(0)
    model = _ContextChain()
    x, context = torch.randn(8, 32, requires_grad=True), torch.zeros(8, 32)

    def step(m):
        for p in m.parameters():
            p.grad = None
        x.grad = None
        loss, made = m(x, context)
        (loss + made.sum()).backward()
        return {n.removeprefix("model."): p.grad for n, p in m.named_parameters()}, x.grad.clone()

    grads_ref, dx_ref = step(copy.deepcopy(model))
    chain = _chain(model, (x, context), {})
    assert [info.name for info in chain.infos][:4] == [f"layers.{k}" for k in range(4)]
    assert chain.residents.readers == ((1, 2, 3),) and chain.residents.exported == (0,)
    smallest = hr.explore(model, (x, context)).smallest_feasible_bytes
    for budget in (smallest, 2**20):
        module = hr.remat(model, (x, context), budget=f"{budget}B")
        grads, dx = step(module)
        assert same_bits(dx, dx_ref)
        assert all(same_bits(g, grads_ref[k]) for k, g in grads.items())


def test_gradients_held_past_a_backward_own_their_storage():
    """cat's backward hands out slices of its incoming gradient. A resident's gradient sum and a
    stage input's gradient outlive the backward that made them, and the models count them at their
    own bytes: held as slices, they kept the whole concatenated gradient alive (a U-Net's skip
    gradient held three times its bytes until its producer's backward, over budget)."""
    from hierremat.blocks.joint import seeded_add
    from hierremat.runtime.grad_taps import tap_input

    whole = torch.randn(2, 6, 4)
    term = whole[:, :2]
    held = seeded_add(None, term)
    assert held.untyped_storage().nbytes() == term.numel() * term.element_size() and torch.equal(held, term)
    owned = torch.randn(2, 2, 4)
    assert seeded_add(None, owned) is owned

    x = torch.randn(2, 2, 4)
    tapped, sink = tap_input(x, torch.empty(0, requires_grad=True))
    torch.cat([tapped, torch.randn(2, 4, 4, requires_grad=True)], dim=1).backward(whole)
    assert sink.grad.untyped_storage().nbytes() == x.untyped_storage().nbytes() and torch.equal(sink.grad, term)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_live_bytes_after_each_forward_are_the_simulators_at_the_smallest_budget(name, monkeypatch):
    """The stage costs count a stage's residents once (in the plan's resident reserve, not also in
    what its tape keeps, nor less than it): after each forward op of the schedule the live-tensor
    tracker holds exactly the simulator's bytes above what was live when the chain started, and no
    op peaks above the simulator's peak for it."""
    if name != "unet":
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, args, kwargs = MODELS[name]()
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan(model, args, kwargs, budget="1KiB")
    module = hr.remat(model, args, kwargs, budget=f"{err.value.min_budget_bytes}B")
    measured = []
    execute = executor._Step._execute

    def observed(step, op, index):
        before = tracker.live_bytes
        tracker.reset_peak()
        execute(step, op, index)
        measured.append((op, before, tracker.peak_bytes, tracker.live_bytes))

    monkeypatch.setattr(executor._Step, "_execute", observed)
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    with memory_meter(torch.device("cpu")) as tracker:
        out = module(*args, **kwargs)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        del out
        loss.backward()
    plan = module.plans[-1].chain
    simulated = [e for e in plan.simulate().timeline if not isinstance(plan.schedule.ops[e.op_index], Loss)]
    assert [op for op, *_ in measured] == [plan.schedule.ops[e.op_index] for e in simulated]
    assert any(isinstance(op, (FCk, FNone)) for op, *_ in measured)
    start = measured[0][1]
    forward = next(k for k, op in enumerate(plan.schedule.ops) if isinstance(op, Loss))
    for (op, _, peak, after), event in zip(measured[:forward], simulated):
        assert after - start <= event.after_bytes, (name, op)
    for (op, _, peak, after), event in zip(measured, simulated):
        assert peak - start <= event.peak_bytes, (name, op)


@pytest.mark.parametrize("kind", ["new", "view of the input", "the activation itself"])
def test_a_residents_storage_is_neither_kept_nor_pinned_by_the_stage_that_makes_it(kind):
    """What a producer's profile keeps and pins leaves out the storages its residents hold (they are the
    plan's resident reserve): a resident made anew, one that is a view of the stage's input (allocated
    before it ran: nothing to take off), or the activation itself (not a pin of x_{i+1})."""
    from hierremat.runtime.profile import _profile_stage

    torch.manual_seed(0)
    layer = nn.Linear(64, 64)

    def call(x):
        h = torch.nn.functional.gelu(layer(x))
        resident = {"new": x * 2, "view of the input": x.view(-1), "the activation itself": h}[kind]
        return h, resident

    x = torch.randn(8, 64)
    option = _profile_stage(1, layer, call, x, True, 1, torch.device("cpu"), None, produced=1, timed=False)[0].options[0]
    assert option.kept_bytes == 8 * 64 * 4  # gelu's saved input, whatever the resident
    assert option.pins_input == (kind != "view of the input") and not option.pins_output  # (a resident's: not a pin)
