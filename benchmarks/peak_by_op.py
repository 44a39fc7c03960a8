"""Where the CUDA allocator's peak departs from the plan's prediction, op by op (the bf16 overshoot).

A diagnosis, not a comparison: GPT-2 (bench_offload's model, 12 layers, batch 2 x 512 by default), outputs="loss",
bf16 autocast (fp32 with --fp32), on CUDA. At the smallest feasible budget and at keeping everything, each op of the
schedule with the simulator's chain bytes (before it, its peak, after it: hierremat.plans.simulate) beside the
allocator's (``torch.cuda.memory_allocated`` and its peak, relative to the step's start, read around the runner's
per-op method), then the blocks live at the allocator's highest point of the step grouped by their allocating
frames (``torch.cuda.memory._record_memory_history``).

    python benchmarks/peak_by_op.py [--fp32] [--batch 2 --seq 512]

Prints Markdown; the H200 run of 2026-11-27 is benchmarks/results/peak_by_op_cuda_bf16.md.
"""
import argparse
import collections
import sys

import torch

sys.path.insert(0, "benchmarks")
import common as C  # noqa: E402
import hierremat as hr  # noqa: E402
from bench_offload import SEED, _gpt2  # noqa: E402
from hierremat.runtime import executor  # noqa: E402

MIB = 2**20
parser = argparse.ArgumentParser()
parser.add_argument("--fp32", action="store_true")
parser.add_argument("--batch", type=int, default=2)
parser.add_argument("--seq", type=int, default=512)
args = parser.parse_args()
bf16 = not args.fp32
dev = torch.device("cuda")
model = _gpt2(12).to(dev)
params = C.params_of(model)
ids = torch.randint(0, 50257, (args.batch, args.seq), generator=torch.Generator().manual_seed(SEED)).to(dev)
kwargs = {"labels": ids, "use_cache": False}
C.zero_grads(params)
records = []
original = executor._Step._execute


def recorded(self, op, index):
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    original(self, op, index)
    records.append((index, op, before, torch.cuda.max_memory_allocated(dev), torch.cuda.memory_allocated(dev)))


executor._Step._execute = recorded
with C.step_autocast(dev, bf16):
    explorer = hr.explore(model, (ids,), kwargs, outputs="loss", settings=hr.Settings(backward_autocast=False))
    floor = explorer.smallest_feasible(offload=False)
for label, budget in (("floor", floor), ("keeping everything", explorer.keep_all_bytes)):
    with C.step_autocast(dev, bf16):
        plan = explorer.plan(budget, offload=False)
        module = hr.remat(model, (ids,), kwargs, plan=plan)

    def go():
        with C.step_autocast(dev, bf16):
            loss = module(ids, **kwargs).loss
        loss.backward()

    go()
    C.zero_grads(params)
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.memory._record_memory_history(max_entries=400000, stacks="python")
    records.clear()
    torch.cuda.reset_peak_memory_stats(dev)
    go()
    torch.cuda.synchronize(dev)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    step_peak = max(r[3] for r in records) - base if records else 0
    print(f"\n## {label}: budget {budget / MIB:.2f} MiB, predicted peak {plan.predicted_peak_bytes / MIB:.2f} MiB, "
          f"allocator's peak over the chain's ops {step_peak / MIB:.2f} MiB ({step_peak / budget:.4f}x budget)")
    print(plan.summary().split("\n  stage")[0])
    events = {e.op_index: e for e in plan.chain.simulate().timeline}
    print("\n| op | predicted before | peak | after | alloc before | peak | after | peak - predicted |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for index, op, before, peak, after in records:
        event = events[index]
        print(f"| {index} {op} | {event.before_bytes / MIB:.2f} | {event.peak_bytes / MIB:.2f} | {event.after_bytes / MIB:.2f}"
              f" | {(before - base) / MIB:.2f} | {(peak - base) / MIB:.2f} | {(after - base) / MIB:.2f}"
              f" | {(peak - base - event.peak_bytes) / MIB:+.2f} |")
    # the live blocks at the allocator's highest point during the step, by allocating frame
    live, used, best, best_live = {}, 0, 0, {}
    for trace in snapshot["device_traces"]:
        for e in trace:
            if e["action"] == "alloc":
                live[e["addr"]] = e
                used += e["size"]
                if used > best:
                    best, best_live = used, dict(live)
            elif e["action"] in ("free_requested",) and e["addr"] in live:
                used -= live.pop(e["addr"])["size"]
    groups = collections.Counter()
    for e in best_live.values():
        frames = [f for f in e.get("frames", []) if "hierremat" in f["filename"] or "transformers" in f["filename"]]
        where = " < ".join(f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in frames[:3]) or "?"
        groups[where] += e["size"]
    print(f"\nlive at the traced peak ({best / MIB:.2f} MiB above the step's start), by allocating frame:")
    for where, size in groups.most_common(25):
        print(f"  {size / MIB:9.2f} MiB  {where}")
