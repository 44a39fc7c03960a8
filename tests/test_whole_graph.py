"""Whole-graph ILP: concatenated block graphs, and the plan-quality benchmark that uses them."""

import dataclasses
import sys
from pathlib import Path

import pytest

from hierremat.block_graph import BACKWARD, FORWARD, concatenate
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


def test_bench_quality_runs_and_the_hierarchical_plan_is_never_worse_than_the_baselines(tmp_path):
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_quality

    out = tmp_path / "quality.md"
    assert bench_quality.main(["--n-embd", "64", "--seq", "32", "--budgets", "3", "--out", str(out)]) == 0
    text = out.read_text()
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| ") and "MiB" not in line
            and line[2].isdigit()]
    assert len(rows) == 3
    for cells in rows:
        rotor_over_hier, segments_over_hier = cells[6].strip(), cells[7].strip()
        for ratio in (rotor_over_hier, segments_over_hier):
            assert ratio == "" or float(ratio) >= 1.0
    assert "| hierarchical |" in text and "| whole-graph ILP |" in text
