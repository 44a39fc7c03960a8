"""Whole-graph ILP: concatenated block graphs, and the plan-quality benchmark that uses them."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from hierremat.plans.block_graph import BACKWARD, FORWARD, concatenate
from hierremat.ilp import BlockIlp

from test_ilp import transformer_block


def test_concatenated_blocks_form_one_graph_with_the_same_costs():
    g = transformer_block(seq=16, d=8)
    assert g.input_grad_name
    c = concatenate([g, g, g])
    assert len(c.nodes) == 3 * len(g.nodes)
    assert [n.phase for n in c.nodes] == [FORWARD] * (3 * len(g.forward_nodes)) + [BACKWARD] * (3 * len(g.backward_nodes))
    # block 1 reads block 0's output where it read its input; block 0's backward reads block 1's input gradient
    readers = [n for n in c.forward_nodes if n.name.startswith("b1.") and f"b0.{g.output_name}" in n.inputs]
    assert readers and not any(g.input_name in n.inputs for n in c.nodes if n.name.startswith("b1."))
    grad_readers = [n for n in c.backward_nodes if n.name.startswith("b0.") and f"b1.{g.input_grad_name}" in n.inputs]
    assert grad_readers
    assert c.output_name == f"b2.{g.output_name}" and c.input_grad_name == f"b0.{g.input_grad_name}"
    assert sum(n.time for n in c.nodes) == pytest.approx(3 * sum(n.time for n in g.nodes))
    # with no budget the whole-graph optimum recomputes nothing: three blocks' worth of time
    res = BlockIlp(c).solve()
    assert res.has_solution and res.objective == pytest.approx(3 * sum(n.time for n in g.nodes), rel=1e-9)


def test_concatenate_rejects_what_it_cannot_chain():
    g = transformer_block(seq=16, d=8)
    with pytest.raises(ValueError, match="at least one graph"):
        concatenate([])
    no_dx = dataclasses.replace(g, input_grad_name="")
    with pytest.raises(ValueError, match="block 1 has no input gradient"):
        concatenate([g, no_dx])


def _bench_quality():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_quality

    return bench_quality


def test_concatenated_readers_pass_each_residents_gradient_sum_on_and_cost_what_the_chain_counts():
    """Blocks reading a value made before them (an encoder's output) with a gradient: in the
    concatenation each block's seed reader also reads the later block's sum, which is thereby no
    longer held; the whole graph holds the first block's. Keeping everything, the whole graph's
    peak is the chain's (the DP counting the sum as a resident made before the chain)."""
    from hierremat.blocks.joint import to_block_graph, trace_joint
    from hierremat.runtime.node_profile import profile_nodes
    from hierremat.dp.solve import solve_chain
    from hierremat.ilp.options import keep_all_decisions, make_option
    from hierremat.plans.simulate import simulate

    from test_resident_options import _Reader

    bench_quality = _bench_quality()
    torch.manual_seed(0)
    x, context = torch.randn(4, 8, 16), torch.randn(4, 8, 16)
    graphs = []
    for block in (_Reader(), _Reader(), _Reader()):
        joint = trace_joint(block, x, (context,), input_requires_grad=True, resident_grads=(0,))
        graphs.append(to_block_graph(joint, profile_nodes(joint, x, (context,), method="flops")))
    g = graphs[0]
    assert len(g.seed_readers) == len(g.held_grad_names) == 1
    whole = concatenate(graphs)
    for i in (0, 1):
        reader = whole.node(f"b{i}.{g.seed_readers[0]}")
        assert f"b{i + 1}.{g.held_grad_names[0]}" in reader.inputs
    assert whole.held_grad_names == (f"b0.{g.held_grad_names[0]}",) and whole.seed_readers == (f"b2.{g.seed_readers[0]}",)

    def keep_all(graph):
        ilp = BlockIlp(graph)
        return [make_option(ilp.structure, keep_all_decisions(ilp.structure), "keep_all", optimal=False)]

    grad_bytes = context.numel() * context.element_size()
    chain = bench_quality.chain_of(graphs, [bench_quality.stage_costs(b, keep_all(b)) for b in graphs], (grad_bytes,))
    one = bench_quality.chain_of([whole], [bench_quality.stage_costs(whole, keep_all(whole))])
    peaks = [simulate(c, solve_chain(c, 10**9).schedule).peak_bytes for c in (chain, one)]
    assert peaks[0] == peaks[1]
    with pytest.raises(ValueError, match="same residents"):
        concatenate([graphs[0], transformer_block(seq=16, d=8)])


@pytest.mark.parametrize("model", ["gpt2", pytest.param("t5", marks=pytest.mark.slow)])
def test_bench_quality_runs_and_the_hierarchical_plan_is_never_worse_than_the_baselines(tmp_path, model):
    pytest.importorskip("transformers")
    bench_quality = _bench_quality()

    out = tmp_path / "quality.md"
    size = ["--n-embd", "64", "--seq", "32"] if model == "gpt2" else ["--t5-d-model", "64"]
    assert bench_quality.main(["--models", model, *size, "--budgets", "3", "--out", str(out)]) == 0
    text = out.read_text()
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| ") and "MiB" not in line
            and line[2].isdigit()]
    assert len(rows) == 3
    for cells in rows:
        rotor_over_hier, segments_over_hier = cells[6].strip(), cells[7].strip()
        for ratio in (rotor_over_hier, segments_over_hier):
            assert ratio == "" or float(ratio) >= 1.0
    assert "| hierarchical |" in text and "| whole-graph ILP |" in text
