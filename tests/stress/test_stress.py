"""Stress suite: random chains and random DAG blocks at random budgets keep hierremat's promises.

Each case is a randomly built model (hypothesis): a chain of stages drawn from Linear,
Conv1d (with or without BatchNorm), LayerNorm, BatchNorm, activations (in-place ReLU included), dropout, views, residual blocks,
multi-output ops (chunk, max) and random DAG blocks that read their input several times;
or a whole model whose blocks share a grad-free side input (a mask computed once). Every
case checks that

- a too-small budget raises InfeasibleBudgetError, and a plan at the minimum it reports
  trains within that minimum;
- at a random budget between that minimum and more than plain autograd's peak, the
  simulator reproduces the DP's predicted peak and time, the gradients (input and parameters) and
  BatchNorm's running statistics equal plain autograd's, dropout included, and the peak
  measured by the live-tensor tracker is within the budget.

The default run takes a quick slice (``HIERREMAT_STRESS_EXAMPLES``, default 50 cases over
the two tests, derandomized so CI is repeatable). The full run is 1,000 cases:

    HIERREMAT_STRESS_EXAMPLES=1000 HIERREMAT_STRESS_RANDOM=1 python -m pytest -m stress tests/stress
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import hierremat as hr

from harness import Checkpointed, mean_square, train_step

pytestmark = pytest.mark.stress

EXAMPLES = int(os.environ.get("HIERREMAT_STRESS_EXAMPLES", "25"))
STRESS = settings(
    max_examples=max(1, EXAMPLES * 4 // 5),
    deadline=None,
    derandomize=not os.environ.get("HIERREMAT_STRESS_RANDOM"),
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MODEL_STRESS = settings(STRESS, max_examples=max(1, EXAMPLES - EXAMPLES * 4 // 5))

WIDTH = 16  # features per token: every stage maps [rows, WIDTH] -> [rows, WIDTH]


# ---------------------------------------------------------------------------------------------
# stages


class Residual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        return x + self.f(x)


class ViewRoundTrip(nn.Module):
    """Linear, then a transpose through views and back: view ops between real ones."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        y = self.lin(x)
        n = y.shape[0]
        return y.view(n, 2, -1).transpose(1, 2).reshape(n, -1).tanh()


class Conv(nn.Module):
    """A 1-d convolution over the features seen as 4 channels (with BatchNorm or not)."""

    def __init__(self, width: int, norm: bool):
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, padding=1)
        self.norm = nn.BatchNorm1d(4) if norm else nn.Identity()

    def forward(self, x):
        n = x.shape[0]
        return torch.relu(self.norm(self.conv(x.view(n, 4, -1)))).reshape(n, -1)


class ChunkGate(nn.Module):
    """A multi-output op (chunk) whose results are used differently."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        a, b = self.lin(x).chunk(2, dim=-1)
        return torch.cat([a * torch.sigmoid(b), b], dim=-1)


class MaxCenter(nn.Module):
    """torch.max over a dim: values and indices, one of them used."""

    def forward(self, x):
        values, _ = x.max(dim=-1, keepdim=True)
        return x - values


class InplaceRelu(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu_(self.lin(x))


class RandomDag(nn.Module):
    """A random DAG of ops over the stage input: each node reads one or two earlier nodes
    (the input among them, so it is read several times)."""

    UNARY = ("linear", "gelu", "tanh", "dropout")
    BINARY = ("add", "mul", "sub")

    def __init__(self, width: int, nodes: list[tuple[str, int, int]]):
        super().__init__()
        self.nodes = nodes
        self.linears = nn.ModuleList(nn.Linear(width, width) for op, _, _ in nodes if op == "linear")
        self.dropout = nn.Dropout(0.25)

    def forward(self, x):
        values = [x]
        linears = iter(self.linears)
        for op, a, b in self.nodes:
            u, v = values[a % len(values)], values[b % len(values)]
            if op == "linear":
                out = next(linears)(u)
            elif op == "gelu":
                out = nn.functional.gelu(u)
            elif op == "tanh":
                out = torch.tanh(u)
            elif op == "dropout":
                out = self.dropout(u)
            elif op == "add":
                out = u + v
            elif op == "mul":
                out = u * torch.sigmoid(v)
            else:
                out = u - 0.5 * v
            values.append(out)
        return values[-1] + values[len(values) // 2]


def make_stage(spec: tuple) -> nn.Module:
    kind = spec[0]
    if kind == "linear":
        return nn.Linear(WIDTH, WIDTH)
    if kind == "layernorm":
        return nn.LayerNorm(WIDTH)
    if kind == "batchnorm":
        return nn.BatchNorm1d(WIDTH)
    if kind == "gelu":
        return nn.GELU()
    if kind == "tanh":
        return nn.Tanh()
    if kind == "inplace_relu":
        return InplaceRelu(WIDTH)
    if kind == "dropout":
        return nn.Dropout(spec[1])
    if kind == "residual":
        return Residual(WIDTH)
    if kind == "view":
        return ViewRoundTrip(WIDTH)
    if kind == "chunk":
        return ChunkGate(WIDTH)
    if kind == "conv":
        return Conv(WIDTH, norm=False)
    if kind == "conv_bn":
        return Conv(WIDTH, norm=True)
    if kind == "max":
        return MaxCenter()
    if kind == "dag":
        return RandomDag(WIDTH, spec[1])
    raise AssertionError(kind)


dag_nodes = st.lists(
    st.tuples(st.sampled_from(RandomDag.UNARY + RandomDag.BINARY), st.integers(0, 7), st.integers(0, 7)),
    min_size=2, max_size=6,
)
stage_specs = st.one_of(
    st.sampled_from([("linear",), ("layernorm",), ("batchnorm",), ("gelu",), ("tanh",), ("inplace_relu",),
                     ("residual",), ("view",), ("chunk",), ("max",), ("conv",), ("conv_bn",)]),
    st.tuples(st.just("dropout"), st.sampled_from([0.1, 0.5])),
    st.tuples(st.just("dag"), dag_nodes),
)


@st.composite
def chains(draw):
    specs = draw(st.lists(stage_specs, min_size=2, max_size=7))
    # the first stage has parameters, so that every case has gradients to compare
    return [("linear",)] + specs, draw(st.integers(4, 48)), draw(st.booleans()), draw(st.integers(0, 2**16))


# ---------------------------------------------------------------------------------------------
# checks


def _build_chain(specs, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[make_stage(s) for s in specs]).train()


def _step(run: nn.Module, x: torch.Tensor, seed: int):
    """One training step of ``run(x)``, ``.grad`` None at its start (harness.train_step);
    (output, input grad, param grads, buffers, tracker peak)."""
    step = train_step(run, (x,), lambda y: (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum(), seed=seed,
                      grads_allocated=False, input_grad=x.requires_grad, hold_output=True, meters="tracker")
    return step.output, step.input_grad, list(step.grads), list(step.buffers), step.tracker_peak


def _assert_equal_steps(got, want, context: str):
    y, gx, grads, buffers, _ = got
    y_ref, gx_ref, grads_ref, buffers_ref, _ = want
    close = dict(rtol=1e-5, atol=1e-6, msg=lambda m: f"{context}: {m}")
    torch.testing.assert_close(y, y_ref, **close)
    if gx_ref is not None:
        torch.testing.assert_close(gx, gx_ref, **close)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, **close)
    for a, b in zip(buffers, buffers_ref):
        torch.testing.assert_close(a, b, **close)


def _run_sequential(model: nn.Sequential, budget: int, x: torch.Tensor, want, seed: int, context: str) -> None:
    """Plan (outside the measured step), check the simulator and the prediction, then train one step."""
    plan = hr.plan_sequential(model, f"{budget}B", x)
    simulated = plan.simulate()
    assert simulated.peak_bytes == plan.schedule.predicted_peak_bytes, context
    assert simulated.time == pytest.approx(plan.schedule.predicted_time, rel=1e-9), context
    assert plan.predicted_peak_bytes <= budget, context
    trained = copy.deepcopy(model)
    hr.checkpoint_sequential(trained, f"{budget}B", x.detach().requires_grad_(x.requires_grad))  # plans, untracked
    with torch.no_grad():
        for b_t, b_m in zip(trained.buffers(), model.buffers()):
            b_t.copy_(b_m)  # that call ran a forward: start from the same running statistics
    got = _step(Checkpointed(trained, f"{budget}B"), x, seed)
    _assert_equal_steps(got, want, context)
    assert got[4] <= budget, f"{context}: measured peak {got[4]} B > budget {budget} B\n{plan.summary()}"


@STRESS
@given(case=chains(), fraction=st.floats(0.0, 1.0))
def test_random_chain_at_random_budget(case, fraction):
    specs, rows, input_grad, seed = case
    model = _build_chain(specs, seed)
    x = torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(seed))
    x.requires_grad_(input_grad)
    reference = copy.deepcopy(model)
    want = _step(reference, x, seed + 1)
    context = f"stages={specs}, rows={rows}, input_grad={input_grad}, seed={seed}"
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan_sequential(model, "1KiB", x)
    smallest = err.value.min_budget_bytes
    _run_sequential(model, smallest, x, want, seed + 1, context + ", at the reported minimum")
    budget = int(smallest + fraction * (1.3 * want[4] - smallest))
    _run_sequential(model, max(budget, smallest), x, want, seed + 1, context + f", budget {budget} B")


# ---------------------------------------------------------------------------------------------
# whole models whose blocks share a grad-free side input


class MaskedBlock(nn.Module):
    def __init__(self, spec: tuple):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.f = make_stage(spec)

    def forward(self, h, mask):
        return h + self.f(self.norm(h)) * mask


class SideInputModel(nn.Module):
    """Blocks in a ModuleList, each reading a mask computed once from the input (a shared value)."""

    def __init__(self, specs: list[tuple]):
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(MaskedBlock(s) for s in specs)
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x):
        mask = (x[:, :1] > 0).to(x.dtype)
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, mask)
        return self.head(h)


@st.composite
def side_input_models(draw):
    repeated = draw(stage_specs)
    specs = [repeated] * draw(st.integers(1, 4)) + draw(st.lists(stage_specs, max_size=2))
    return specs, draw(st.integers(4, 32)), draw(st.integers(0, 2**16))


def _model_step(module: nn.Module, x: torch.Tensor, seed: int):
    """As :func:`_step`, with the output's mean square as the loss and no input gradient."""
    step = train_step(module, (x,), mean_square, seed=seed, grads_allocated=False, hold_output=True,
                      meters="tracker")
    return step.output, None, list(step.grads), list(step.buffers), step.tracker_peak


@MODEL_STRESS
@given(case=side_input_models(), fraction=st.floats(0.0, 1.0))
def test_random_model_with_shared_side_input(case, fraction):
    specs, rows, seed = case
    torch.manual_seed(seed)
    model = SideInputModel(specs).train()
    x = torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(seed))
    reference = copy.deepcopy(model)
    want = _model_step(reference, x, seed + 1)
    context = f"blocks={specs}, rows={rows}, seed={seed}"
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan(model, (x,), budget="1KiB")
    smallest = err.value.min_budget_bytes
    budget = max(smallest, int(smallest + fraction * (1.3 * want[4] - smallest)))
    for b in (smallest, budget):
        trained = copy.deepcopy(model)
        module = hr.remat(trained, (x,), budget=f"{b}B")
        (plan,) = module.plans
        simulated = plan.chain.simulate()
        assert simulated.peak_bytes == plan.chain.schedule.predicted_peak_bytes, context
        assert simulated.time == pytest.approx(plan.chain.schedule.predicted_time, rel=1e-9), context
        got = _model_step(module, x, seed + 1)
        _assert_equal_steps(got, want, f"{context}, budget {b} B")
        assert got[4] <= b, f"{context}: measured peak {got[4]} B > budget {b} B\n{plan.summary()}"
