"""Offloading on a GPU (the last target): hierremat with ``offload=True`` against the offloading people
hand-pick today, side by side in one run, at Hugging Face checkpointing's memory and at half of it.

Model: GPT-2 (random weights, dropout 0.1, nothing downloaded; ``--layers``/``--width``/``--batch``/``--seq``),
called the Hugging Face way (``model(ids, labels=ids, use_cache=False).loss.backward()``), fp32 or
``--bf16`` autocast. Methods, each on its own copy of the same weights:
  plain          eager autograd;
  hf             HF gradient checkpointing (``gradient_checkpointing_enable``: each layer recomputed);
  unsloth-style  offloaded checkpointing as Unsloth does it: each layer's input copied to pinned host memory
                 in the forward (non-blocking), brought back in its backward and the layer recomputed (RNG
                 replayed), written here in the same way (Unsloth itself is not installed);
  save_on_cpu    every saved activation to pinned host memory (``torch.autograd.graph.save_on_cpu``); torchtune's
                 ``OffloadActivations`` where torchtune is installed (the same idea, with side-stream copies);
  hierremat      ``hierremat.remat`` at HF checkpointing's measured peak and at half of it, ``offload=True`` and
                 without (the plan decides what to keep, recompute or offload).
Peak: the bytes created during one step (``torch.cuda.max_memory_allocated`` delta on CUDA, the live-tensor
tracker on CPU), after a warm-up step; reserved (CUDA): ``max_memory_reserved`` above what the caching
allocator held after ``empty_cache``, the memory the card must really have; time: median of ``--rounds``
interleaved rounds; grad diff: max |grad - plain's| after one step from the same weights and seed. hierremat's
plan summaries follow the table.

    python benchmarks/bench_offload_gpu.py [--device cuda] [--layers 12 --width 768 --batch 8 --seq 1024]

On CPU (``--device cpu``, the default when there is no GPU) it runs as a smoke test of the methods; the
numbers that count are a GPU's. Writes benchmarks/results/bench_offload_gpu_<device>.md.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import logging
import time
from dataclasses import dataclass, field

import torch

import common as C
import hierremat as hr

SEED = 1234


def _gpt2(layers: int, width: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(SEED)
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64), vocab_size=50257,
                        n_positions=2048, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).train()


class _OffloadedCheckpoint(torch.autograd.Function):
    """Unsloth-style offloaded checkpointing of one layer: its input goes to pinned host memory in the forward
    (the layer runs without grad), comes back in the backward, and the layer is recomputed there."""

    @staticmethod
    def forward(ctx, run, hidden, *args):
        ctx.run, ctx.args, ctx.device = run, args, hidden.device
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(hidden.device) if hidden.is_cuda else None
        kind = hidden.device.type  # (the recomputation runs under the forward's autocast, as torch.utils.checkpoint's)
        ctx.autocast = (kind, torch.get_autocast_dtype(kind), torch.is_autocast_enabled(kind))
        pinned = hidden.is_cuda
        ctx.saved = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=pinned)
        ctx.saved.copy_(hidden, non_blocking=pinned)
        with torch.no_grad():
            return run(hidden, *args)

    @staticmethod
    def backward(ctx, grad):
        hidden = ctx.saved.to(ctx.device, non_blocking=True).requires_grad_()
        devices = [ctx.device] if ctx.cuda_rng is not None else []
        kind, dtype, enabled = ctx.autocast
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), torch.autocast(kind, dtype, enabled):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, ctx.device)
            out = ctx.run(hidden, *ctx.args)
        torch.autograd.backward(out, grad)
        return (None, hidden.grad, *([None] * len(ctx.args)))


def _offloaded_checkpoint(run, hidden, *args):
    return _OffloadedCheckpoint.apply(run, hidden, *args)


def _unsloth_style(model):
    from transformers.modeling_layers import GradientCheckpointingLayer

    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module.gradient_checkpointing = True
            module._gradient_checkpointing_func = _offloaded_checkpoint
    return model


def _save_on_cpu_context(device: torch.device):
    """torchtune's OffloadActivations where installed, else torch's save_on_cpu (pinned on CUDA); its name."""
    try:
        from torchtune.training import OffloadActivations

        return OffloadActivations, "torchtune OffloadActivations"
    except ImportError:
        return (lambda: torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")), "save_on_cpu"


def _peaks(step, device: torch.device) -> tuple[int, int | None]:
    """The step's allocated peak (C.peak_bytes) and, on CUDA, its reserved peak: the caching allocator's
    segments above what it held after ``empty_cache`` (what the device must really have free)."""
    if device.type != "cuda":
        return C.peak_bytes(step, device), None
    gc.collect()
    torch.cuda.empty_cache()
    reserved_before = torch.cuda.memory_reserved(device)
    peak = C.peak_bytes(step, device)  # (resets the peak statistics, reserved included, before the step)
    return peak, torch.cuda.max_memory_reserved(device) - reserved_before


@dataclass
class Method:
    name: str
    model: torch.nn.Module
    module: torch.nn.Module
    context: object = None  # a callable returning a context manager around the step, or None
    budget: int | None = None
    plan: object = None
    times: list[float] = field(default_factory=list)
    peak: int = 0
    reserved: int | None = None
    grads: list | None = None


def run(args) -> str:
    device = torch.device(args.device)
    base = _gpt2(args.layers, args.width).to(device)
    ids = torch.randint(0, 50257, (args.batch, args.seq), generator=torch.Generator().manual_seed(SEED)).to(device)
    kwargs = {"labels": ids, "use_cache": False}

    def copy_of():
        model = copy.deepcopy(base)
        C.zero_grads(C.params_of(model))
        return model

    plain = copy_of()
    hf = copy_of()
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    unsloth = _unsloth_style(copy_of())
    offload_model = copy_of()
    offload_context, offload_name = _save_on_cpu_context(device)
    methods = [Method("plain autograd", plain, plain), Method("HF checkpointing", hf, hf),
               Method("unsloth-style offloaded checkpointing", unsloth, unsloth),
               Method(offload_name, offload_model, offload_model, offload_context)]

    def step(method: Method):
        def go():
            with (method.context() if method.context else contextlib.nullcontext()), \
                    C.step_autocast(device, args.bf16):
                loss = method.module(ids, **kwargs).loss
            loss.backward()
        return go

    def measure(method: Method) -> None:
        step(method)()
        C.zero_grads(C.params_of(method.model))
        method.peak, method.reserved = _peaks(step(method), device)

    for method in methods:  # the peaks of the baselines (HF's sets the budgets)
        measure(method)
    hf_peak = methods[1].peak
    infeasible = []
    for label, budget in (("at HF's memory", hf_peak), ("at half HF's memory", hf_peak // 2)):
        for offload in (False, True):
            model = copy_of()
            try:
                with C.step_autocast(device, args.bf16):
                    module = hr.remat(model, (ids,), kwargs, budget=budget, outputs=args.outputs,
                                      settings=hr.Settings(offload=offload, backward_autocast=False, defer_block_options=False))  # (the steps' backward runs after autocast closed)
            except hr.InfeasibleBudgetError as err:
                infeasible.append(f"hierremat {label}, offload={offload}: {budget / C.MIB:.2f} MiB is below its "
                                  f"smallest feasible budget, {err.min_budget_bytes / C.MIB:.2f} MiB")
                continue
            method = Method(f"hierremat {label}" + (", offload=True" if offload else ""), model, module, budget=budget)
            method.plan = module.plans[-1]
            measure(method)
            methods.append(method)
    for method in methods:  # gradients after one step from the same weights and seed
        C.zero_grads(C.params_of(method.model))
        torch.manual_seed(SEED)
        step(method)()
        method.grads = C.grads_of(C.params_of(method.model))
    C.interleave(methods, args.rounds, SEED, lambda m, _r: m.times.append(
        C.timed_step(step(m), C.params_of(m.model), device)))
    plain_time = C.median(methods[0].times)
    rows = []
    for m in methods:
        offloaded = m.plan.chain.offload_line().split(";")[0] if m.plan is not None and m.plan.chain.offloads else ""
        rows.append([
            m.name, C.fmt(m.budget / C.MIB if m.budget else None), C.fmt(m.peak / C.MIB),
            C.fmt(m.peak / methods[0].peak, ".3f"),
            C.fmt(m.reserved / C.MIB if m.reserved is not None else None),
            C.fmt(m.reserved / m.budget if m.reserved is not None and m.budget else None, ".3f"),
            C.fmt(C.median(m.times), ".3f"),
            C.fmt(C.median(m.times) / plain_time, ".2f"), f"{C.max_abs_diff(m.grads, methods[0].grads):.1e}",
            offloaded,
        ])
    table = C.markdown_table(["method", "budget MiB", "peak MiB", "peak / plain", "reserved MiB", "reserved / budget",
                              "step s", "time / plain",
                              "grad diff vs plain", "hierremat offloads"], rows)
    plans = "".join(f"\n\n{m.name}'s plan:\n\n```\n{m.plan.summary()}\n```" for m in methods if m.plan is not None)
    return table + "".join(f"\n- {line}" for line in infeasible) + plans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--outputs", default=None, help="hierremat's outputs= ('loss': its LM head fused with the loss, "
                        "the logits never whole; default: the model's outputs, as the baselines compute them)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    started = time.perf_counter()
    text = run(args)
    info = ", ".join(f"{k} {v}" for k, v in C.device_info(torch.device(args.device), torch.get_num_threads()).items())
    command = (f"python benchmarks/bench_offload_gpu.py --device {args.device} --layers {args.layers} --width "
               f"{args.width} --batch {args.batch} --seq {args.seq} --rounds {args.rounds}"
               + (" --bf16" if args.bf16 else "") + (f" --outputs {args.outputs}" if args.outputs else ""))
    header = (f"# bench_offload_gpu: offloading side by side ({args.device})\n\n{info}\n\n"
              f"`{command}` ({time.perf_counter() - started:.0f} s)\n\n")
    C.write_results(C.RESULTS_DIR / f"bench_offload_gpu_{torch.device(args.device).type}.md", header + text + "\n")


if __name__ == "__main__":
    main()
