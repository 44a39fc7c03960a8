"""One set of graphs for every input shape (hierremat.blocks.generic): a shape specialized from the symbolic capture
runs its family's size-generic stages and orchestrator, checked to be its own program, and keeps no graph of its own
("no graph per shape")."""

from __future__ import annotations

import copy
import gc

import sympy
import torch
from torch import fx

import hierremat as hr
from hierremat.api.planned_shape import ChainDispatch, chain_inputs
from hierremat.blocks.capture import capture
from hierremat.blocks.generic import GenericChain, _same, same_but_sizes, size_generic
from hierremat.blocks.segment import build_chain_graph
from hierremat.blocks.symbolic import SYMBOLIC_SHAPE, SizeLiteral, capture_symbolic

from models import padded_batch, tiny_gpt2

VOCAB = 512


def _batch(length: int, batch: int = 2, pad: int = 0, seed: int = 0) -> dict:
    """A dynamically padded batch (models.padded_batch), called as the capture is: without a key/value cache."""
    return {**padded_batch(length, batch, pad, seed, VOCAB), "use_cache": False}


def _chain(model, symbolic, kwargs):
    return build_chain_graph(capture(model, (), kwargs, symbolic=symbolic, export=False), model)


def test_a_chain_made_size_generic_runs_every_shape_of_the_capture_as_its_own_graphs_do_bitwise():
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2, vocab_size=VOCAB).eval()
    symbolic = capture_symbolic(model, (), _batch(24, pad=3))
    reference = _chain(model, symbolic, _batch(24, pad=3))
    generic = GenericChain.of(reference, ChainDispatch())
    assert generic is not None
    # each size is computed from the graph's own inputs: no size of the shape it was made from is left
    sizes = [n for m in (generic.orchestrator, *(s.graph_module for s in generic.stages)) for n in m.graph.nodes
             if n.target is torch.ops.aten.sym_size.int]
    assert sizes
    for length, batch, pad in ((37, 3, 5), (9, 2, 0), (24, 2, 1)):
        kwargs = _batch(length, batch, pad, seed=1)
        chain = _chain(model, symbolic, kwargs)
        assert generic.holds_for(chain), length
        x, shared = chain_inputs(chain, (), kwargs)
        with torch.no_grad():
            for own, shared_stage in zip(chain.stages, generic.stages):
                expected, got = own(x, *shared), shared_stage(x, *shared)
                expected, got = (expected, got) if isinstance(expected, tuple) else ((expected,), (got,))
                assert all(torch.equal(a, b) for a, b in zip(expected, got) if isinstance(a, torch.Tensor)), length
                x = expected[0]


def test_a_graph_that_differs_from_the_reference_in_more_than_its_sizes_is_not_its_program():
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2, vocab_size=VOCAB).eval()
    symbolic = capture_symbolic(model, (), _batch(24))
    reference = _chain(model, symbolic, _batch(24))
    generic = GenericChain.of(reference, ChainDispatch())
    other = _chain(model, symbolic, _batch(31))
    assert generic.holds_for(other)
    stage = other.stages[1].graph_module
    node = next(n for n in stage.graph.nodes if _literals(n.args))
    # the same value without what it stands for: an int the program fixed at this shape
    node.args = fx.node.map_aggregate(node.args, lambda v: int(v) if isinstance(v, SizeLiteral) else v)
    assert not same_but_sizes(reference.stages[1].graph_module, stage)
    assert not generic.holds_for(other)
    # another constant
    other = _chain(model, symbolic, _batch(31))
    stage = other.stages[1].graph_module
    node = next(n for n in stage.graph.nodes if any(isinstance(a, float) for a in n.args))
    node.args = tuple(a * 2 if isinstance(a, float) else a for a in node.args)
    assert not generic.holds_for(other)


def _literals(value) -> list:
    found = []
    fx.node.map_aggregate(value, lambda v: found.append(v) if isinstance(v, SizeLiteral) else v)
    return found


def _full_graph(size: int, shape: tuple) -> fx.GraphModule:
    """x -> torch.full([size], 1.0), x's sizes in the symbolic capture ``shape``."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta[SYMBOLIC_SHAPE] = shape
    graph.output(graph.call_function(torch.ops.aten.full.default, ([size], 1.0)))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_sizes_are_computed_from_the_inputs_dimensions_with_the_arithmetic_they_were_folded_from():
    from torch.utils._sympy.functions import CeilDiv, FloorDiv, Max, Min, Mod, PowByNatural, PythonMod

    s0, s1 = sympy.symbols("s0 s1", integer=True, positive=True)
    size = SizeLiteral(16, FloorDiv(s0 * s1, 4) + 2 * s0 - 11)  # (folded at 6 x 10: 15 + 12 - 11)
    gm = _full_graph(size, (s0, s1))
    assert gm(torch.zeros(4, 12)).shape == (16,)  # (the graph as specialized: the size it was folded at)
    generic = size_generic(gm)
    assert generic is not None and generic is not gm
    assert generic(torch.zeros(6, 10)).shape == (16,)
    assert generic(torch.zeros(4, 12)).shape == (9,)  # 12 + 8 - 11
    assert same_but_sizes(gm, _full_graph(SizeLiteral(9, size.expr), (s0, s1)))
    assert not same_but_sizes(gm, _full_graph(SizeLiteral(9, s0 + 3), (s0, s1)))  # another size
    assert not same_but_sizes(gm, _full_graph(16, (s0, s1)))  # a size fixed at 16
    # powers, maxima, minima, remainders and ceiling divisions, as torch's shape environment writes them
    size = s0 ** 2 + PowByNatural(s1, 2) + Max(s0, s1 - 3) + Min(s0, 5) + Mod(s1, 4) + PythonMod(s0, 3) \
        + CeilDiv(s1, 3) + sympy.Max(s0, 2)

    def expected(a, b):
        return a * a + b * b + max(a, b - 3) + min(a, 5) + b % 4 + a % 3 + -(-b // 3) + max(a, 2)

    generic = size_generic(_full_graph(SizeLiteral(expected(6, 10), size), (s0, s1)))
    assert generic is not None
    for a, b in ((6, 10), (4, 12), (7, 3), (2, 17)):
        assert generic(torch.zeros(a, b)).shape == (expected(a, b),), (a, b)
    # a symbol that is no whole dimension of an input, a power that is not a natural number's, a fraction: the
    # graph keeps its own sizes
    assert size_generic(_full_graph(SizeLiteral(6, sympy.Symbol("s7")), (s0, s1))) is None
    assert size_generic(_full_graph(SizeLiteral(1, s0 ** -1 * 6), (s0, s1))) is None
    assert size_generic(_full_graph(SizeLiteral(3, s0 / 2), (s0, s1))) is None
    # a graph without sizes: a copy of its own (its source kept with it)
    plain = _full_graph(6, (s0, s1))
    assert size_generic(plain) is not plain and size_generic(plain)(torch.zeros(4, 12)).shape == (6,)
    # a size inside a slice is compared as a size too
    assert _same(slice(0, SizeLiteral(4, s1)), slice(0, SizeLiteral(7, s1)), {})
    assert not _same(slice(0, SizeLiteral(4, s1)), slice(0, 4), {})
    assert not _same(slice(0, SizeLiteral(4, s1)), slice(0, SizeLiteral(4, s0)), {})


def _graph_modules() -> int:
    gc.collect()
    return sum(isinstance(o, fx.GraphModule) for o in gc.get_objects())


def test_shapes_specialized_from_the_capture_share_one_set_of_graphs_and_train_bitwise(monkeypatch):
    checks = []  # (whether a shape runs the generic graphs: checked once per shape, not again after its planning)
    holds_for = GenericChain.holds_for
    monkeypatch.setattr(GenericChain, "holds_for", lambda self, chain: checks.append(1) or holds_for(self, chain))
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2, vocab_size=VOCAB)
    reference = copy.deepcopy(model)
    module = hr.remat(model, (), _batch(40, pad=3), budget="64GiB",
                      settings=hr.Settings(cache=False))  # (padded: symbolic at once)
    lengths = (40, 17, 63, 29, 40, 17, 50, 33)
    for step, length in enumerate(lengths):
        batch = _batch(length, pad=0 if step == 3 else 1 + step % 4, seed=step)  # (29: every mask all ones)
        for m in (model, reference):
            torch.manual_seed(step)
            m_out = (module if m is model else reference)(**batch)
            m_out.loss.backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters())), length
        model.zero_grad()
        reference.zero_grad()
        if step == 3:
            graphs_after_four = _graph_modules()
    compiled = list(module._planned.values())
    assert len(compiled) == len(set(lengths))
    assert all(c.dispatch is not None and c.sources == [] for c in compiled)
    assert len({id(c.chain.orchestrator) for c in compiled}) == 1
    assert len({tuple(map(id, c.chain.stages)) for c in compiled}) == 1
    # three more lengths planned, no graph more held
    assert _graph_modules() == graphs_after_four
    assert len(checks) == len(set(lengths)) - 1  # (the first made them: one a shape after)


def test_plans_that_hold_graphs_of_their_own_are_bounded_apart(monkeypatch):
    from hierremat.api import whole_model

    monkeypatch.setattr(whole_model, "MAX_SHAPES_WITH_GRAPHS", 1)
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2, vocab_size=VOCAB)
    shared = hr.remat(model, (), _batch(40, pad=3), budget="64GiB", settings=hr.Settings(cache=False))
    own = hr.remat(copy.deepcopy(model), (), _batch(40, pad=3), budget="64GiB",
                   settings=hr.Settings(cache=False, dynamic=False))
    lengths = (40, 17, 29, 33)
    for length in lengths:
        for module in (shared, own):
            module(**_batch(length, pad=1)).loss.backward()
    assert len(shared.plans) == len(lengths) and not any(c.holds_graphs for c in shared._planned.values())
    (kept,) = own._planned.values()  # (each exported on its own: the one used last)
    assert kept.holds_graphs and kept.skeleton[1]["input_ids"].shape[1] == lengths[-1]


def test_shapes_sharing_graphs_accumulate_gradients_across_shapes_and_survive_a_deepcopy():
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2, vocab_size=VOCAB).eval()
    reference = copy.deepcopy(model)
    module = hr.remat(model, (), _batch(40, pad=3), budget="64GiB", settings=hr.Settings(cache=False))
    for length in (40, 23, 31):  # (each planned, sharing the family's graphs)
        module(**_batch(length, pad=1)).loss.backward()
    model.zero_grad()
    # two shapes' forwards, then both backwards: each runs its own plan through the one orchestrator
    losses = [module(**_batch(length, pad=2, seed=5)).loss for length in (23, 31)]
    sum(losses).backward()
    expected = [reference(**_batch(length, pad=2, seed=5)).loss for length in (23, 31)]
    sum(expected).backward()
    assert all(torch.equal(a, b) for a, b in zip(losses, expected))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
    copied = copy.deepcopy(module)
    assert torch.equal(copied(**_batch(31, pad=2, seed=6)).loss, reference(**_batch(31, pad=2, seed=6)).loss)
    assert all(c.dispatch is not None for c in copied._planned.values() if c.bindings)


def test_a_family_whose_last_plan_is_dropped_is_forgotten_with_its_generic_graphs_and_their_sources():
    from hierremat.blocks.sources import _eval_cache

    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2, vocab_size=VOCAB).eval()
    reference = copy.deepcopy(model)
    module = hr.remat(model, (), _batch(40, pad=3), budget="64GiB", settings=hr.Settings(cache=False, max_shapes=2))
    for length in (40, 17):
        module(**_batch(length, pad=1)).loss.backward()
    (family,) = module._families.generic
    sources = [key for generic in module._families.generic[family] for key in generic.sources]
    assert sources and all(key in _eval_cache() for key in sources)
    for length in (33, 21):  # calls of another family (no labels): the first family's two plans dropped
        unlabelled = {k: v for k, v in _batch(length, pad=1).items() if k != "labels"}
        module(**unlabelled).logits.sum().backward()
    assert all(c.family != family for c in module._planned.values())
    assert family not in module._families.kept() and not any(key in _eval_cache() for key in sources)
    model.zero_grad()
    batch = _batch(29, pad=2, seed=3)  # (the first family again: captured again, as at its first shape)
    loss = module(**batch).loss
    loss.backward()
    expected = reference(**batch).loss
    expected.backward()
    assert torch.equal(loss, expected)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
