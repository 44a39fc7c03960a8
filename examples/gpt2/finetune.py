"""Fine-tune a Hugging Face GPT-2 on a text file under a memory budget with hierremat.

    python examples/gpt2/finetune.py                         # tiny random GPT-2, shipped text, CPU
    python examples/gpt2/finetune.py --budget-fraction 0.4   # 40% of the no-remat peak
    python examples/gpt2/finetune.py --model ./gpt2 --budget 3GiB --dtype bf16 --device cuda
    torchrun --standalone --nproc_per_node 2 examples/gpt2/finetune.py   # DDP: gloo on CPU, nccl on CUDA

Without ``--model`` a GPT-2 of ``--size`` (tiny, small, medium) is built with random
weights and text is tokenized byte by byte; with ``--model PATH`` weights and tokenizer are
loaded offline from a local directory. Nothing is downloaded.

The budget counts what one training step creates (activations, recomputed tensors,
gradients in flight, and the parameter gradients it allocates: the loop calls PyTorch's
default ``optimizer.zero_grad()``, which sets them to None), not parameters or optimizer state.
``--budget-fraction`` measures plain autograd's peak in a probe step and takes a fraction
of it. At the end the script prints the plan, the measured peak against the budget, the
step time against plain autograd and the validation loss, and writes the model, a JSON
report and a PNG (loss curve; predicted and measured memory during one step) to ``--out``.

Under ``torchrun`` (WORLD_SIZE > 1) the model is wrapped in DistributedDataParallel:
``--batch`` is per rank, each rank trains on its own slice of the global batch of
``--batch`` x WORLD_SIZE sequences (so N ranks with ``--batch b`` see the same data as one
process with ``--batch N*b``), rank 0 plans and broadcasts the plan to the other ranks,
and only rank 0 prints and writes ``--out``. With dropout active every rank draws its own
masks (seed + rank), which one process with the whole batch would not draw the same way;
``--dropout 0`` makes N ranks and one process train the same weights (up to float
rounding).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import hierremat as hr
from hierremat.device import LiveTensorTracker, memory_meter
from hierremat.plans.schedule import FAll, FCk, FNone

HERE = Path(__file__).resolve().parent
SIZES = {
    "tiny": dict(n_layer=4, n_embd=128, n_head=4),
    "small": dict(n_layer=12, n_embd=768, n_head=12),
    "medium": dict(n_layer=24, n_embd=1024, n_head=16),
}
log = logging.getLogger("finetune")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="local directory with a pretrained GPT-2 (from_pretrained, offline)")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny", help="random-init size without --model")
    p.add_argument("--data", type=Path, default=HERE / "data" / "public_domain.txt")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-4)
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--budget", help="bytes or '2GiB'; 'auto' on CUDA: free memory after weights and optimizer")
    budget.add_argument("--budget-fraction", type=float, default=0.5, help="fraction of plain autograd's peak")
    budget.add_argument("--no-remat", action="store_true", help="plain autograd (the baseline)")
    p.add_argument("--no-variants", action="store_true",
                   help="plan without hierremat's operator variants (the row-blocked cross-entropy, packed dropout masks)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: autocast")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=Path("runs/gpt2"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dropout", type=float, help="set GPT-2's dropouts (resid, embd, attn); default: the config's")
    return p.parse_args(argv)


class ByteTokenizer:
    """Fallback tokenizer: one token per UTF-8 byte (vocabulary 256)."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def dropouts(args) -> dict:
    return {} if args.dropout is None else dict.fromkeys(("resid_pdrop", "embd_pdrop", "attn_pdrop"), args.dropout)


def load_model_and_tokenizer(args):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if args.model:
        from transformers import AutoTokenizer

        model = GPT2LMHeadModel.from_pretrained(args.model, local_files_only=True, **dropouts(args))
        tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        return model, tokenizer
    config = GPT2Config(
        vocab_size=ByteTokenizer.vocab_size, n_positions=max(args.seq_len, 128), bos_token_id=0, eos_token_id=0,
        **SIZES[args.size], **dropouts(args),
    )
    return GPT2LMHeadModel(config), ByteTokenizer()


def load_data(path: Path, tokenizer, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences of seq_len tokens, 90% train / 10% validation."""
    ids = torch.tensor(tokenizer.encode(path.read_text(encoding="utf-8")), dtype=torch.long)
    n = len(ids) // seq_len
    if n < 2:
        raise SystemExit(f"--data {path} has {len(ids)} tokens: too short for two sequences of --seq-len {seq_len}")
    seqs = ids[: n * seq_len].view(n, seq_len)
    n_val = max(1, n // 10)
    return seqs[n_val:], seqs[:n_val]


def batches(data: torch.Tensor, batch: int, generator: torch.Generator):
    while True:
        order = torch.randperm(len(data), generator=generator)
        for i in range(0, len(order) - batch + 1, batch):
            yield data[order[i : i + batch]]


def train_step(module, batch, dtype, device) -> torch.Tensor:
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
        loss = module(batch, labels=batch, use_cache=False).loss
    loss.backward()
    return loss.detach()


def measure_step(module, batch, args, device, timeline: bool = False):
    """Peak bytes of one step (tracker on CPU, allocator on CUDA), and the tracker's timeline."""
    meter = LiveTensorTracker(record_timeline=True) if timeline and device.type == "cpu" else memory_meter(device)
    with meter:
        loss = train_step(module, batch, args.dtype, device)
    return loss, meter.peak_bytes, getattr(meter, "timeline", [])


def resolve_budget(args, model, batch, device, optimizer) -> int | None:
    if args.no_remat:
        return None
    if args.budget == "auto":
        if device.type != "cuda":
            raise SystemExit("--budget auto needs CUDA; give bytes (e.g. --budget 2GiB) or --budget-fraction")
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    if args.budget:
        return hr.parse_budget(args.budget)
    _, plain_peak, _ = measure_step(model, batch, args, device)
    optimizer.zero_grad()
    return int(plain_peak * args.budget_fraction)


def step_seconds(module, batch, args, device, optimizer) -> float:
    """Seconds of one training step (no optimizer step: the weights do not change)."""
    t0 = time.perf_counter()
    train_step(module, batch, args.dtype, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    optimizer.zero_grad()
    return seconds


def interleaved_step_seconds(modules, batch, args, device, optimizer, rounds: int = 5) -> list[float]:
    """Median step seconds of each of ``modules``, timed in turn round after round (a busy machine's slow
    moments fall on every one alike), after one untimed step each."""
    samples = [[] for _ in modules]
    for r in range(rounds + 1):
        for module, times in zip(modules, samples):
            seconds = step_seconds(module, batch, args, device, optimizer)
            if r:
                times.append(seconds)
    return [statistics.median(times) for times in samples]


def recomputed_forwards(plan) -> tuple[int, int]:
    """(forwards of stages the schedule runs beyond one each, stages)."""
    schedule = plan.chain.schedule
    forwards = sum(isinstance(op, (FNone, FCk, FAll)) for op in schedule.ops)
    return forwards - schedule.length, schedule.length


class Distributed:
    """Rank and world size; a process group when launched by torchrun with WORLD_SIZE > 1."""

    def __init__(self, device: torch.device):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0")) if self.world > 1 else 0
        self.device = device
        if self.world > 1:
            if device.type == "cuda":
                self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                torch.cuda.set_device(self.device)
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a global batch (all of it in one process)."""
        per_rank = len(batch) // self.world
        return batch[self.rank * per_rank : (self.rank + 1) * per_rank]

    def mean(self, *values: float) -> list[float]:
        """Mean of each value over the ranks."""
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return (t / self.world).tolist()

    def broadcast(self, value):
        """Rank 0's value (any picklable object) on every rank."""
        if not self.enabled:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


@torch.no_grad()
def validation_loss(model, data: torch.Tensor, batch: int, ddp: Distributed | None = None) -> float:
    """Mean loss over the validation chunks; under DDP each rank takes every world-th chunk."""
    rank, world = (ddp.rank, ddp.world) if ddp else (0, 1)
    model.eval()
    losses = [model(chunk, labels=chunk, use_cache=False).loss.item() for chunk in data.split(batch)[rank::world]]
    model.train()
    total, count = sum(losses), len(losses)
    if ddp and ddp.enabled:
        total, count = (v * world for v in ddp.mean(total, count))
    return total / count


def plot(path: Path, losses: list[float], predicted: list[tuple[float, int]], measured: list[tuple[float, int]], budget):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(range(1, len(losses) + 1), losses)
    ax1.set(xlabel="step", ylabel="training loss", title="Loss")
    if predicted:
        ax2.step(*zip(*[(x, y / 2**20) for x, y in predicted]), where="post", label="predicted (simulator)")
    if measured:
        ax2.plot(*zip(*[(x, y / 2**20) for x, y in measured]), label="measured (live tensors)", alpha=0.7)
    if budget:
        ax2.axhline(budget / 2**20, color="red", linestyle="--", label="budget")
    ax2.set(xlabel="fraction of one step", ylabel="MiB", title="Memory during one step")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    ddp = Distributed(torch.device(args.device))
    try:
        return run(args, ddp)
    finally:
        ddp.close()


def run(args, ddp: Distributed) -> dict:
    logging.basicConfig(level=logging.INFO if ddp.main else logging.WARNING, format="%(message)s")
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    device = ddp.device
    model, tokenizer = load_model_and_tokenizer(args)
    model.to(device).train()
    if ddp.enabled:
        torch.manual_seed(args.seed + ddp.rank)  # dropout: each rank its own masks
    train, val = load_data(args.data, tokenizer, args.seq_len)
    global_batch = args.batch * ddp.world
    if len(train) < global_batch:
        raise SystemExit(f"--batch {args.batch} x {ddp.world} ranks is larger than the {len(train)} training sequences")
    # Every rank draws the same global batches (same generator seed) and keeps its slice.
    stream = map(ddp.shard, batches(train, global_batch, torch.Generator().manual_seed(args.seed)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    probe = next(stream).to(device)

    # Rank 0 measures and plans; the other ranks take its plan: profiled timings differ from
    # process to process, and ranks running different schedules would be harder to reason about.
    budget = None
    if ddp.main:
        budget = resolve_budget(args, model, probe, device, optimizer)
    module, plan = model, None
    if not args.no_remat:
        example = ((probe,), {"labels": probe, "use_cache": False})
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            if ddp.main:
                # (train_step closes the autocast context before backward: planned for that from the start;
                # under DDP rank 0's plan is every rank's, so its block options are built before it is sent,
                # not once they pay)
                module = hr.remat(model, *example, budget=budget,
                                  settings=hr.Settings(variants=not args.no_variants, backward_autocast=False, defer_block_options=not ddp.enabled))
                plan = module.plans[0]
            plan_json = ddp.broadcast(plan.to_json() if ddp.main else None)
            if not ddp.main:
                plan = hr.ModelPlan.from_json(plan_json)
                module = hr.remat(model, *example, plan=plan)
                budget = plan.budget_bytes
        if ddp.main:
            print(plan.summary(), "\n")
    planned_module = module
    if ddp.enabled:
        # DDP's defaults: hierremat backpropagates stage by stage, and a parameter two stages read
        # (GPT-2's tied embedding and LM head) still reaches DDP's reducer once per step
        # (hierremat.runtime.tied).
        module = DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)

    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional
        def tqdm(iterable, **_):
            return iterable

    losses, peak, timeline = [], 0, []
    progress = tqdm(range(args.steps), desc="train", unit="step", disable=not ddp.main)
    for step in progress:
        started = time.perf_counter()
        total = 0.0
        for micro in range(args.accum):
            # Under DDP every micro-step all-reduces (no no_sync()): simple, and still exact.
            batch = next(stream).to(device)
            measured = ddp.main and step == 0 and micro == 0
            if measured:
                loss, peak, timeline = measure_step(module, batch, args, device, timeline=True)
            else:
                loss = train_step(module, batch, args.dtype, device)
            total += loss.item() / args.accum
        optimizer.step()
        optimizer.zero_grad()  # PyTorch's default (set_to_none=True): each step allocates .grad, within the budget
        (total,) = ddp.mean(total)
        losses.append(total)
        if hasattr(progress, "set_postfix"):
            progress.set_postfix(loss=f"{total:.3f}", step_s=f"{time.perf_counter() - started:.2f}",
                                 peak=hr.format_bytes(peak))
        if not math.isfinite(total):
            raise SystemExit(f"loss is {total} at step {step}")

    plain_seconds = remat_seconds = None
    if ddp.main:  # (after training: the plan has settled, solved again from its steps' times)
        plain_seconds, remat_seconds = interleaved_step_seconds([model, planned_module], probe, args, device, optimizer)
    val_loss = validation_loss(model, val.to(device), args.batch, ddp)
    report = {
        "budget_bytes": budget,
        "measured_peak_bytes": peak,
        "predicted_peak_bytes": plan.predicted_peak_bytes if plan else None,
        "within_budget": budget is None or peak <= budget,
        "step_seconds": remat_seconds,
        "plain_step_seconds": plain_seconds,
        "train_losses": losses,
        "validation_loss": val_loss,
        "device": str(device),
        "world_size": ddp.world,
        "global_batch": global_batch,
    }
    if ddp.main:
        write_outputs(args, model, plan, report, timeline)
    return report


def write_outputs(args, model, plan, report: dict, timeline) -> None:
    budget, peak = report["budget_bytes"], report["measured_peak_bytes"]
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out / "model")
    predicted_timeline = []
    if plan:
        events = plan.chain.simulate().timeline
        offset = plan.beside_chain_bytes + plan.chain.reserved_bytes
        predicted_timeline = [(i / len(events), e.peak_bytes + offset) for i, e in enumerate(events)]
    measured_timeline = [(i / max(1, len(timeline)), b) for i, (_, b) in enumerate(timeline)]
    plot(args.out / "report.png", report["train_losses"], predicted_timeline, measured_timeline, budget)
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    if plan:
        (args.out / "plan.json").write_text(plan.to_json())
    change = report["step_seconds"] / report["plain_step_seconds"] - 1
    why = ""
    if plan and change > 0:
        extra, stages = recomputed_forwards(plan)
        why = f": it runs {extra} stage forwards more than the {stages} stages to fit the budget"
    log.info(
        "measured peak %s %s budget %s (predicted %s); step %.3f s vs %.3f s plain autograd (%+.0f%%, timed "
        "interleaved after training%s); validation loss %.4f; wrote %s",
        hr.format_bytes(peak), "<=" if report["within_budget"] else "ABOVE", hr.format_bytes(budget or 0),
        hr.format_bytes(report["predicted_peak_bytes"] or 0), report["step_seconds"], report["plain_step_seconds"],
        100 * change, why, report["validation_loss"], args.out,
    )


if __name__ == "__main__":
    main()
