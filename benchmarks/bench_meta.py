"""Planning a model larger than this machine's memory, built on meta (CPU, one process).

A Llama-7B-shaped model (32 layers, 4096 wide, MLP 11008, 32 heads, vocabulary 32000, fp32: 27 GB of
parameters, more than this 24 GB machine holds) is built under ``torch.device("meta")`` and planned at
batch 1 with ``hierremat.plan(..., device="cpu")``: captured on meta, each distinct stage profiled on
one lent copy of its weights (hierremat.runtime.lent_weights), the identical decoder layers run and
solved once. Reported: planning seconds (capture, profile, block options, DP), the process's peak RSS
against the parameters' bytes, the bytes lent, and each stage's predicted costs (the plan's summary).

A smaller Llama (8 layers, 1024 wide, MLP 2752, vocabulary 32000) is planned both ways, on meta and
materialized, at the same budget: what each stage's memory costs (the same to the byte), the schedules,
predicted peaks and times side by side; then the module planned on meta is materialized with the other's
weights and trains a step: gradients against plain autograd's, the tracker's peak against the budget.

    python benchmarks/bench_meta.py [--seq 512] [--layers 32] [--budget 27GiB]

Writes benchmarks/results/bench_meta.md.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

import common as C
import hierremat as hr
from hierremat.device import LiveTensorTracker

RESULTS = C.RESULTS_DIR / "bench_meta.md"
FIGURES = ("kept_bytes", "fwd_overhead_bytes", "bwd_overhead_bytes", "bwd_overhead_new_grads_bytes")


def _llama(layers: int, hidden: int, mlp: int, heads: int, vocab: int = 32000):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=4096)
    return LlamaForCausalLM(config)


def _rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _big(args) -> str:
    with torch.device("meta"):
        model = _llama(args.layers, 4096, 11008, 32)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(0, 32000, (1, args.seq))
    rss_before = _rss_peak_bytes()
    started = time.perf_counter()
    plan = hr.plan(model, (ids,), {"labels": ids}, budget=args.budget, device="cpu", settings=hr.Settings(cache=False))
    seconds = time.perf_counter() - started
    rss = _rss_peak_bytes()
    table = C.markdown_table(
        ["what", "value"],
        [["layers x width x MLP, vocabulary", f"{args.layers} x 4096 x 11008, 32000"],
         ["batch x sequence", f"1 x {args.seq}"],
         ["parameters (fp32)", f"{param_bytes / 2**30:.1f} GiB"],
         ["planning s (whole hr.plan call)", C.fmt(seconds, ".1f")],
         ["weights lent while planning", f"{plan.lent_weight_bytes / 2**30:.2f} GiB"],
         ["process peak RSS", f"{rss / 2**30:.2f} GiB (before planning {rss_before / 2**30:.2f} GiB)"],
         ["predicted peak / budget", f"{plan.predicted_peak_bytes / 2**30:.2f} / {plan.budget_bytes / 2**30:.2f} GiB"]],
    )
    return f"{table}\n\n```\n{plan.summary()}\n```"


def _menu_widths(args) -> str:
    """A decoder layer's ILP menu at 256 and at 4096 wide (the same graph, other sizes): solved afresh at each
    width (the in-process menus forgotten first), then at 4096 re-costed from the 256-wide menu as planning
    does for a block solved before at other sizes; beside the whole block-options phase, which also times
    the graph's nodes on the lent weights."""
    from hierremat.session import current_session

    rows = []
    for hidden, mlp, fresh in ((256, 688, True), (4096, 11008, True), (4096, 11008, False)):
        if fresh:
            current_session().solved_menus.clear()
        else:  # the 256-wide menu solved last
            _plan_llama_layer(256, 688, args.seq)
        plan = _plan_llama_layer(hidden, mlp, args.seq)
        menu = plan.menus[plan.stages[1].signature]
        rows.append([f"{hidden} x {mlp}", "solved" if fresh else "re-costed from 256 x 688",
                     str(len(menu["graph"]["nodes"])), str(len(menu["options"])), str(plan.options_solves),
                     C.fmt(menu["solve_seconds"], ".2f"), C.fmt(plan.options_seconds, ".1f"),
                     menu.get("coarse") or "ILP sweep"])
    return (f"A Llama decoder layer's block options (2 layers planned on meta, batch 1 x {args.seq}): the same graph "
            "at two widths\n\n" + C.markdown_table(
                ["width x MLP", "menu", "graph nodes", "options", "ILP solves (all menus)", "layer's ILP sweep s",
                 "block options s (incl. node times)", "options from"], rows))


def _plan_llama_layer(hidden: int, mlp: int, seq: int):
    with torch.device("meta"):
        model = _llama(2, hidden, mlp, hidden // 128)
    ids = torch.randint(0, 32000, (1, seq))
    return hr.plan(model, (ids,), {"labels": ids}, budget="64GiB", device="cpu", settings=hr.Settings(cache=False))


def _twins(args) -> str:
    def make():
        return _llama(8, 1024, 2752, 16)

    torch.manual_seed(0)
    real = make()
    with torch.device("meta"):
        meta = make()
    ids = torch.randint(0, 32000, (1, args.seq))
    module = hr.remat(meta, (ids,), {"labels": ids}, budget=args.small_budget, device="cpu",
                      settings=hr.Settings(cache=False, defer_block_options=False))  # (planned in full, as hr.plan plans the materialized twin)
    plans = {
        "materialized": hr.plan(real, (ids,), {"labels": ids}, budget=args.small_budget,
                                settings=hr.Settings(cache=False)),
        "meta": module.plans[0],
    }
    bitwise, tracker = _train_materialized(module, meta, real, ids)
    a, b = plans["materialized"].chain.costs, plans["meta"].chain.costs
    same_memory = a.activation_bytes == b.activation_bytes and all(
        [getattr(x.options[0], f) for f in FIGURES] == [getattr(y.options[0], f) for f in FIGURES]
        for x, y in zip(a.stages, b.stages)
    )
    rows = [[name, C.fmt(p.predicted_peak_bytes / C.MIB, ".1f"), C.fmt(p.predicted_step_time * 1e3, ".0f"),
             C.fmt(p.predicted_step_time / plans["materialized"].predicted_step_time, ".3f"), str(p.chain.schedule)]
            for name, p in plans.items()]
    table = C.markdown_table(["planned", "predicted MiB", "predicted ms", "x materialized", "schedule"], rows)
    return (f"Llama 8 layers x 1024 (MLP 2752, vocabulary 32000), batch 1 x {args.seq}, budget {args.small_budget}: "
            f"every stage's autograd memory figures equal on meta and materialized: {same_memory}. The module planned "
            f"on meta, materialized (to_empty, the materialized twin's weights) and trained one step: gradients "
            f"bitwise plain autograd's: {bitwise}; live-tensor tracker peak {tracker / C.MIB:.1f} MiB against the "
            f"prediction {module.plans[0].predicted_peak_bytes / C.MIB:.1f} MiB and the budget "
            f"{hr.parse_budget(args.small_budget) / C.MIB:.1f} MiB\n\n{table}")


def _train_materialized(module, meta, real, ids) -> tuple[bool, int]:
    """Materialize ``meta`` with ``real``'s weights, train one step through ``module`` and one plainly on
    ``real``: (gradients bitwise equal, the tracker's peak of a second step through ``module``)."""
    meta.to_empty(device="cpu")
    meta.load_state_dict(real.state_dict())
    with torch.no_grad():
        for name, buffer in real.named_buffers():  # (the rotary frequencies, outside the state dict)
            meta.get_buffer(name).copy_(buffer)
    for m, runner in ((meta, module), (real, real)):
        for p_ in m.parameters():
            p_.grad = None
        runner(ids, labels=ids).loss.backward()
    bitwise = all(torch.equal(a.grad, b.grad) for a, b in zip(meta.parameters(), real.parameters()))
    for p_ in meta.parameters():
        p_.grad = None
    with LiveTensorTracker() as tracker:
        module(ids, labels=ids).loss.backward()
    return bitwise, tracker.peak_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--budget", default="27GiB", help="the 7B-shaped model's budget: its fp32 gradients (25.1 GiB, made in the step with PyTorch's default zero_grad) and activations")
    p.add_argument("--small-budget", default="1GiB", help="the 8-layer twins' budget")
    args = p.parse_args()
    started = time.perf_counter()
    info = C.device_info(torch.device("cpu"), torch.get_num_threads())
    body = "\n\n".join([_big(args), _menu_widths(args), _twins(args)])
    text = (f"# bench_meta\n\n{', '.join(f'{k} {v}' for k, v in info.items())}\n\n"
            f"`python benchmarks/bench_meta.py --seq {args.seq} --layers {args.layers} --budget {args.budget}` "
            f"({time.perf_counter() - started:.0f} s)\n\n{body}\n")
    C.write_results(RESULTS, text)
    print(text)


if __name__ == "__main__":
    main()
