"""Operator variants (hierremat.blocks.variants): bitwise equal to the operators they replace, and leaner."""

import copy

import pytest
import torch
import torch.nn.functional as F

import hierremat as hr
from hierremat.blocks.capture import capture
from hierremat.device import LiveTensorTracker
from hierremat.ops import cross_entropy
from hierremat.ops.cross_entropy import row_blocked_cross_entropy

from harness import CALLERS_LOSS_BYTES, assert_same_bits, train_step, with_grads
from models import tiny_gpt2

REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_row_blocked_cross_entropy_is_bitwise_autograds(monkeypatch, reduction, dtype):
    monkeypatch.setattr(cross_entropy, "_BLOCKS", 12)  # blocks of 4 rows: many, and a ragged last one
    torch.manual_seed(0)
    logits = torch.randn(50, 300, dtype=dtype, requires_grad=True)
    target = torch.randint(0, 300, (50,))
    target[::7] = -100  # ignored rows
    reference = F.cross_entropy(logits, target, reduction=REDUCTIONS[reduction])
    grad_loss = torch.randn_like(reference)
    (expected,) = torch.autograd.grad(reference, logits, grad_loss)
    loss = row_blocked_cross_entropy(logits, target, reduction, -100)
    (grad,) = torch.autograd.grad(loss, logits, grad_loss)
    assert torch.equal(loss, reference)
    assert torch.equal(grad, expected)


def test_row_blocks_share_a_buffer_whose_bytes_are_a_polynomial_in_the_rows():
    """The one buffer of the row-blocked backward: the rows times a sixteenth of the vocabulary rounded up (linear
    in the rows for every vocabulary, odd ones included, and at any size: no cap to cross), at least one row; so
    a new length's memory is fitted exactly."""
    for classes in (8192, 32000, 1024, 50257, 1000):
        sizes = [cross_entropy.block_elements(rows, classes) for rows in (100, 200, 300, 4096, 8192)]
        assert sizes[2] - sizes[1] == sizes[1] - sizes[0] == 100 * -(-classes // 16)
        assert sizes[4] - sizes[3] == 4096 * -(-classes // 16)
    assert cross_entropy.block_elements(3, 50257) == 50257


class LanguageModelHead(torch.nn.Module):
    def __init__(self, width: int = 32, vocabulary: int = 1000):
        super().__init__()
        self.linear = torch.nn.Linear(width, vocabulary)

    def forward(self, x, labels):
        return F.cross_entropy(self.linear(x), labels)


def test_captured_cross_entropy_runs_as_the_variant_with_the_same_gradients_in_less_memory():
    torch.manual_seed(0)
    model = LanguageModelHead()
    labels = torch.randint(0, 1000, (256,))
    labels[::5] = -100
    args = (torch.randn(256, 32, requires_grad=True), labels)
    plain = capture(model, args, variants=False).module
    lean = capture(model, args).module
    targets = lambda gm: {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.cross_entropy_loss.default in targets(plain)
    assert row_blocked_cross_entropy in targets(lean) and torch.ops.aten.cross_entropy_loss.default not in targets(lean)
    steps = [train_step(m, args, lambda loss: loss, grads_allocated=False) for m in (plain, lean)]
    assert_same_bits(steps[1], steps[0])
    dense = 256 * 1000 * 4  # one [N, C] fp32 tensor: the gradient of the log-probabilities, no longer whole
    assert steps[1].tracker_peak <= steps[0].tracker_peak - dense * 0.9, steps


def test_cross_entropy_with_class_weights_or_smoothing_is_left_alone():
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 5)

        def forward(self, x, y):
            logits = self.linear(x)
            return F.cross_entropy(logits, y, label_smoothing=0.1) + F.cross_entropy(logits, y, weight=torch.ones(5))

    gm = capture(Head(), (torch.randn(6, 8), torch.randint(0, 5, (6,)))).module
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.aten.cross_entropy_loss.default]
    assert len(calls) == 2


def test_variants_lower_gpt2s_smallest_budget_and_the_plan_records_them():
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2, n_embd=32, vocab_size=4096)  # the head's [N, C] tensors set the smallest budget
    ids = torch.randint(0, 4096, (4, 128))
    kwargs = {"labels": ids, "use_cache": False}
    smallest = {}
    for variants in (False, True):
        with pytest.raises(hr.InfeasibleBudgetError) as err:
            hr.plan(model, (ids,), kwargs, budget="1KiB", settings=hr.Settings(variants=variants, output_held=False))
        smallest[variants] = err.value.min_budget_bytes
    assert smallest[True] <= smallest[False] - ids.numel() * 4096 * 4 * 0.9, smallest
    plan = hr.plan(model, (ids,), kwargs, budget=smallest[False],
                   settings=hr.Settings(variants=False, output_held=False))
    again = hr.ModelPlan.from_json(plan.to_json())
    assert again.variants is False and "operator variants off" in again.summary()
    module = hr.remat(model, (ids,), kwargs, plan=again)  # runs the plan's own (variant-free) graph
    module(ids, **kwargs).loss.backward()


# ---------------------------------------------------------------- embeddings adding into .grad

from hierremat.ops.embedding import embedding  # noqa: E402
from hierremat.blocks.variants.embedding import use_grad_in_place_embeddings  # noqa: E402


def _embedding_grads(table, ids, grad_out, run, padding_idx, scale, grad_state, hook=None):
    """``table``'s .grad after ``run``'s backward, and the live-tensor peak of that backward."""
    weight = torch.nn.Parameter(table.clone())
    if grad_state == "zeros":
        weight.grad = torch.zeros_like(weight)
    elif grad_state == "values":  # as under gradient accumulation
        weight.grad = torch.linspace(-1, 1, weight.numel()).view_as(weight)
    if hook is not None:
        weight.register_hook(hook)
    out = run(weight, ids, padding_idx, scale)
    with LiveTensorTracker() as tracker:
        out.backward(grad_out)
    return weight.grad, tracker.peak_bytes


@pytest.mark.parametrize("padding_idx, scale", [(-1, False), (3, False), (-1, True), (5, True)])
@pytest.mark.parametrize("grad_state", ["zeros", "values", "none"])
def test_embedding_variant_adds_the_rows_it_read_into_grad_bitwise(padding_idx, scale, grad_state):
    torch.manual_seed(0)
    table = torch.randn(5000, 48)
    ids = torch.randint(0, 40, (4, 300))  # many repeated rows (each summed in a fixed order), padding among them
    grad_out = torch.randn(4, 300, 48)
    plain = lambda w, i, p, s: F.embedding(i, w, padding_idx=None if p < 0 else p, scale_grad_by_freq=s)
    expected, plain_peak = _embedding_grads(table, ids, grad_out, plain, padding_idx, scale, grad_state)
    grad, peak = _embedding_grads(table, ids, grad_out, embedding, padding_idx, scale, grad_state)
    assert _same_bits(grad, expected)
    dense = table.numel() * 4
    if grad_state == "none":  # the gradient becomes .grad: nothing to save
        assert peak == plain_peak
    else:  # no [num_embeddings, dim] tensor: the batch's rows only
        assert plain_peak >= dense and peak < dense / 10, (plain_peak, peak)


def test_embedding_variant_gives_tensor_hooks_the_whole_gradient():
    torch.manual_seed(0)
    table, ids, grad_out = torch.randn(300, 8), torch.randint(0, 300, (64,)), torch.randn(64, 8)
    seen = []
    hook = lambda g: seen.append(g.clone()) or 2 * g
    plain = lambda w, i, p, s: F.embedding(i, w)
    expected, _ = _embedding_grads(table, ids, grad_out, plain, -1, False, "zeros", hook)
    grad, _ = _embedding_grads(table, ids, grad_out, embedding, -1, False, "zeros", hook)
    assert _same_bits(grad, expected) and _same_bits(seen[0], seen[1])


def test_post_accumulate_hooks_see_the_complete_grad_of_a_tied_embedding():
    """GPT-2's table is read by the embedding and the head: AccumulateGrad still runs (and its
    hooks with it) after the embedding added its rows."""
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=1, n_embd=32, vocab_size=512)
    ids = torch.randint(0, 512, (2, 32))
    gm = capture(model, (ids,), {"labels": ids, "use_cache": False}).module
    assert sum(n.target is embedding for n in gm.graph.nodes) == 2  # tokens and positions
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m.zero_grad(set_to_none=False)
    seen = []
    model.transformer.wte.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    torch.manual_seed(1)
    gm(ids, labels=ids, use_cache=False)[0].backward()
    torch.manual_seed(1)
    reference(ids, labels=ids, use_cache=False).loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert _same_bits(p.grad, q.grad), name
    assert seen and _same_bits(seen[-1], reference.transformer.wte.weight.grad)


def test_a_table_read_three_times_keeps_autograds_sum_in_one_backward_call():
    """A table read by two embeddings and a head (BART's tying): rows added into .grad first would
    sum (dec + enc) + head where autograd sums (head + dec) + enc, so the table keeps aten's
    embedding; run as one graph the gradients are bitwise plain autograd's."""

    class ThreeReaders(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(64, 16)

        def forward(self, enc_ids, dec_ids):
            memory = self.table(enc_ids).mean(1, keepdim=True)
            hidden = torch.tanh(self.table(dec_ids) + memory)
            return (hidden @ self.table.weight.t()).logsumexp(-1).sum()

    torch.manual_seed(0)
    model, ids = ThreeReaders(), (torch.randint(0, 64, (4, 40)), torch.randint(0, 64, (4, 30)))
    gm = capture(model, ids).module
    assert use_grad_in_place_embeddings(gm) == 0
    assert not any(n.target is embedding for n in gm.graph.nodes)
    reference = copy.deepcopy(model)
    for m in (gm, reference):
        m.table.weight.grad = torch.zeros_like(m.table.weight)
        m(*ids).backward()
    assert _same_bits(gm.table.weight.grad, reference.table.weight.grad)


def test_embedding_variant_passes_opcheck():
    table = torch.randn(50, 8, requires_grad=True)
    for args in ((table, torch.randint(0, 50, (3, 7)), -1, False), (table, torch.randint(0, 50, (9,)), 2, True)):
        torch.library.opcheck(torch.ops.hierremat.embedding.default, args)


def test_sparse_embeddings_are_left_alone():
    class Sparse(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(100, 8, sparse=True)

        def forward(self, ids):
            return self.table(ids).sum()

    gm = capture(Sparse(), (torch.randint(0, 100, (10,)),)).module
    assert use_grad_in_place_embeddings(gm) == 0
    assert any(n.target is torch.ops.aten.embedding.default for n in gm.graph.nodes)


# ---------------------------------------------------------------- packed dropout masks

from hierremat.blocks.joint import run_joint, saved_for_backward, trace_joint  # noqa: E402
from hierremat.ops import packed_bits  # noqa: E402
from hierremat.blocks.variants.dropout import pack_dropout_masks  # noqa: E402


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (signed zeros and NaN payloads included)."""
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(as_int), b.view(as_int))


def _dropout_cases(device):
    torch.manual_seed(0)
    wide = torch.randn(37, 129, device=device) * 10
    wide[0, :4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])
    yield wide, 0.1
    yield torch.randn(5, device=device), 0.5  # fewer elements than one byte of mask
    yield torch.randn(3, 40001, device=device), 0.4  # several parallel tasks and a partial byte
    yield torch.randn(16, 33, device=device).t(), 0.3  # not contiguous
    yield torch.randn(8, 64, device=device, dtype=torch.float64), 0.2
    yield torch.randn(8, 64, device=device, dtype=torch.bfloat16), 0.2


def _check_out_form(out_form, expected, x, *args):
    """``out_form(x, *args, out=...)`` writes ``expected`` into a fresh tensor and over ``x`` itself."""
    fresh = torch.empty_like(x)
    assert out_form(x, *args, out=fresh) is fresh and _same_bits(fresh, expected)
    written = x.clone()
    assert out_form(written, *args, out=written) is written and _same_bits(written, expected)


def _check_dropout_ops(device, masked_scale, masked_scale_out, dtypes=None):
    for x, p in _dropout_cases(device):
        if dtypes is not None and x.dtype not in dtypes:
            continue
        torch.manual_seed(7)
        out, mask = torch.ops.aten.native_dropout(x, p, True)
        after = torch.rand(3, device=device)
        torch.manual_seed(7)
        bits = torch.ops.hierremat.dropout_bits(x, p)
        assert torch.equal(torch.rand(3, device=device), after)  # the same random numbers drawn
        assert torch.equal(bits, packed_bits.pack_mask_reference(mask))
        assert torch.equal(packed_bits.unpack_mask(bits, x.shape), mask)
        scale = 1.0 / (1.0 - p)
        assert _same_bits(masked_scale(x, bits, scale), out)
        grad = torch.randn_like(x)
        expected = torch.ops.aten.native_dropout_backward(grad, mask, scale)
        assert _same_bits(masked_scale(grad, bits, scale), expected)
        _check_out_form(masked_scale_out, expected, grad, bits, scale)


def test_packed_dropout_ops_are_bitwise_native_dropout_cpp_kernels():
    assert packed_bits.load_cpu_kernels(), "the C++ kernels (csrc/packed_bits.cpp) did not build; see the log"
    _check_dropout_ops("cpu", torch.ops.hierremat.masked_scale, torch.ops.hierremat.masked_scale.out)
    mask = torch.rand(1001) < 0.5
    assert torch.equal(torch.ops.hierremat.pack_mask(mask), packed_bits.pack_mask_reference(mask))


def test_packed_dropout_ops_are_bitwise_native_dropout_reference_kernels():
    _check_dropout_ops("cpu", packed_bits.masked_scale_reference, packed_bits.masked_scale_out_reference)


@pytest.mark.cuda
def test_packed_dropout_ops_are_bitwise_native_dropout_on_cuda():
    _check_dropout_ops("cuda", torch.ops.hierremat.masked_scale, torch.ops.hierremat.masked_scale.out)


class DropoutBlock(torch.nn.Module):
    def __init__(self, width: int = 64):
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, width), torch.nn.Linear(width, width)
        self.drop = torch.nn.Dropout(0.25)

    def forward(self, x):
        return x + self.b(self.drop(torch.tanh(self.a(x))))


def test_packed_dropout_joint_graph_gives_the_same_results_and_saves_bits():
    torch.manual_seed(0)
    block, x = DropoutBlock(), torch.randn(32, 64)
    plain = trace_joint(block, x)
    packed = pack_dropout_masks(trace_joint(block, x))
    targets = {n.target for n in packed.module.graph.nodes}
    assert torch.ops.aten.native_dropout.default not in targets
    assert torch.ops.hierremat.dropout_bits.default in targets
    tangent = (torch.randn(32, 64),)
    results = []
    for joint in (plain, packed):
        torch.manual_seed(5)
        results.append(run_joint(joint, x, (), tangent))
    a, b = results
    assert _same_bits(a.outputs[0], b.outputs[0]) and _same_bits(a.input_grad, b.input_grad)
    for name, grad in a.param_grads.items():
        assert _same_bits(grad, b.param_grads[name]), name
    # the backward keeps 1 bit per element of the mask instead of a bool byte
    (bits,) = packed.module.graph.find_nodes(op="call_function", target=torch.ops.hierremat.dropout_bits.default)
    bits_name = bits.name
    assert saved_for_backward(packed)[bits_name] == 32 * 64 // 8
    assert not any(n.target is torch.ops.aten.native_dropout_backward.default for n in packed.module.graph.nodes)


# ---------------------------------------------------------------- ReLU backward from packed masks

from hierremat.blocks.variants.relu_masks import pack_relu_masks  # noqa: E402


def _relu_cases(device):
    torch.manual_seed(0)
    wide = torch.randn(37, 129, device=device)
    wide[0, :6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 0.5])
    yield wide, 0.0
    yield wide, 0.5  # nn.Threshold's threshold_backward
    yield torch.randn(5, device=device), 0.0  # fewer elements than one byte of mask
    yield torch.randn(3, 40001, device=device), 0.0  # several parallel tasks and a partial byte
    yield torch.randn(16, 33, device=device).t(), 0.0  # not contiguous
    yield torch.randn(2, 3, 4, 5, device=device).to(memory_format=torch.channels_last), 0.0
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        yield torch.randn(8, 67, device=device, dtype=dtype), 0.0


def _check_relu_ops(device, above_bits, where_bits, where_bits_out):
    for self_, threshold in _relu_cases(device):
        bits = above_bits(self_, threshold)
        assert torch.equal(bits, packed_bits.pack_mask_reference(~(self_ <= threshold)))
        grad = torch.randn_like(self_)
        grad[(0,) * grad.dim()] = float("nan")
        grad[(-1,) * grad.dim()] = -0.0
        out = where_bits(grad, bits)
        expected = torch.ops.aten.threshold_backward(grad, self_, threshold)
        assert out.stride() == expected.stride()
        if self_.element_size() == 2:  # ATen's 16-bit kernel goes through fp32: a NaN's payload changes
            assert torch.equal(out.isnan(), expected.isnan())
            out, expected = out.nan_to_num(0.0), expected.nan_to_num(0.0)
            grad = grad.nan_to_num(0.0)
        assert _same_bits(out, expected)
        _check_out_form(where_bits_out, expected, grad, bits)


def test_relu_mask_ops_are_bitwise_threshold_backward_cpp_kernels():
    assert packed_bits.load_cpu_kernels(), "the C++ kernels (csrc/packed_bits.cpp) did not build; see the log"
    _check_relu_ops("cpu", torch.ops.hierremat.above_bits, torch.ops.hierremat.where_bits, torch.ops.hierremat.where_bits.out)


@pytest.mark.parametrize("kernels", ["cpp", "reference"])
def test_relu_mask_backward_of_a_gradient_slice_is_bitwise_threshold_backward(kernels):
    """A branch's gradient out of a concatenation's backward is a channel slice (not contiguous, not dense)."""
    assert packed_bits.load_cpu_kernels()
    where_bits, where_bits_out = (
        (torch.ops.hierremat.where_bits, torch.ops.hierremat.where_bits.out) if kernels == "cpp"
        else (packed_bits.where_bits_reference, packed_bits.where_bits_out_reference))
    torch.manual_seed(0)
    self_ = torch.randn(4, 6, 5, 5)
    grad = torch.randn(4, 16, 5, 5)[:, 3:9]
    grad[0, 0, 0, 0], grad[-1, -1, -1, -1] = float("nan"), -0.0
    bits = torch.ops.hierremat.above_bits(self_, 0.0)
    expected = torch.ops.aten.threshold_backward(grad, self_, 0.0)
    out = where_bits(grad, bits)
    assert out.stride() == expected.stride() and _same_bits(out, expected)
    into = torch.full_like(expected, 7.0)
    assert where_bits_out(grad, bits, out=into) is into and _same_bits(into, expected)


def test_relu_mask_ops_are_bitwise_threshold_backward_reference_kernels():
    _check_relu_ops(
        "cpu", packed_bits.above_bits_reference, packed_bits.where_bits_reference, packed_bits.where_bits_out_reference,
    )


@pytest.mark.cuda
def test_relu_mask_ops_are_bitwise_threshold_backward_on_cuda():
    _check_relu_ops("cuda", torch.ops.hierremat.above_bits, torch.ops.hierremat.where_bits, torch.ops.hierremat.where_bits.out)


class _CountingKernels:
    """A kernels module whose launchers count their calls (so a test sees the kernels ran, not
    only the references they fall back to)."""

    def __init__(self, module):
        self.module, self.calls = module, {}

    def __getattr__(self, name):
        attr = getattr(self.module, name)
        if name == "supports" or not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*args, **kwargs)
        return counted


def test_triton_packed_mask_kernels_equal_the_references_interpreted(interpreted_triton_kernels, monkeypatch):
    """The CUDA kernels (Triton), run by Triton's interpreter on CPU tensors through the CUDA
    registrations' own code: bitwise the references, contiguous fp16/bf16/fp32 by Triton, the
    other cases by the references. bf16 ``masked_scale`` is left to the CUDA test: the
    interpreter rounds fp32 to bf16 by truncation where the GPU rounds to nearest even."""
    kernels = _CountingKernels(interpreted_triton_kernels)
    monkeypatch.setattr(packed_bits, "cuda_kernels", lambda: kernels)
    _check_relu_ops("cpu", packed_bits._above_bits_cuda, packed_bits._where_bits_cuda, packed_bits._where_bits_out_cuda)
    _check_dropout_ops("cpu", packed_bits._masked_scale_cuda, packed_bits._masked_scale_out_cuda,
                       dtypes=(torch.float32, torch.float64))
    for numel in (1, 8, 1001, 40_000):
        mask = torch.rand(numel) < 0.5
        assert torch.equal(packed_bits._pack_mask_cuda(mask), packed_bits.pack_mask_reference(mask))
        assert torch.equal(packed_bits._pack_mask_cuda(mask[::2]), packed_bits.pack_mask_reference(mask[::2]))
    half = torch.randn(300, dtype=torch.float16)
    bits = packed_bits.pack_mask_reference(torch.rand(300) < 0.8)
    assert _same_bits(packed_bits._masked_scale_cuda(half, bits, 1.25), packed_bits.masked_scale_reference(half, bits, 1.25))
    assert set(kernels.calls) == {"above_bits", "where_bits_out", "masked_scale_out", "pack_mask"}, kernels.calls
    with pytest.raises(ValueError, match="bits: expected 38 uint8 bytes for 300 elements"):
        packed_bits._masked_scale_cuda(half, bits[:-1], 1.25)


def test_relu_mask_ops_pass_opcheck():
    x, grad = torch.randn(6, 11), torch.randn(6, 11)
    torch.library.opcheck(torch.ops.hierremat.above_bits.default, (x, 0.0))
    bits = torch.ops.hierremat.above_bits(x, 0.0)
    torch.library.opcheck(torch.ops.hierremat.where_bits.default, (grad, bits))
    # the out= forms only run in hierremat's own graphs: AOTAutograd never traces them (compiled
    # forms get the functional graph back, hierremat.blocks.variants.in_place.functional_joint)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    for op, args in ((torch.ops.hierremat.where_bits.out, (grad, bits)), (torch.ops.hierremat.masked_scale.out, (grad, bits, 2.0))):
        torch.library.opcheck(op, args, {"out": torch.empty_like(grad)}, test_utils=checks)


class ConvReluBlock(torch.nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.conv1, self.bn = torch.nn.Conv2d(width, width, 3, padding=1), torch.nn.BatchNorm2d(width)
        self.conv2 = torch.nn.Conv2d(width, width, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv2(torch.relu(self.bn(self.conv1(x)))) + x)


def test_relu_mask_joint_graph_gives_the_same_gradients_and_keeps_bits_instead_of_the_output():
    torch.manual_seed(0)
    block, x = ConvReluBlock(), torch.randn(2, 8, 8, 8)
    plain = trace_joint(block, x)
    masked = pack_relu_masks(trace_joint(block, x))
    targets = [n.target for n in masked.module.graph.nodes]
    assert torch.ops.aten.threshold_backward.default not in targets
    assert targets.count(torch.ops.hierremat.above_bits.default) == 2
    assert not any(n.target is torch.ops.aten.detach.default and not n.users for n in masked.module.graph.nodes)
    tangent = (torch.randn(2, 8, 8, 8),)
    a, b = run_joint(plain, x, (), tangent), run_joint(masked, x, (), tangent)
    assert _same_bits(a.outputs[0], b.outputs[0]) and _same_bits(a.input_grad, b.input_grad)
    for name, grad in a.param_grads.items():
        assert _same_bits(grad, b.param_grads[name]), name
    # autograd keeps the block's output only for its last ReLU's backward: 1 bit per element now
    output = plain.output_names[0]
    assert output in saved_for_backward(plain) and output not in saved_for_backward(masked)
    assert sum(saved_for_backward(masked).values()) < sum(saved_for_backward(plain).values())


# ---------------------------------------------------------------- max-pools pooled channels-last

from hierremat.ops.max_pool import MIN_ELEMENTS  # noqa: E402


def _pool_cases():
    """(input, kernel, stride, padding, dilation, ceil_mode): many ties, NaNs and signed zeros."""
    torch.manual_seed(0)
    for shape, args in (((4, 16, 40, 40), ([3, 3], [2, 2], [0, 0], [1, 1], True)),  # GoogLeNet's stem pool
                        ((2, 96, 14, 14), ([3, 3], [1, 1], [1, 1], [1, 1], True)),  # its branch pools
                        ((2, 32, 33, 31), ([2, 3], [2, 1], [1, 1], [2, 1], False)),
                        ((1, 3, 5, 5), ([2, 2], [2, 2], [0, 0], [1, 1], False))):  # below MIN_ELEMENTS
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            x = torch.randn(shape).round(decimals=1).to(dtype)
            flat = x.view(-1)
            flat[::97], flat[5::89], flat[7::83] = float("nan"), -0.0, 0.0
            yield x, args


def test_a_channels_last_max_pool_gives_atens_bits_and_gradients():
    assert any(x.numel() >= MIN_ELEMENTS for x, _ in _pool_cases())
    for x, args in _pool_cases():
        expected = torch.ops.aten.max_pool2d_with_indices(x, *args)
        got = torch.ops.hierremat.max_pool2d_with_indices(x, *args)
        assert _same_bits(got[0], expected[0]) and torch.equal(got[1], expected[1]), (x.shape, x.dtype)
        assert got[0].stride() == expected[0].stride() and got[1].stride() == expected[1].stride()
        grads = []
        for pool in (torch.ops.aten.max_pool2d_with_indices, torch.ops.hierremat.max_pool2d_with_indices):
            leaf = x.detach().requires_grad_()
            out = pool(leaf, *args)[0]
            out.backward(torch.ones_like(out).bernoulli_(0.5, generator=torch.Generator().manual_seed(1)))
            grads.append(leaf.grad)
        assert _same_bits(*grads), (x.shape, x.dtype)


def test_captured_max_pools_are_pooled_channels_last_and_train_bitwise():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(inplace=True),
        torch.nn.MaxPool2d(3, 2, ceil_mode=True), torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.ReLU(inplace=True),
        torch.nn.MaxPool2d(3, 1, 1), torch.nn.Flatten(), torch.nn.Linear(32 * 24 * 24, 10))
    x = torch.randn(4, 3, 48, 48)
    targets = {n.target for n in capture(model, (x,)).module.graph.nodes}
    assert torch.ops.aten.max_pool2d.default not in targets
    assert torch.ops.aten.max_pool2d.default in {n.target for n in capture(model, (x,), variants=False).module.graph.nodes}
    plain = train_step(copy.deepcopy(model), (x,), input_grad=True, warmup=1)
    trained = with_grads(copy.deepcopy(model))
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan(trained, (x,), budget="1KiB")
    budget = err.value.min_budget_bytes  # (below plain's peak: stages recomputed)
    assert budget < plain.tracker_peak
    module = hr.remat(trained, (x,), budget=budget)
    step = train_step(module, (x,), input_grad=True, warmup=1)
    assert_same_bits(step, plain)
    assert max(step.tracker_peak, step.allocator_peak) <= budget + CALLERS_LOSS_BYTES
