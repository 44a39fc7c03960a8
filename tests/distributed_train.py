"""Train a tiny model with hierremat on several ranks (torchrun: FSDP2 or DDP), or plainly on one process.

Used by tests/test_distributed.py. ``--model llama`` (a tiny Llama-style decoder) or ``t5`` (a tiny
T5: every decoder layer reads the encoder's output and the position biases, residents whose
gradients hierremat sums across the stages that read them). ``--parallel fsdp``: hierremat
plans the whole model first, then ``fully_shard`` is applied to every encoder/decoder layer
and to the model, and each rank trains on its share of every global batch; the first call
re-plans for the shards. ``--parallel ddp``: the planned model is wrapped in
DistributedDataParallel. Without ``--parallel``, one process trains plainly on the whole
global batches. ``--autocast bf16``: every forward, and the planning, under bf16 autocast.
``--meta`` (FSDP2): torchtitan's order, the model built on meta, planned there, sharded, then
materialized (``to_empty``) and given ``new_model``'s weights. ``--lengths 96,64,80``: the Llama's steps take those sequence lengths in turn (a new length is planned
on each rank when it first comes; under FSDP2, after ``fully_shard``: without its weights, then for the shards). ``--set-to-none``: every step starts with PyTorch's default ``zero_grad(set_to_none=True)``, so
it allocates the gradients (counted in the budget); else ``.grad`` is kept between steps.
Both write the final parameters and the first step's gradients (rank 0; with ``--parallel``
also those of the first step of FSDP2 or DDP alone on the same batches) and a report per rank (peaks,
budget, plan, all-gather counts, the peak of FSDP2 or DDP alone) to ``--out``. Peaks are CPU-allocator peaks (FSDP2 frees
gathered parameters by resizing storages, which the live-tensor tracker does not see), or
the CUDA allocator's on ``--device cuda``.
"""

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hierremat as hr  # noqa: E402
from hierremat.device import CudaPeakMeter  # noqa: E402
from hierremat.device.memory import CpuAllocatorMeter  # noqa: E402

from models import seq2seq_call, tiny_llama, tiny_t5  # noqa: E402


def new_model(name: str, device: torch.device):
    torch.manual_seed(0)
    # no dropout in the T5: the ranks' halves of a batch draw other masks than one process's whole batch
    model = tiny_llama(n_layer=3, hidden_size=64) if name == "llama" else tiny_t5(layers=2, d_model=64, dropout=0.0)
    return model.to(device)


def materialize(model, name: str, device: torch.device) -> None:
    """A model built on meta and sharded: ``to_empty``, then the weights ``new_model`` gives (its whole state
    dict set into the shards; the buffers outside it, Llama's rotary frequencies, copied)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    reference = new_model(name, device)
    model.to_empty(device=device)
    set_model_state_dict(model, reference.state_dict(), options=StateDictOptions(full_state_dict=True))
    with torch.no_grad():
        for buffer_name, buffer in reference.named_buffers():
            model.get_buffer(buffer_name).copy_(buffer)


def layers(model) -> list:
    if hasattr(model, "encoder"):  # T5
        return [*model.encoder.block, *model.decoder.block]
    return list(model.model.layers)


def shard(model) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in layers(model):
        fully_shard(layer)
    fully_shard(model)


def global_batches(name: str, steps: int, device: torch.device, lengths: list[int] | None = None) -> list[dict]:
    """Each step's global batch of 8 (keyword arguments of the model's call); a Llama's of the sequence
    lengths ``lengths`` in turn (default 96)."""
    if name == "llama":
        lengths = lengths or [96]
        generator = torch.Generator().manual_seed(1)  # (not the global RNG: a model built on meta draws nothing)
        ids = [torch.randint(0, 256, (8, lengths[step % len(lengths)]), generator=generator).to(device)
               for step in range(steps)]
        return [{"input_ids": i, "labels": i} for i in ids]
    return [{k: v.to(device) for k, v in seq2seq_call(8, 48, 24, seed=step).items()} for step in range(steps)]


def meter(device: torch.device):
    return CpuAllocatorMeter() if device.type == "cpu" else CudaPeakMeter(device)


def forward_context(device: torch.device, autocast: str):
    """The context every forward (and every planning call) runs in: bf16 autocast, or none."""
    if autocast == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def full_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, whole (a collective under FSDP2: every rank calls it)."""
    return {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().cpu().clone()
            for name, p in model.named_parameters()}


def plain_run(name: str, parallel: str, batches: list[dict], device: torch.device, autocast: str
              ) -> tuple[int, str | None, dict]:
    """The same model under FSDP2 or DDP alone (no hierremat), trained on ``batches`` without
    optimizer steps: (the peak of the last step, for FSDP2 what hierremat says when asked to plan
    a model that is already sharded, the gradients of the first step)."""
    model = new_model(name, device)
    if parallel == "fsdp":
        shard(model)
        runner = model
    else:
        runner = torch.nn.parallel.DistributedDataParallel(model)
    first_grads = None
    for batch in batches:
        with meter(device) as m:
            with forward_context(device, autocast):
                loss = runner(**batch).loss
            loss.backward()
            del loss
        first_grads = first_grads if first_grads is not None else full_grads(model)
        for p in model.parameters():
            p.grad.zero_()
    if parallel != "fsdp":
        return m.peak_bytes, None, first_grads
    try:  # the wrong order: hierremat plans the whole model before fully_shard
        hr.remat(model, (), batches[0], budget="1GiB")
        refusal = None
    except hr.UnsupportedModelError as err:
        refusal = str(err)
    return m.peak_bytes, refusal, first_grads


def count_all_gathers(module, batch: dict, context) -> dict[str, int]:
    """How often FSDP2 all-gathers each module's parameters in one more step (its profiler labels)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with context:
            loss = module(**batch).loss
        loss.backward()
    counts: dict[str, int] = {}
    for event in prof.events():
        if event.name.startswith("FSDP::all_gather (") and event.name.endswith(")"):
            name = event.name[len("FSDP::all_gather ("):-1]
            counts[name] = counts.get(name, 0) + 1
    return counts


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=("llama", "t5"), default="llama")
    p.add_argument("--parallel", choices=("fsdp", "ddp"), default=None)
    p.add_argument("--budget", default="3.3MiB", help="every rank's budget (FSDP2's gathered parameters included)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--autocast", choices=("off", "bf16"), default="off", help="bf16: forwards and planning under autocast")
    p.add_argument("--set-to-none", action="store_true",
                   help="zero_grad(set_to_none=True), PyTorch's default: every step allocates the gradients")
    p.add_argument("--steps", type=int, default=3, help="the last is a steady step: DDP rebuilds its buckets in the second")
    p.add_argument("--meta", action="store_true",
                   help="with --parallel fsdp: build on meta, plan (device=), shard, to_empty, then load the weights")
    p.add_argument("--lengths", default=None,
                   help="comma-separated sequence lengths the Llama's steps take in turn (each rank plans each new one)")
    p.add_argument("--offload", action="store_true",
                   help="plan with offload=True (a disk tier), its transfers priced free so that the plans offload")
    p.add_argument("--block-options", default="ilp", choices=("ilp", "autograd"),
                   help="hierremat's block_options (autograd: no ILP menus, whose solves a loaded machine may cut short)")
    p.add_argument("--uneven", action="store_true",
                   help="rank 1's batches after the first 8 tokens shorter (with FSDP2, hierremat raises on every rank)")
    p.add_argument("--refuse", action="store_true",
                   help="with --parallel fsdp: on_new_shape='error', and rank 1 forgets its plans after the first "
                        "step, as if evicted (hierremat raises on every rank at the next)")
    p.add_argument("--upcast-outputs", action="store_true",
                   help="after fully_shard, the forward wrapped as accelerate's mixed precision wraps it (its bf16 outputs "
                        "copied to fp32: accelerate.utils.convert_outputs_to_fp32), as accelerator.prepare does")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device(args.device)
    if args.parallel:
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl")
    meta = args.meta and args.parallel == "fsdp"
    if meta:  # torchtitan's order: built on meta, planned, sharded, then materialized and initialized
        with torch.device("meta"):
            model = new_model(args.model, torch.device("meta"))
    else:
        model = new_model(args.model, device)
    lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else None
    batches = global_batches(args.model, args.steps, device, lengths)
    local = [{k: v[rank * len(v) // world : (rank + 1) * len(v) // world] for k, v in b.items()} for b in batches]
    if args.uneven and rank == 1:
        local = local[:1] + [{k: v[:, :-8] for k, v in b.items()} for b in local[1:]]
    report = {"world": world}
    runner = model
    plain_grads = None
    if args.parallel:
        report["plain_peak"], report["sharded_first"], plain_grads = plain_run(
            args.model, args.parallel, local, device, args.autocast)
    if args.offload:  # every rank's tier (the one remat finds for offload=True) with free transfers
        from hierremat.plans.costs import TierBandwidth
        from hierremat.runtime.offload import second_tier

        second_tier(True, None, device, None).bandwidth = TierBandwidth("disk", 1e12, 1e12)
    with forward_context(device, args.autocast):  # plans are made for the autocast setting they run under
        if args.parallel == "fsdp":
            runner = hr.remat(model, (), local[0], budget=args.budget, device=device if meta else None,
                              settings=hr.Settings(offload=args.offload, block_options=args.block_options, on_new_shape="error" if args.refuse else "replan"))
        elif args.parallel == "ddp":  # rank 0 plans, every rank runs its plan (as examples/gpt2/finetune.py)
            box = [hr.plan(model, (), local[0], budget=args.budget,
                           settings=hr.Settings(offload=args.offload, block_options=args.block_options)).to_json() if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            runner = hr.remat(model, (), local[0], plan=hr.ModelPlan.from_json(box[0]))
    if args.parallel:
        report["budget"] = hr.parse_budget(args.budget)
    if args.parallel == "fsdp":
        shard(model)  # then shard: the first call re-plans for FSDP2
        if meta:
            materialize(model, args.model, device)
    elif args.parallel == "ddp":
        runner = torch.nn.parallel.DistributedDataParallel(runner)
    if args.upcast_outputs:
        from accelerate.utils import convert_outputs_to_fp32

        runner.forward = convert_outputs_to_fp32(runner.forward)
    if not args.set_to_none:  # .grad allocated before the first step and kept: not part of any step's budget
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    peaks, first_grads = [], None
    for step, batch in enumerate(local if args.parallel else batches):
        if args.refuse and rank == 1 and step == 1:
            runner._drop_plans()
        optimizer.zero_grad(set_to_none=args.set_to_none)
        with meter(device) as m:
            with forward_context(device, args.autocast):
                loss = runner(**batch).loss
            loss.backward()
            del loss
        peaks.append(m.peak_bytes)
        first_grads = first_grads if first_grads is not None else full_grads(model)
        optimizer.step()
    report["peaks"] = peaks
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for k, v in model.state_dict().items()}
    if args.parallel:
        remat = runner.module if args.parallel == "ddp" else runner
        report["plan"] = remat.plans[-1].to_json()  # the plan of the shape used last (rank 0's, broadcast), counted below
        report["summary"] = remat.plans[-1].summary()
        report["plans"] = len(remat.plans)
        report["all_plans"] = [plan.to_json() for plan in remat.plans]  # (every shape's: each rank must run rank 0's)
        report["gathered"] = [list(plan.gathered_stage_bytes or ()) for plan in remat.plans]
    if args.parallel == "fsdp":  # (the .grad state of the steps above: the plan reported is the one counted)
        optimizer.zero_grad(set_to_none=args.set_to_none)
        report["all_gathers"] = count_all_gathers(runner, local[-1], forward_context(device, args.autocast))
    args.out.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        torch.save(state, args.out / "params.pt")
        torch.save(first_grads, args.out / "grads.pt")
        if plain_grads is not None:
            torch.save(plain_grads, args.out / "plain_grads.pt")
    (args.out / f"report{rank}.json").write_text(json.dumps(report))
    if args.parallel:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
