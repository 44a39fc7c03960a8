"""The LM head fused with its cross-entropy, as an option of the output stage; ``outputs=``.

- The fused op (hierremat.ops.linear_cross_entropy) equals ``linear`` then
  ``cross_entropy`` to fp32 rounding (rtol 1e-5: only the summation order of the weight
  gradient over row chunks and of the mean differs), for every reduction, with and
  without bias, ignored rows and several chunks; with bf16 hidden states upcast to fp32
  as Hugging Face upcasts logits, to bf16 rounding; and it passes torch.library's opcheck.
- The rewrite applies where nothing else reads the logits, and nowhere else.
- A model that returns only its loss, and a Hugging Face model with ``outputs="loss"``,
  get the fused head as the output stage's option 1: their smallest feasible budget
  drops, and at it they train with plain autograd's gradients (tied and untied heads,
  HF's ``num_items_in_batch``) within the budget. Without ``outputs=``, a model's outputs
  are exactly its own.
"""

from __future__ import annotations

import copy

import pytest
import torch

import hierremat as hr
from hierremat.blocks.capture import capture
from hierremat.blocks.segment import build_chain_graph
from hierremat.planning.output_stage import FUSED_HEAD, fused_head_stage
from hierremat.device import LiveTensorTracker
from hierremat.ops import linear_cross_entropy as lce

from models import LossOnly, tiny_gpt2, tiny_llama

pytest.importorskip("transformers")

RTOL, ATOL = 1e-4, 1e-5  # fp32 rounding of sums over row chunks (the weight gradient, the mean)


def _reference(h, weight, bias, target, reduction):
    logits = torch.nn.functional.linear(h, weight, bias).float()
    return torch.nn.functional.cross_entropy(logits, target, reduction=["none", "mean", "sum"][reduction])


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_op_equals_linear_then_cross_entropy(reduction, with_bias, monkeypatch):
    monkeypatch.setattr(lce, "TILE_BYTES", 4 * 65 * 1008)  # tiles of 65 rows and 1008 columns: partial ones
    monkeypatch.setattr(lce, "MIN_TILE_COLUMNS", 1008)      # at both ends, four column tiles a row's log-sum-exp
    assert lce.tile_shape(300, 4096) == (65, 1008)
    torch.manual_seed(reduction)
    h = torch.randn(300, 48, requires_grad=True)
    weight = (0.2 * torch.randn(4096, 48)).requires_grad_()
    bias = torch.randn(4096, requires_grad=True) if with_bias else None
    target = torch.randint(0, 4096, (300,))
    target[::7] = -100
    inputs = [t for t in (h, weight, bias) if t is not None]
    loss = lce.linear_cross_entropy(h, weight, bias, target, reduction)
    ref = _reference(h, weight, bias, target, reduction)
    torch.testing.assert_close(loss, ref, rtol=RTOL, atol=ATOL)
    g = torch.randn(loss.shape)
    for a, b in zip(torch.autograd.grad(loss, inputs, g), torch.autograd.grad(ref, inputs, g)):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_tiles_cover_the_logits_within_their_bytes():
    """Every (rows, vocabulary) is covered by tiles of at most TILE_BYTES of fp32 logits, at least
    MIN_TILE_COLUMNS wide where the vocabulary is, each block of rows reading the weight once per pass."""
    for rows in (1, 7, 300, 1024, 8192, 100_000):
        for vocabulary in (1, 500, 1024, 4096, 50257, 256_000):
            tile_rows, columns = lce.tile_shape(rows, vocabulary)
            assert 1 <= tile_rows <= rows and 1 <= columns <= vocabulary
            assert columns >= min(vocabulary, lce.MIN_TILE_COLUMNS)
            assert 4 * tile_rows * columns <= max(lce.TILE_BYTES, 4 * columns)  # one row of a wide tile at least
            seen = torch.zeros(min(rows, 64), min(vocabulary, 64), dtype=torch.int)
            for block, cols in lce._tiles(rows, vocabulary):
                seen[block, cols] += 1
            assert bool((seen == 1).all())


def test_fused_op_log_sum_exp_over_tiles_with_infinite_and_large_logits(monkeypatch):
    """The running maximum across column tiles: a first tile of only -inf logits (a masked part of the
    vocabulary) before finite ones; logits far beyond exp's range either way (every row's far below 0, or
    hundreds above it): loss and gradients those of linear then cross_entropy."""
    monkeypatch.setattr(lce, "TILE_BYTES", 4 * 16 * 256)
    monkeypatch.setattr(lce, "MIN_TILE_COLUMNS", 256)
    torch.manual_seed(5)
    target = torch.randint(256, 1024, (48,))
    for scale, offset in ((30.0, 0.0), (0.1, -1000.0)):
        h = (scale * torch.randn(48, 16)).requires_grad_()
        weight = (2 * torch.randn(1024, 16)).requires_grad_()
        bias = torch.full((1024,), offset)
        bias[:256] = float("-inf")  # the first column tile of every row
        bias[600:700] -= 1e4
        inputs = (h, weight)
        loss = lce.linear_cross_entropy(h, weight, bias, target)
        ref = _reference(h, weight, bias, target, 1)
        assert torch.isfinite(loss)
        torch.testing.assert_close(loss, ref, rtol=RTOL, atol=ATOL)
        for a, b in zip(torch.autograd.grad(loss, inputs), torch.autograd.grad(ref, inputs)):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)  # (a log-sum-exp of ~300 rounds at ~2e-5)


def test_fused_op_with_bf16_hidden_states_upcasts_like_the_model():
    torch.manual_seed(0)
    h = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    weight = (0.2 * torch.randn(500, 32)).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, 500, (64,))
    loss = lce.linear_cross_entropy(h, weight, None, target)
    ref = _reference(h, weight, None, target, 1)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)  # the same bf16 logits, upcast
    for a, b in zip(torch.autograd.grad(loss, (h, weight)), torch.autograd.grad(ref, (h, weight))):
        assert a.dtype == b.dtype == torch.bfloat16
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-4)  # bf16 rounding of the gradients


@pytest.mark.parametrize("grad_state", ["zeros", "values", "none"])
def test_fused_op_adds_an_fp32_weights_gradient_into_grad(grad_state, monkeypatch):
    """With ``.grad`` allocated, the weight's gradient goes into it chunk by chunk: no
    ``[vocabulary, width]`` tensor in the backward; without, it becomes ``.grad`` as before."""
    monkeypatch.setattr(lce, "TILE_BYTES", 4 * 16 * 1024)  # tiles of 16 rows and 1024 columns
    torch.manual_seed(0)
    h = torch.randn(256, 32, requires_grad=True)
    target = torch.randint(0, 4096, (256,))
    grads, peaks = [], []
    for fused in (False, True):
        weight = torch.nn.Parameter(0.2 * torch.randn(4096, 32, generator=torch.Generator().manual_seed(1)))
        if grad_state != "none":
            weight.grad = torch.zeros_like(weight) if grad_state == "zeros" else torch.randn_like(weight)
        start = None if weight.grad is None else weight.grad.clone()
        loss = lce.linear_cross_entropy(h, weight, None, target) if fused else _reference(h, weight, None, target, 1)
        with LiveTensorTracker() as tracker:
            loss.backward()
        grads.append(weight.grad if start is None else weight.grad - start)
        peaks.append(tracker.peak_bytes)
    torch.testing.assert_close(grads[1], grads[0], rtol=RTOL, atol=ATOL)
    table = 4096 * 32 * 4
    if grad_state == "none":
        assert peaks[1] >= table  # the gradient itself becomes .grad
    else:
        assert peaks[1] < table / 2 < peaks[0], peaks


@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_fused_op_with_the_triton_row_kernels_equals_linear_then_cross_entropy(reduction, interpreted_triton_kernels, monkeypatch):
    """The chunks' row passes as the Triton kernels CUDA runs (here by Triton's interpreter on
    CPU tensors): the same loss and gradients to fp32 rounding, ignored rows and an
    ignore_index that is a valid column included; bf16 hidden states get bf16 gradients."""
    monkeypatch.setattr(lce, "_row_kernels", lambda h: interpreted_triton_kernels)
    monkeypatch.setattr(lce, "CHUNK_BYTES", 1100 * 4 * 8)  # chunks of 8 whole rows: 8, 8 and 4, of two vocabulary blocks
    monkeypatch.setattr(lce, "MIN_CHUNK_ROWS", 1)
    torch.manual_seed(reduction)
    for dtype, ignore_index, with_bias in ((torch.float32, -100, True), (torch.float32, 0, False), (torch.bfloat16, -100, False)):
        h = torch.randn(20, 24, dtype=dtype, requires_grad=True)
        weight = (0.3 * torch.randn(1100, 24)).to(dtype).requires_grad_()
        bias = torch.randn(1100, dtype=dtype, requires_grad=True) if with_bias else None
        target = torch.randint(1, 1100, (20,))
        target[::5] = ignore_index
        inputs = [t for t in (h, weight, bias) if t is not None]
        loss = lce.linear_cross_entropy(h, weight, bias, target, reduction, ignore_index)
        ref = torch.nn.functional.cross_entropy(
            torch.nn.functional.linear(h, weight, bias).float(), target,
            reduction=["none", "mean", "sum"][reduction], ignore_index=ignore_index,
        )
        torch.testing.assert_close(loss, ref, rtol=RTOL, atol=ATOL)
        g = torch.rand(loss.shape)
        # bf16: the interpreter rounds fp32 to bf16 by truncation, up to one bf16 step off
        rtol, atol = (RTOL, ATOL) if dtype == torch.float32 else (2e-2, 2e-3)
        for a, b in zip(torch.autograd.grad(loss, inputs, g), torch.autograd.grad(ref, inputs, g)):
            assert a.dtype == b.dtype == dtype
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.mark.cuda
def test_fused_op_on_cuda_runs_the_triton_row_kernels_and_equals_linear_then_cross_entropy():
    h = torch.randn(300, 64, device="cuda")
    assert lce._row_kernels(h) is not None, "Triton is not importable on this CUDA machine"
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        h = torch.randn(300, 64, device="cuda", dtype=dtype, requires_grad=True)
        weight = (0.2 * torch.randn(5000, 64, device="cuda")).to(dtype).requires_grad_()
        target = torch.randint(0, 5000, (300,), device="cuda")
        target[::7] = -100
        loss = lce.linear_cross_entropy(h, weight, None, target)
        ref = _reference(h, weight, None, target, 1)
        torch.testing.assert_close(loss, ref, rtol=RTOL, atol=ATOL)
        rtol, atol = (RTOL, ATOL) if dtype == torch.float32 else (2e-2, 1e-4)
        for a, b in zip(torch.autograd.grad(loss, (h, weight)), torch.autograd.grad(ref, (h, weight))):
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def test_fused_op_forward_chunk_is_counted_by_the_tracker_as_the_allocator_counts_it(monkeypatch):
    """The chunk's logits live inside the op's forward, where the tracker's dispatch mode is
    off: the op hands them to it (track_hidden), so the tracker's peak is the allocator's
    (before: the outputs' bytes only; the logsumexp's temporary, a second chunk, is gone)."""
    from hierremat.device.memory import CpuAllocatorMeter

    monkeypatch.setattr(lce, "TILE_BYTES", 4 * 64 * 1024)  # tiles of 64 rows and 1024 columns: 256 KiB
    assert lce.tile_shape(256, 4096) == (64, 1024)
    torch.manual_seed(0)
    h, weight = torch.randn(256, 32), torch.randn(4096, 32)
    target = torch.randint(0, 4096, (256,))
    peaks = []
    for meter in (LiveTensorTracker(), CpuAllocatorMeter()):
        with meter:
            loss = lce.linear_cross_entropy(h, weight, None, target)
        peaks.append(meter.peak_bytes)
        del loss
    chunk = 64 * 1024 * 4
    assert chunk <= peaks[0] <= chunk + 16 * 1024, peaks
    assert abs(peaks[0] - peaks[1]) <= 16 * 1024, peaks


def test_fused_op_passes_opcheck():
    torch.manual_seed(0)
    h = torch.randn(40, 16, requires_grad=True)
    weight = torch.randn(100, 16, requires_grad=True)
    bias = torch.randn(100, requires_grad=True)
    target = torch.randint(0, 100, (40,))
    for args in ((h, weight, bias, target, 1, -100), (h, weight, None, target, 0, -100)):
        torch.library.opcheck(torch.ops.hierremat.linear_cross_entropy.default, args)


def _last_stage(model, args, kwargs, **capture_kwargs):
    return build_chain_graph(capture(model, args, kwargs, **capture_kwargs), model).stages[-1]


def test_the_rewrite_applies_only_where_nothing_else_reads_the_logits():
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2)
    ids = torch.randint(0, 256, (2, 32))
    kwargs = {"labels": ids, "use_cache": False}
    assert fused_head_stage(_last_stage(model, (ids,), kwargs)) is None  # the logits are returned
    assert fused_head_stage(_last_stage(model, (ids,), kwargs, outputs=("loss",))) is not None
    assert fused_head_stage(_last_stage(LossOnly(model), (ids, ids), {})) is not None

    class Smoothed(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids):
            logits = self.model(ids, use_cache=False).logits
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten(), label_smoothing=0.1)

    assert fused_head_stage(_last_stage(Smoothed(model), (ids,), {})) is None


def _zero_grads(model):
    for p in model.parameters():
        p.grad = torch.zeros_like(p)


def _train_at_minimum(model, args, kwargs, call, **settings):
    """The minimum from InfeasibleBudgetError, a module planned at it, and two steps of it against
    plain autograd: the fused head is used, gradients agree, the peak is within the budget."""
    reference = copy.deepcopy(model)
    _zero_grads(model)  # .grad kept between steps: where the head and the embedding add into it
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan(model, args, kwargs, budget="1KiB", **settings)
    budget = err.value.min_budget_bytes
    module = hr.remat(model, args, kwargs, budget=f"{budget}B", **settings)
    for step in range(2):
        _zero_grads(model)
        _zero_grads(reference)
        torch.manual_seed(step)
        with LiveTensorTracker() as tracker:
            call(module).backward()
        torch.manual_seed(step)
        call(reference).backward()
        assert tracker.peak_bytes <= budget, module.plans[-1].summary()
        for (name, a), b in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=RTOL, atol=ATOL, msg=name)
    (plan,) = module.plans
    assert plan.chain.stage_actions()[-1] == f"all[{FUSED_HEAD}]", plan.summary()
    return budget, plan


def test_a_model_returning_its_loss_trains_with_the_fused_head_at_its_minimum():
    torch.manual_seed(1)
    model = LossOnly(tiny_gpt2(n_layer=2, vocab_size=4096))  # tied embeddings
    ids = torch.randint(0, 4096, (2, 96))
    budget, _ = _train_at_minimum(model, (ids, ids), {}, lambda m: m(ids, ids))
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan(model, (ids, ids), {}, budget="1KiB", settings=hr.Settings(variants=False))
    assert budget < 0.5 * err.value.min_budget_bytes  # the logits and their gradient were the floor


def test_a_large_vocabularys_gradient_never_exists_whole(monkeypatch):
    """A vocabulary much larger than the rest of the model: the head adds its weight gradient
    into ``.grad`` chunk by chunk and the embedding adds the rows it read, so the smallest
    budget is below the bytes of the (tied) table itself."""
    monkeypatch.setattr(lce, "TILE_BYTES", 4 * 32 * 1024)  # tiles of 32 rows and 1024 columns of logits
    torch.manual_seed(3)
    model = LossOnly(tiny_gpt2(n_layer=1, n_embd=32, vocab_size=32768))
    ids = torch.randint(0, 32768, (2, 64))
    budget, _ = _train_at_minimum(model, (ids, ids), {}, lambda m: m(ids, ids))
    table = model.model.transformer.wte.weight
    assert budget < table.numel() * table.element_size() / 2, budget


@pytest.mark.parametrize("which", ["gpt2", "llama-untied", "num_items_in_batch"])
def test_outputs_loss_lets_a_hugging_face_model_use_the_fused_head(which):
    torch.manual_seed(2)
    if which == "llama-untied":
        model = tiny_llama()
        model.config.tie_word_embeddings = False
        assert model.lm_head.weight is not model.model.embed_tokens.weight
        vocab = model.config.vocab_size
    else:
        model = tiny_gpt2(n_layer=2, vocab_size=2048)
        vocab = 2048
    ids = torch.randint(0, vocab, (2, 64))
    kwargs = {"labels": ids, "use_cache": False}
    if which == "num_items_in_batch":  # the loss summed, then divided by the tokens of the whole batch
        kwargs["num_items_in_batch"] = torch.tensor(3 * 63)

    original = copy.deepcopy(model)
    budget, plan = _train_at_minimum(model, (ids,), kwargs, lambda m: _loss(m, ids, kwargs), outputs="loss")
    assert plan.outputs == ("loss",) and "returns loss only" in plan.summary()
    _zero_grads(original)
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan(original, (ids,), kwargs, budget="1KiB")
    assert budget < err.value.min_budget_bytes


def _loss(module, ids, kwargs):
    out = module(ids, **kwargs)
    if isinstance(module, hr.RematModule):
        assert out.logits is None  # asked for with outputs="loss"
    return out.loss


def test_without_outputs_the_model_returns_its_own_logits():
    torch.manual_seed(3)
    model = tiny_gpt2(n_layer=2)
    ids = torch.randint(0, 256, (2, 32))
    kwargs = {"labels": ids, "use_cache": False}
    module = hr.remat(model, (ids,), kwargs, budget="64MiB")
    with torch.no_grad():
        torch.manual_seed(0)
        mine = module(ids, **kwargs)
        torch.manual_seed(0)
        theirs = model(ids, **kwargs)
    assert torch.equal(mine.logits, theirs.logits) and torch.equal(mine.loss, theirs.loss)


def test_outputs_argument_is_checked():
    model = tiny_gpt2(n_layer=1)
    ids = torch.randint(0, 256, (1, 8))
    with pytest.raises(ValueError, match="outputs must be None"):
        hr.plan(model, (ids,), {"labels": ids}, budget="1GiB", outputs=3)
    with pytest.raises(ValueError, match=r"returns no \['los'\]"):
        hr.plan(model, (ids,), {"labels": ids, "use_cache": False}, budget="1GiB", outputs="los")
    with pytest.raises(ValueError, match="not named outputs"):
        hr.plan(LossOnly(model), (ids, ids), {}, budget="1GiB", outputs="loss")


@pytest.mark.cuda
def test_outputs_loss_fused_head_cuda():
    torch.manual_seed(4)
    model = tiny_gpt2(n_layer=2, vocab_size=2048).cuda()
    ids = torch.randint(0, 2048, (2, 64), device="cuda")
    kwargs = {"labels": ids, "use_cache": False}
    reference = copy.deepcopy(model)
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan(model, (ids,), kwargs, budget="1KiB", outputs="loss")
    budget = err.value.min_budget_bytes
    module = hr.remat(model, (ids,), kwargs, budget=f"{budget}B", outputs="loss")
    for step in range(2):
        _zero_grads(model)
        _zero_grads(reference)
        torch.manual_seed(step)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        module(ids, **kwargs).loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        torch.manual_seed(step)
        reference(ids, **kwargs).loss.backward()
        assert peak <= budget
        for a, b in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)
    assert module.plans[0].chain.stage_actions()[-1] == f"all[{FUSED_HEAD}]"


def test_a_plan_from_explore_whose_only_option_is_the_fused_head_runs(monkeypatch):
    """Where no stage has a block menu (on CUDA under bf16 autocast every block's joint graph can fail its
    exactness check), the plan's only option is the fused head, and it has no menu to store: the plan still
    runs with ``remat(..., plan=)`` (it raised "stage 3 has no executor for option 1" before), exact and within
    its budget."""
    import hierremat.planning.menus as menus

    def no_joint_graph(*args, **kwargs):
        raise RuntimeError("no joint graph here")

    monkeypatch.setattr(menus, "trace_joint", no_joint_graph)
    torch.manual_seed(4)
    model = tiny_gpt2(n_layer=2, vocab_size=4096)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 4096, (2, 96))
    kwargs = {"labels": ids, "use_cache": False}
    explorer = hr.explore(model, (ids,), kwargs, outputs="loss", settings=hr.Settings(cache=False))
    budget = explorer.smallest_feasible_bytes
    plan = explorer.plan(budget)
    assert not plan.menus and plan.chain.stage_actions()[-1] == f"all[{FUSED_HEAD}]", plan.summary()
    module = hr.remat(model, (ids,), kwargs, plan=plan)
    for step in range(2):
        _zero_grads(model)
        _zero_grads(reference)
        torch.manual_seed(step)
        with LiveTensorTracker() as tracker:
            _loss(module, ids, kwargs).backward()
        torch.manual_seed(step)
        reference(ids, **kwargs).loss.backward()
        assert tracker.peak_bytes <= budget, plan.summary()
        for (name, a), b in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=RTOL, atol=ATOL, msg=name)
