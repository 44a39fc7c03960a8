"""One joint graph for every shape of a stage (hierremat.blocks.symbolic_joint, hierremat.planning.family_programs):
a size-generic stage traced once with symbolic sizes gives, at each shape, the BlockGraph a trace at that shape gives
(node for node, byte for byte), and block options' code generated from it once runs every shape with the gradients
of plain autograd, bitwise ("no graph per shape")."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import hierremat as hr

from hierremat.api.planned_shape import ChainDispatch, chain_inputs
from hierremat.blocks.capture import capture
from hierremat.blocks.generic import GenericChain, NotGeneric
from hierremat.blocks.joint import is_size_node, to_block_graph, trace_joint
from hierremat.blocks.segment import build_chain_graph
from hierremat.blocks.sources import _eval_cache, source_keys
from hierremat.blocks.symbolic import capture_symbolic
from hierremat.blocks.symbolic_joint import trace_symbolic_joint
from hierremat.ilp.options import recost_options, solve_menu
from hierremat.planning.family_programs import FamilyPrograms, _check_size_sources
from hierremat.planning import menus as menus_module
from hierremat.planning.menu_store import graph_structure
from hierremat.planning.menus import _with_variants
from hierremat.planning.stage_calls import rebind, stage_arguments
from hierremat.runtime.block_exec import OptionExecutor
from hierremat.runtime.node_profile import profile_nodes
from hierremat.runtime.option_codegen import StageBinding

from models import padded_batch, tiny_gpt2, tiny_llama

VOCAB = 256  # (tiny_llama's)
KEY = (1, "test")  # (stage 1, one trace setting)


def _batch(length: int, batch: int = 2, pad: int = 0, seed: int = 0) -> dict:
    return {**padded_batch(length, batch, pad, seed, VOCAB), "use_cache": False}


def _stage_at(model, symbolic, generic, kwargs, i):
    """Stage ``i`` specialized at ``kwargs``'s shape, its family's generic stage, and their arguments there."""
    chain = build_chain_graph(capture(model, (), kwargs, symbolic=symbolic, export=False), model)
    assert generic.holds_for(chain)
    x0, shared = chain_inputs(chain, (), kwargs)
    xs, shareds = stage_arguments(chain.stages, x0, shared)
    return chain.stages[i], xs[i].detach(), shareds[i]


def _family(model, first: dict):
    symbolic = capture_symbolic(model, (), first)
    chain = build_chain_graph(capture(model, (), first, symbolic=symbolic, export=False), model)
    generic = GenericChain.of(chain, ChainDispatch())
    assert generic is not None
    return symbolic, generic


def _static(stage, x, shared):
    return _with_variants(trace_joint(stage, x, shared, input_requires_grad=True))


def test_the_joint_traced_once_gives_each_shapes_block_graph_node_for_node_and_byte_for_byte():
    for model in (tiny_gpt2(n_layer=2, vocab_size=VOCAB), tiny_llama(n_layer=2)):  # (GPT-2 with its dropouts)
        torch.manual_seed(0)
        symbolic, generic = _family(model, _batch(24, pad=3))
        programs = FamilyPrograms(generic.stages)
        stage, x, shared = _stage_at(model, symbolic, generic, _batch(24, pad=3), 1)
        traced = _static(stage, x, shared)
        programs.adopt(KEY, traced, x, shared, _with_variants, graph_structure, input_requires_grad=True)
        assert programs.joints[KEY] is not None, type(model).__name__
        assert any(is_size_node(n) for n in programs.joints[KEY].joint.nodes)
        for length, batch, pad in ((37, 3, 5), (9, 2, 0), (50, 2, 7)):
            stage, x, shared = _stage_at(model, symbolic, generic, _batch(length, batch, pad, seed=1), 1)
            here = programs.joint_at(KEY, x, shared)
            assert here is not None
            expected = to_block_graph(_static(stage, x, shared))
            assert graph_structure(to_block_graph(here)) == graph_structure(expected), (type(model).__name__, length)


def test_options_generated_once_run_every_shape_with_plain_autograds_gradients_bitwise():
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2, vocab_size=VOCAB).eval()
    symbolic, generic = _family(model, _batch(24, pad=3))
    programs = FamilyPrograms(generic.stages)
    stage, x, shared = _stage_at(model, symbolic, generic, _batch(24, pad=3), 1)
    traced = _static(stage, x, shared)
    programs.adopt(KEY, traced, x, shared, _with_variants, graph_structure, input_requires_grad=True)
    assert programs.joints[KEY] is not None  # (its in-place calls as the trace at this shape has them)
    graph = to_block_graph(traced, profile_nodes(traced, x, shared, method="flops"))
    options = solve_menu(graph, time_limit=20).options
    assert len(options) >= 2
    made = {}
    for length, batch, pad in ((37, 3, 5), (9, 2, 0)):
        stage, x, shared = _stage_at(model, symbolic, generic, _batch(length, batch, pad, seed=1), 1)
        here = programs.joint_at(KEY, x, shared)
        recost_options(to_block_graph(here), options)  # (the options hold at these sizes)
        x = x.requires_grad_()
        y = stage(x, *shared)
        dy = torch.randn_like(y)
        expected = torch.autograd.grad(y, (x, *stage.parameters()), dy)
        bound = rebind(here, generic.stages[1])
        for option in options:
            generated = programs.option(KEY, here, option)
            assert made.setdefault(option.name, generated) is generated  # (one program for every shape)
            for p in generic.stages[1].parameters():
                p.grad = None
            executor = OptionExecutor(bound, option, generated, StageBinding(bound))
            out, tape = executor.forward(x, shared)
            dx = executor.backward(tape, dy, shared)
            grads = [p.grad for p in generic.stages[1].parameters()]
            assert torch.equal(out, y.detach()) and torch.equal(dx, expected[0]), (length, option.name)
            assert all(torch.equal(a, b) for a, b in zip(grads, expected[1:])), (length, option.name)


def test_a_shape_the_trace_does_not_hold_for_traces_its_own():
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2, vocab_size=VOCAB).eval()
    symbolic, generic = _family(model, _batch(24, pad=3))
    stage, x, shared = _stage_at(model, symbolic, generic, _batch(24, pad=3), 1)
    traced = trace_symbolic_joint(generic.stages[1], x, shared, input_requires_grad=True)
    assert traced.at_sizes(x, shared) is not None
    mask = next(i for i in generic.stages[1].shared_indices if shared[i].dim() == 4)  # (one the stage reads)
    other = list(shared)
    other[mask] = shared[mask][..., :-1, :-1]  # (the mask's length is x's: one symbol, two values)
    assert traced.at_sizes(x, tuple(other)) is None
    assert traced.at_sizes(x[:, :, :1], shared) is None  # (a dimension the trace fixed)
    # a size the backward could compute from x alone, which an option need not keep: not kept for every shape
    _check_size_sources(traced.joint)
    with pytest.raises(NotGeneric):
        _check_size_sources(dataclasses.replace(traced.joint, tangent_names={}, shared_names=()))


def test_plans_re_costed_at_each_length_run_one_program_per_option_and_train_bitwise(monkeypatch):
    """A padded loop at a budget that needs block options at each length: the first length re-costed after the
    family's size-generic chain exists traces its stages and gives the family its joint graphs; every later one runs
    the programs generated once from them, holds no graph of its own, and trains with plain autograd's gradients."""
    from hierremat.api import shape_planning

    monkeypatch.setattr(shape_planning, "NOISE_MARGIN", 0.0)  # (re-costed wherever block options save any time)
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=3, vocab_size=VOCAB)  # (training: dropouts, drawn as plain autograd draws them)
    reference = copy.deepcopy(model)
    plain = hr.plan(model, (), _batch(64, pad=3), budget="64GiB",
                    settings=hr.Settings(strategy="none", cache=False)).predicted_peak_bytes
    module = hr.remat(model, (), _batch(64, pad=3), budget=int(0.45 * plain),
                      settings=hr.Settings(cache=False, defer_block_options=False))
    for step, length in enumerate((64, 60, 62, 58, 63, 61)):
        module._building.recost_seconds = 0.0  # (re-costing taken to be free: at each length's first call)
        batch = _batch(length, pad=1 + step % 3, seed=step)
        for m in (module, reference):
            torch.manual_seed(step)
            m(**batch).loss.backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters())), length
        model.zero_grad()
        reference.zero_grad()
    family = [c for c in module._planned.values()
              if c.chain_module.planned.menus is not None and c.chain_module.planned.menus.shared_code]
    assert len(family) >= 2 and not any(c.holds_graphs for c in family)
    programs = [{(i, e.option.name): e.generated for i, row in enumerate(c.chain_module.planned.menus.executors)
                 for e in row if e is not None} for c in family]
    common = set(programs[0]) & set(programs[-1])
    assert common and all(programs[0][k] is programs[-1][k] for k in common)
    # forgotten with the family, their fx sources too
    (shared,) = module._families.programs.values()
    held = [key for key in source_keys(shared.graph_modules()) if key in _eval_cache()]
    assert held
    module._families.forget(family[0].family)
    assert not module._families.programs and not any(key in _eval_cache() for key in held)


def test_the_fused_head_is_made_once_for_every_shape_of_a_family(monkeypatch):
    """With ``outputs="loss"`` the output stage also offers its LM head fused with the loss: every length that runs
    its family's size-generic chain offers the one fused stage made from the generic last stage (its sizes computed
    from its inputs), holds no graph of its own for it, and trains as plain autograd does (to the fused head's fp32
    rounding: tests/test_fused_head.py)."""
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2, vocab_size=VOCAB)
    reference = copy.deepcopy(model)
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan(model, (), _batch(64, pad=3), budget="1KiB", outputs="loss", settings=hr.Settings(cache=False))
    budget = int(1.1 * err.value.min_budget_bytes)
    real_option = menus_module.fused_head_option

    def free_fused_head(*args, **kwargs):  # (picked wherever it fits, whatever this machine's times: it is what runs)
        fused = real_option(*args, **kwargs)
        return fused and (dataclasses.replace(fused[0], fwd_time=0.0, bwd_time=0.0), *fused[1:])

    monkeypatch.setattr(menus_module, "fused_head_option", free_fused_head)
    module = hr.remat(model, (), _batch(64, pad=3), budget=budget, outputs="loss", settings=hr.Settings(cache=False))
    fused = []
    for step, length in enumerate((64, 41, 57, 33, 60)):
        batch = _batch(length, pad=1 + step % 3, seed=step)
        for m in (module, reference):
            torch.manual_seed(step)
            m(**batch).loss.backward()
        for (name, a), b in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=f"{length}: {name}")
        model.zero_grad()
        reference.zero_grad()
        compiled = module._planned[next(reversed(module._planned))]
        menus = compiled.chain_module.planned.menus
        if compiled.dispatch is not None and menus is not None and menus.output_shared:
            fused.append((menus.executors[-1][1].stage, compiled.holds_graphs))
    assert len(fused) >= 3 and all(stage is fused[0][0] for stage, _ in fused)
    assert not all(holds for _, holds in fused)  # (where no block option is its own: no graph of its own)
    picks_fused = [c.plan.chain.stage_actions()[-1].endswith("[fused_head]") for c in module._planned.values()]
    assert all(picks_fused), picks_fused
