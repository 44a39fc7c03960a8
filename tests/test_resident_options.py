"""Block options of stages that read residents (hierremat.blocks.joint's ``resident_grads``).

A reader's joint graph takes each floating resident it reads as an input with a gradient and
the sum of the later readers' gradients as a seed; its backward adds the stage's terms to the
seed in the order plain autograd adds them, so that the sum handed to the next reader (and at
last to the producer) is bitwise plain autograd's. Checked against plain autograd on two
readers, for the joint graph and for every option of the reader's menu, and on whole models
whose plans run options of reader stages.
"""

import copy

import pytest
import torch
from torch import nn

import hierremat as hr
from hierremat.blocks.joint import run_joint, to_block_graph, trace_joint
from hierremat.runtime.node_profile import profile_nodes
from hierremat.ilp.options import solve_menu
from hierremat.device import memory_meter
from hierremat.runtime.block_exec import OptionExecutor
from hierremat.plans.schedule import FAll

from models import TinyUNet, same_bits


class _Reader(nn.Module):
    """Reads a context twice (two gradient terms), as a decoder layer reads an encoder's output."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x, context):
        attention = torch.softmax(x @ self.k(context).transpose(-1, -2), dim=-1)
        return x + self.out(torch.relu(attention @ self.v(context)))


def _two_readers():
    torch.manual_seed(0)
    first, second = _Reader(), _Reader()
    x = torch.randn(4, 8, 16)
    context = torch.randn(4, 8, 16)
    return first, second, x, context


def _plain_gradients(first, second, x, context, dy):
    """Plain autograd through both readers: the context's gradient, both readers' inputs' and
    parameters' gradients."""
    x = x.clone().requires_grad_()
    c = context.clone().requires_grad_()
    h = first(x, c)
    h.retain_grad()
    y = second(h, c)
    y.backward(dy)
    return c.grad, h.grad, x.grad, [p.grad for p in first.parameters()]


def _readers_with_the_later_sum():
    """Two readers, plain autograd's gradients through both, and the later reader's joint graph run
    without a seed (the last reader: no sum yet): (first, x, context, plain gradients, its result)."""
    first, second, x, context = _two_readers()
    dy = torch.randn(4, 8, 16)
    plain = _plain_gradients(first, second, x, context, dy)
    with torch.no_grad():
        h = first(x, context)
    joint_second = trace_joint(second, h, (context,), input_requires_grad=True, resident_grads=(0,))
    later = run_joint(joint_second, h, (context,), dy, seeds={0: None}, apply_mutations=False)
    return first, x, context, plain, later


def test_reader_joint_graph_adds_its_terms_to_the_later_readers_sum_as_plain_autograd_does():
    first, x, context, (c_grad, h_grad, x_grad, first_grads), later = _readers_with_the_later_sum()
    joint_first = trace_joint(first, x, (context,), input_requires_grad=True, resident_grads=(0,))
    assert list(joint_first.resident_seeds) == [0] and list(joint_first.resident_grads) == [0]
    assert to_block_graph(joint_first).held_grad_names == (joint_first.resident_grads[0],)
    assert same_bits(later.input_grad, h_grad)
    earlier = run_joint(joint_first, x, (context,), later.input_grad, seeds={0: later.resident_grads[0]})
    assert same_bits(earlier.resident_grads[0], c_grad)
    assert same_bits(earlier.input_grad, x_grad)
    names = [n for n, _ in first.named_parameters()]
    assert all(same_bits(earlier.param_grads[n], g) for n, g in zip(names, first_grads))


def test_every_option_of_a_readers_menu_gives_plain_autograds_sum():
    first, x, context, (c_grad, _, _, first_grads), later = _readers_with_the_later_sum()
    joint = trace_joint(first, x, (context,), input_requires_grad=True, resident_grads=(0,))
    graph = to_block_graph(joint, profile_nodes(joint, x, (context,)))
    menu = solve_menu(graph)
    assert len(menu.options) > 1
    for option in menu.options:
        for p in first.parameters():
            p.grad = None
        executor = OptionExecutor(joint, option)
        _, tape = executor.forward(x, (context,))
        _, sums = executor.backward_with_sums(tape, later.input_grad, (context,), {0: later.resident_grads[0].clone()})
        assert same_bits(sums[0], c_grad), option.name
        assert all(same_bits(p.grad, g) for p, g in zip(first.parameters(), first_grads)), option.name


class _ContextModel(nn.Module):
    """A first layer makes a context that four later layers read; the loss comes out of the last."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.make = nn.Linear(width, width)
        self.readers = nn.ModuleList(_Reader(width) for _ in range(4))

    def forward(self, x):
        context = torch.tanh(self.make(x))
        for layer in self.readers:
            x = layer(x, context)
        return x.pow(2).mean()


def _grads_and_peak(model, args):
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    torch.manual_seed(3)
    with memory_meter(torch.device("cpu")) as tracker:
        out = model(*args)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
    return {n.removeprefix("model."): p.grad.clone() for n, p in model.named_parameters()}, tracker.peak_bytes


@pytest.mark.parametrize("name", ["context", "unet"])
def test_plans_run_reader_options_bitwise_within_budget(name):
    if name == "context":
        torch.manual_seed(0)
        model, args = _ContextModel(), (torch.randn(8, 16, 32),)
    else:
        model, args = _unet_and_args()
    grads_ref, plain_peak = _grads_and_peak(copy.deepcopy(model), args)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # kept between steps, as _grads_and_peak runs them: planned so
    low = hr.explore(model, args).smallest_feasible_bytes
    ran_reader_option = False
    for budget in (low, (low + plain_peak) // 2, plain_peak):
        module = hr.remat(model, args, budget=f"{budget}B")
        plan = module.plans[0]
        layout = plan.chain.costs.residents
        readers = {s for r in layout for s in r.readers}
        used = [op.stage for op in plan.chain.schedule.ops if isinstance(op, FAll) and op.option > 0]
        ran_reader_option |= bool(readers & set(used))
        grads, peak = _grads_and_peak(module, args)
        assert peak <= budget, (name, budget, peak, plan.summary())
        assert [k for k, g in grads.items() if not same_bits(g, grads_ref[k])] == [], (name, budget)
    assert ran_reader_option, "no plan ran a block option of a stage reading residents"


def _unet_and_args():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    args = (torch.randn(2, 3, 32, 32, generator=generator), torch.randn(2, 3, 32, 32, generator=generator))
    return TinyUNet(), args


def _grads(module, step):
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    torch.manual_seed(3)
    loss = step(module)
    return [loss] + [p.grad.clone() for p in module.parameters()]


def test_compiled_training_step_of_a_model_with_residents_is_exact():
    """``torch.compile`` of a whole training step (backward inside) around a plan that carries
    residents and runs readers' options: bitwise the eager hierremat step."""
    model, args = _unet_and_args()
    low = hr.explore(model, args).smallest_feasible_bytes
    module = hr.remat(model, args, budget=f"{low}B", settings=hr.Settings(output_held=True))
    assert not module.plans[0].chain.schedule.keeps_everything
    eager_copy = copy.deepcopy(module)

    def train_step(m):
        loss = m(*args)
        loss.backward()
        return loss.detach()

    expected = _grads(eager_copy, train_step)
    compiled = torch.compile(train_step, backend="aot_eager")
    for _ in range(2):
        assert all(same_bits(a, b) for a, b in zip(_grads(module, compiled), expected))


def test_ddp_around_a_model_with_residents_gets_every_gradient(tmp_path):
    """DistributedDataParallel (gloo, one rank) around a plan with residents: every gradient,
    readers' options' included, reaches DDP's reducer through autograd's accumulation hooks,
    and the step is bitwise plain autograd's, twice in a row."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    model, args = _unet_and_args()
    reference = copy.deepcopy(model)
    low = hr.explore(model, args).smallest_feasible_bytes
    module = hr.remat(model, args, budget=f"{low}B")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        wrapped = DistributedDataParallel(module)

        def step(m):
            loss = m(*args)
            loss.backward()
            return loss.detach()

        expected = _grads(reference, step)
        for _ in range(2):
            got = _grads(wrapped, step)
            assert all(same_bits(a, b) for a, b in zip(got, expected))
    finally:
        dist.destroy_process_group()
