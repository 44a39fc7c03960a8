"""Plan quality under one cost model: hierarchical vs whole-graph ILP vs Rotor-on-blocks vs uniform segments.

    python benchmarks/bench_quality.py                 # GPT-2 (2 layers) and T5 (3+3 layers), < 5 min
    python benchmarks/bench_quality.py --layers 4 --budgets 8 --models gpt2

What is compared. A chain of identical blocks, every block's joint forward+backward ATen graph captured
(AOTAutograd) and costed by a deterministic FLOP/byte model (``hierremat.runtime.node_profile``, method
"flops"), so every planner below sees exactly the same node costs and the comparison is of *plans*, not
of timing noise:

- **gpt2**: the decoder blocks of a Hugging Face GPT-2 (random init, dropout on);
- **t5**: the decoder layers of a Hugging Face T5 after its first (random init, dropout on, a padded
  batch): each reads the encoder's output and the position bias with a gradient (residents made
  before this chain, hierremat.plans.costs.ResidentCosts with producer -1), and adds its terms to their
  gradient sums, which the chain DP counts from the last layer's backward on.

The planners:

- **hierarchical** (hierremat): each distinct block solved by its ILP into a menu of options
  (``hierremat.ilp.options.solve_menu``), the menus composed by the Rotor chain DP;
- **whole-graph ILP** (Checkmate on the full graph): ONE ILP over the concatenated graph of all
  blocks (``hierremat.plans.block_graph.concatenate``, which routes each block's resident gradient sum
  into the block before it), its menu plus targeted solves at each budget (peak budget = the
  budget, retained bytes free; each solve limited to ``--whole-time-limit`` seconds: a stopped
  solve keeps its incumbent), composed by the same DP (one stage);
- **Rotor on blocks**: the chain DP with only the keep-everything option per block (plus its
  checkpoint / recompute-the-whole-block moves);
- **uniform segments**: torch's ``checkpoint_sequential`` schedule for every segment count, the
  fastest one that fits each budget.

Budgets: from the smallest feasible budget of the hierarchical plan to the keep-everything peak.
All times and peaks are the planners' predictions under the shared cost model (the simulator
reproduces them exactly; see tests). What precedes and follows the blocks (embeddings, the head
and loss, T5's encoder) is the same for every planner and is left out. Prints one Markdown table
per model and writes them with ``--out`` (default benchmarks/results/bench_quality.md).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from hierremat.plans.block_graph import BlockGraph, concatenate  # noqa: E402
from hierremat.blocks.capture import capture  # noqa: E402
from hierremat.blocks.hf import call_kwargs  # noqa: E402
from hierremat.blocks.joint import to_block_graph, trace_joint  # noqa: E402
from hierremat.runtime.node_profile import profile_nodes  # noqa: E402
from hierremat.blocks.segment import build_chain_graph  # noqa: E402
from hierremat.plans.costs import ChainCosts, ResidentCosts, StageCosts  # noqa: E402
from hierremat.dp.baselines import uniform_segments_schedule  # noqa: E402
from hierremat.dp.solve import min_peak_schedule, solve_chain  # noqa: E402
from hierremat.errors import InfeasibleBudgetError  # noqa: E402
from hierremat.ilp.options import keep_all_decisions, make_option, solve_menu  # noqa: E402
from hierremat.ilp.solve import BlockIlp  # noqa: E402
from hierremat.plans.simulate import simulate  # noqa: E402
from hierremat.planning.stage_calls import resident_positions, stage_arguments, stage_inputs  # noqa: E402
from hierremat.api.planned_shape import chain_inputs  # noqa: E402

SLOTS = 2000


def gpt2_block_graphs(n_layer: int, n_embd: int, seq: int, batch: int) -> list[BlockGraph]:
    """The BlockGraph of each decoder block of a random-init GPT-2, costed by the FLOP model."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=512, n_positions=max(seq, 128))
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    kwargs = {"labels": ids, "use_cache": False}
    chain = build_chain_graph(capture(model, (ids,), kwargs), model)
    x0, shared = chain_inputs(chain, (ids,), kwargs)
    shared = tuple(shared)
    xs = stage_inputs(chain.stages, x0, shared)
    graphs = []
    for info, stage, x in zip(chain.infos, chain.stages, xs):
        if not info.name.startswith("transformer.h."):
            continue
        joint = trace_joint(stage, x, shared, input_requires_grad=True)
        graphs.append(to_block_graph(joint, profile_nodes(joint, x, shared, method="flops")))
    return graphs


def t5_block_graphs(layers: int, d_model: int, batch: int, source: int, target: int
                    ) -> tuple[list[BlockGraph], tuple[int, ...]]:
    """The BlockGraph of each decoder layer after the first of a random-init T5 (a padded batch),
    costed by the FLOP model, and the bytes of the gradient of each resident they read (the
    encoder output, the position bias). The first layer makes the position bias: it is left out,
    so that the blocks share one signature and the residents come from before the chain."""
    from transformers import T5Config, T5ForConditionalGeneration
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    config = T5Config(vocab_size=256, d_model=d_model, d_kv=d_model // 4, d_ff=2 * d_model, num_layers=layers,
                      num_decoder_layers=layers, num_heads=4, decoder_start_token_id=0, pad_token_id=0)
    model = T5ForConditionalGeneration(config).train()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (batch, source), generator=generator)
    mask = torch.ones_like(ids)
    mask[-1, source * 3 // 4:] = 0  # padding, as a collator gives it
    kwargs = call_kwargs(model, {"input_ids": ids, "attention_mask": mask,
                                 "labels": torch.randint(3, 256, (batch, target), generator=generator)})
    chain = build_chain_graph(capture(model, (), kwargs), model)
    x0, shared = chain_inputs(chain, (), kwargs)
    xs, shareds = stage_arguments(chain.stages, x0, tuple(shared), chain.residents)
    graphs, grad_bytes = [], None
    for i, (info, stage) in enumerate(zip(chain.infos, chain.stages)):
        if not info.name.startswith("decoder.block.") or info.name == "decoder.block.0":
            continue
        reads = resident_positions(chain.residents, i, shareds[i])
        joint = trace_joint(stage, xs[i], shareds[i], input_requires_grad=True, resident_grads=reads)
        graphs.append(to_block_graph(joint, profile_nodes(joint, xs[i], shareds[i], method="flops")))
        grad_bytes = tuple(shareds[i][j].numel() * shareds[i][j].element_size() for j in reads)
    return graphs, grad_bytes


def nograd_forward(graph: BlockGraph) -> tuple[float, int]:
    """Time and peak (above the input) of the block's forward without grad: every value freed after
    its last forward use, the output kept."""
    forward = graph.forward_nodes
    root = {}
    for n in forward:
        root[n.name] = root.get(n.alias_of, n.alias_of) if n.alias_of else n.name
    last_use = {}
    for i, n in enumerate(forward):
        for a in n.inputs:
            last_use[root.get(a, a)] = i
    keep = root.get(graph.output_name, graph.output_name)
    live, peak = 0, 0
    for i, n in enumerate(forward):
        peak = max(peak, live + n.out_bytes + n.workspace_bytes)
        live += n.out_bytes
        for a in set(root.get(a, a) for a in n.inputs):
            if last_use.get(a) == i and a != keep and a in root:
                live -= graph.node(a).out_bytes
        if n.name not in last_use and n.name != keep and root[n.name] == n.name:
            live -= n.out_bytes
    return sum(n.time for n in forward), peak


def stage_costs(graph: BlockGraph, options) -> StageCosts:
    t, overhead = nograd_forward(graph)
    return StageCosts(nograd_fwd_time=t, nograd_fwd_overhead_bytes=overhead,
                      options=tuple(o.to_option_costs() for o in options))


def chain_of(graphs: list[BlockGraph], stages: list[StageCosts], resident_grads: tuple[int, ...] = ()) -> ChainCosts:
    """The chain of ``graphs``; resident_grads: bytes of the gradient of each value made before the
    chain that every block reads (its sum held from the last block's backward to the end)."""
    sizes = (graphs[0].input_bytes,) + tuple(g.output_grad_bytes for g in graphs)
    readers = tuple(range(len(graphs)))
    residents = tuple(ResidentCosts(-1, readers, 0, g) for g in resident_grads)
    return ChainCosts(sizes, tuple(stages), input_requires_grad=True, residents=residents)


def fastest(costs: ChainCosts, budget: int) -> tuple[float, int] | None:
    try:
        s = solve_chain(costs, budget, slots=SLOTS).schedule
    except InfeasibleBudgetError:
        return None
    sim = simulate(costs, s)
    return sim.time, sim.peak_bytes


def compare(graphs: list[BlockGraph], resident_grads: tuple[int, ...], n_budgets: int, whole_time_limit: float
            ) -> tuple[list[str], dict]:
    """Plan ``graphs`` (one signature) with every planner at ``n_budgets`` budgets: (Markdown lines,
    figures by name: the largest hierarchical/whole and Rotor/hierarchical time ratios)."""
    t0 = time.perf_counter()
    block_ilp = BlockIlp(graphs[0])
    menu = solve_menu(graphs[0], ilp=block_ilp)  # the blocks share one signature: one menu
    hier = chain_of(graphs, [stage_costs(g, menu.options) for g in graphs], resident_grads)
    keep_all = [make_option(block_ilp.structure, keep_all_decisions(block_ilp.structure), "keep_all", optimal=False)]
    rotor = chain_of(graphs, [stage_costs(g, keep_all) for g in graphs], resident_grads)
    hier_seconds = time.perf_counter() - t0

    t1 = time.perf_counter()
    whole = concatenate(graphs)
    whole_ilp = BlockIlp(whole)
    whole_menu = list(solve_menu(whole, ilp=whole_ilp).options)
    whole_seconds = time.perf_counter() - t1

    segment_plans = [simulate(rotor, uniform_segments_schedule(rotor, k)) for k in range(1, len(graphs) + 1)]
    lo = min_peak_schedule(hier).predicted_peak_bytes
    hi = segment_plans[0].peak_bytes  # keeping everything
    budgets = [int(lo + (hi - lo) * k / max(1, n_budgets - 1)) for k in range(n_budgets)]
    mins = {
        "hierarchical": lo,
        "Rotor on blocks": min_peak_schedule(rotor).predicted_peak_bytes,
        "uniform segments": min(p.peak_bytes for p in segment_plans),
    }

    rows, unproven = [], 0
    for b in budgets:
        t2 = time.perf_counter()
        for peak in (b, b - whole.input_bytes):  # targeted solves at this budget, retained bytes free
            res = whole_ilp.solve(peak=peak, time_limit=whole_time_limit)
            if res.has_solution:
                unproven += not res.optimal
                whole_menu.append(make_option(whole_ilp.structure, res.decisions, f"whole_peak{peak}",
                                              optimal=res.optimal, ev=res.evaluation, peak_budget=peak))
        whole_seconds += time.perf_counter() - t2
        whole_chain = chain_of([whole], [stage_costs(whole, whole_menu)])
        seg = [(p.time, p.peak_bytes) for p in segment_plans if p.peak_bytes <= b]
        rows.append((b, fastest(hier, b), fastest(whole_chain, b), fastest(rotor, b), min(seg) if seg else None))
    mins["whole-graph ILP"] = min_peak_schedule(chain_of([whole], [stage_costs(whole, whole_menu)])).predicted_peak_bytes

    def cell(r):
        return "infeasible" if r is None else f"{r[0] * 1e3:.3f}"

    def ratio(r, ref):
        return "" if r is None or ref is None else f"{r[0] / ref[0]:.4f}"

    lines = [
        "| budget MiB | hierarchical | whole-graph ILP | Rotor on blocks | uniform segments | hier / whole | "
        "Rotor / hier | segments / hier |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b, h, w, r, sg in rows:
        lines.append(f"| {b / 2**20:.3f} | {cell(h)} | {cell(w)} | {cell(r)} | {cell(sg)} | {ratio(h, w)} | "
                     f"{ratio(r, h)} | {ratio(sg, h)} |")
    lines += ["", "| planner | smallest feasible budget MiB |", "|---|---:|"]
    lines += [f"| {k} | {v / 2**20:.3f} |" for k, v in mins.items()]
    lines += ["", f"Planning: hierarchical {hier_seconds:.1f} s (capture, one block menu of {len(menu.options)} "
              f"options, {menu.n_solves} solves); whole-graph ILP {whole_seconds:.1f} s "
              f"({whole_ilp.model.n_vars} variables, {whole_ilp.model.n_constraints} constraints; "
              f"{unproven} of its {2 * len(budgets)} targeted solves stopped by their {whole_time_limit:.0f} s limit "
              "with an incumbent)."]
    figures = {
        "hier/whole": max((h[0] / w[0] for _, h, w, _, _ in rows if h and w), default=None),
        "rotor/hier": min((r[0] / h[0] for _, h, _, r, _ in rows if h and r), default=None),
    }
    return lines, figures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=("gpt2", "t5"), default=["gpt2", "t5"])
    ap.add_argument("--layers", type=int, default=2, help="GPT-2's decoder blocks")
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--t5-layers", type=int, default=3, help="T5's encoder and decoder layers each")
    ap.add_argument("--t5-d-model", type=int, default=128)
    ap.add_argument("--budgets", type=int, default=5)
    ap.add_argument("--whole-time-limit", type=float, default=30.0, help="seconds per whole-graph ILP solve")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "bench_quality.md")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)

    sections = []
    for name in args.models:
        if name == "gpt2":
            graphs, resident_grads = gpt2_block_graphs(args.layers, args.n_embd, args.seq, args.batch), ()
            title = (f"GPT-2 decoder blocks: n_layer={args.layers}, n_embd={args.n_embd}, n_head=4, batch {args.batch}, "
                     f"seq {args.seq}, fp32, dropout 0.1")
        else:
            graphs, resident_grads = t5_block_graphs(args.t5_layers, args.t5_d_model, args.batch, 64, 32)
            title = (f"T5 decoder layers 1..{args.t5_layers - 1} of a {args.t5_layers}+{args.t5_layers}-layer T5: "
                     f"d_model={args.t5_d_model}, batch {args.batch}, source 64, target 32 (padded), fp32, dropout 0.1; "
                     f"each reads {len(resident_grads)} residents with a gradient")
        lines, figures = compare(graphs, resident_grads, args.budgets, args.whole_time_limit)
        sections += [f"## {name}", "", title + "; FLOP cost model (same node costs for every planner). Times in ms "
                     "(predicted forward+backward of the blocks); ratios to the whole-graph ILP.", "", *lines, ""]
        log_figures = ", ".join(f"{k} {v:.4f}" for k, v in figures.items() if v is not None)
        print(f"{name}: {log_figures}", file=sys.stderr)
    report = "\n".join(sections)
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("# bench_quality\n\nCommand: `python benchmarks/bench_quality.py "
                        + " ".join(argv if argv is not None else sys.argv[1:]) + "`\n\n" + report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
