"""What ``torch.compile`` buys and costs on a remat'd model (GPT-2 on CPU, one run, side by side).

Methods, all on the same model, batch and seed:
  - plain: eager autograd, no checkpointing;
  - plain compiled: ``torch.compile(model)`` (Inductor), no checkpointing;
  - hierremat: ``hr.remat(model, budget=B)`` run eagerly;
  - hierremat compiled: ``torch.compile(hr.remat(model, budget=B))``: Dynamo compiles the code
    around hierremat's two graph breaks (planning, the chain runner), the chain runs eagerly;
  - hierremat compile=True: ``hr.remat(model, budget=B, compile=True)``: block options also
    offered compiled by Inductor, chosen with their measured compiled costs (hierremat.planning.compiled).
B is 0.6x plain's live-tensor peak. Reported per method: the median step time over
interleaved rounds and its ratio to plain; the first call's seconds (compile and/or plan);
the CPU allocator's peak (torch.profiler memory events: it sees compiled code's buffers,
which the live-tensor tracker cannot) and its ratio to plain's; stage forwards per step,
a deterministic cost (from the plan; 1 per stage without recomputation); the largest
gradient difference to eager hierremat's (plain: to eager plain's).
Usage: python benchmarks/bench_compile.py [--layers 4] [--width 256] [--seq 128] [--rounds 7]
Writes benchmarks/results/bench_compile.md.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import common as C
import hierremat as hr
from hierremat.device import LiveTensorTracker

RESULTS = C.RESULTS_DIR / "bench_compile.md"


def build(args):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=4, vocab_size=50257, n_positions=1024)
    return GPT2LMHeadModel(config).train(), torch.randint(0, 50257, (args.batch, args.seq))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    device = torch.device("cpu")
    model, ids = build(args)

    def step_of(module):
        def step():
            torch.manual_seed(1)
            module(ids, labels=ids).loss.backward()
        return step

    with LiveTensorTracker() as tracker:
        step_of(model)()
    budget = int(0.6 * tracker.peak_bytes)
    methods = {}
    for name, make in (
        ("plain", lambda: copy.deepcopy(model)),
        ("plain compiled", lambda: torch.compile(copy.deepcopy(model))),
        # (the plans with their block options built, timed: defer_block_options=False)
        ("hierremat", lambda: hr.remat(copy.deepcopy(model), (ids,), {"labels": ids}, budget=f"{budget}B",
                                       settings=hr.Settings(defer_block_options=False))),
        ("hierremat compiled", lambda: torch.compile(hr.remat(copy.deepcopy(model), (ids,), {"labels": ids},
                                                              budget=f"{budget}B", settings=hr.Settings(defer_block_options=False)))),
        ("hierremat compile=True", lambda: hr.remat(copy.deepcopy(model), (ids,), {"labels": ids}, budget=f"{budget}B",
                                                    settings=hr.Settings(compile=True))),
    ):
        started = time.perf_counter()
        module = make()
        params = C.params_of(module)
        C.zero_grads(params)
        step_of(module)()  # the first call: Dynamo/Inductor compile, hierremat's plan already made
        methods[name] = {"module": module, "params": params, "first_s": time.perf_counter() - started, "times": []}
    for name, m in methods.items():
        C.zero_grads(m["params"])
        step_of(m["module"])()
        m["grads"] = C.grads_of(m["params"])
        m["alloc"] = C.allocator_peak_bytes(step_of(m["module"]))
        remat = m["module"]._orig_mod if hasattr(m["module"], "_orig_mod") else m["module"]
        m["forwards"] = sum(remat.plans[0].chain.schedule.forward_counts()) if hasattr(remat, "plans") else None

    def run(name, _round):
        m = methods[name]
        m["times"].append(C.timed_step(step_of(m["module"]), m["params"], device))

    C.interleave(list(methods), args.rounds, seed=0, run=run)
    plain = methods["plain"]
    stages = args.layers + 2
    rows = []
    for name, m in methods.items():
        reference = methods["hierremat" if name.startswith("hierremat") else "plain"]["grads"]
        t = C.median(m["times"])
        rows.append([
            name, f"{t:.3f}", f"{t / C.median(plain['times']):.3f}", f"{m['first_s']:.1f}",
            f"{m['alloc'] / C.MIB:.2f}", f"{m['alloc'] / plain['alloc']:.3f}", str(m["forwards"] or stages),
            f"{C.max_abs_diff(m['grads'], reference):.1e}",
        ])
    header = ["method", "step s", "time / plain", "first call s", "alloc peak MiB", "peak / plain", "fwd", "grad diff"]
    table = C.markdown_table(header, rows)
    info = C.device_info(device, torch.get_num_threads())
    text = (
        f"# torch.compile and hierremat\n\nGPT-2 {args.layers} layers, {args.width} wide, batch {args.batch}, seq "
        f"{args.seq}, fp32, CPU ({info['device_name']}, {info['torch_threads']} threads), budget {C.fmt(budget / C.MIB)} MiB (0.6x plain's live-tensor "
        f"peak), {args.rounds} interleaved rounds; hierremat {C.library_revision()}.\n\n{table}\n"
    )
    C.write_results(RESULTS, text)


if __name__ == "__main__":
    main()
