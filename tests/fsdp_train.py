"""Train a tiny Llama-style model with hierremat under FSDP2 (torchrun), or plainly on one process.

Used by tests/test_fsdp.py. ``--fsdp``: hierremat plans the whole model first, then
``fully_shard`` is applied to every decoder layer and to the model, and each rank trains on
its share of every global batch; the first call re-plans for the shards. Without it, one
process trains plainly on the whole global batches. Both write the final parameters
(rank 0) and a report per rank (peaks, budget, plan, all-gather counts) to ``--out``.
Peaks are CPU-allocator peaks (FSDP2 frees gathered parameters by resizing storages,
which the live-tensor tracker does not see), or the CUDA allocator's on ``--device cuda``.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hierremat as hr  # noqa: E402
from hierremat.runtime import CudaPeakMeter  # noqa: E402
from hierremat.runtime.memory import CpuAllocatorMeter  # noqa: E402

from models import tiny_llama  # noqa: E402


def new_model(device: torch.device):
    torch.manual_seed(0)
    return tiny_llama(n_layer=3, hidden_size=64).to(device)


def shard(model) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def meter(device: torch.device):
    return CpuAllocatorMeter() if device.type == "cpu" else CudaPeakMeter(device)


def plain_fsdp_peak(ids, device: torch.device) -> tuple[int, str | None]:
    """The peak of a steady step of the same model under FSDP2 alone (no hierremat), and what
    hierremat says when asked to plan a model that is already sharded."""
    model = new_model(device)
    shard(model)
    peaks = []
    for _ in range(2):  # the second step has its (sharded) gradients allocated, as in training
        with meter(device) as m:
            model(input_ids=ids, labels=ids).loss.backward()
        peaks.append(m.peak_bytes)
        for p in model.parameters():
            p.grad.zero_()
    try:  # the wrong order: hierremat plans the whole model before fully_shard
        hr.remat(model, (), {"input_ids": ids, "labels": ids}, budget="1GiB")
        refusal = None
    except hr.UnsupportedModelError as err:
        refusal = str(err)
    return peaks[-1], refusal


def count_all_gathers(module, ids) -> dict[str, int]:
    """How often FSDP2 all-gathers each module's parameters in one more step (its profiler labels)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        module(input_ids=ids, labels=ids).loss.backward()
    counts: dict[str, int] = {}
    for event in prof.events():
        if event.name.startswith("FSDP::all_gather (") and event.name.endswith(")"):
            name = event.name[len("FSDP::all_gather ("):-1]
            counts[name] = counts.get(name, 0) + 1
    return counts


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--budget", default="3.3MiB", help="every rank's budget (FSDP2's gathered parameters included)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device(args.device)
    if args.fsdp:
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl")
    model = new_model(device)
    batches = [torch.randint(0, 256, (8, 96), device=device) for _ in range(args.steps)]
    local = [b[rank * len(b) // world : (rank + 1) * len(b) // world] for b in batches]
    report = {"world": world}
    runner = model
    if args.fsdp:
        report["plain_fsdp_peak"], report["sharded_first"] = plain_fsdp_peak(local[0], device)
        ids = local[0]
        runner = hr.remat(model, (), {"input_ids": ids, "labels": ids}, budget=args.budget)  # plan first
        shard(model)  # then shard: the first call re-plans for FSDP2
        report["budget"] = hr.parse_budget(args.budget)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    peaks = []
    for ids in local if args.fsdp else batches:
        optimizer.zero_grad(set_to_none=False)
        with meter(device) as m:
            runner(input_ids=ids, labels=ids).loss.backward()
        peaks.append(m.peak_bytes)
        optimizer.step()
    report["peaks"] = peaks
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for k, v in model.state_dict().items()}
    if args.fsdp:
        report["plan"] = runner.plans[0].to_json()
        report["summary"] = runner.plans[0].summary()
        report["all_gathers"] = count_all_gathers(runner, local[0])
    args.out.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        torch.save(state, args.out / "params.pt")
    (args.out / f"report{rank}.json").write_text(json.dumps(report))
    if args.fsdp:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
