"""Large vocabularies: hierremat's memory floor, and its time at HF checkpointing's memory (CPU, one run).

Models (random weights, fp32, train mode, dropout as configured, nothing downloaded):
  gpt2-50k    GPT-2, 4 layers, 256 wide, vocabulary 50257 (tied head), batch 2, seq 256, wrapped to return
              its loss only (``LossOnly``: what a training loop differentiates);
  llama-128k  Llama-style, 2 layers, 256 wide, 4 query / 2 key-value heads, MLP 688, vocabulary 128256
              (untied head), batch 1, seq 2048, called the Hugging Face way (``model(ids, labels=ids)``),
              hierremat with ``outputs="loss"`` (the step uses the loss only).
Methods, side by side on the same model, batch and seed:
  plain       eager autograd, no checkpointing: every ratio is to it;
  HF          ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})``;
  hierremat   ``hierremat.remat`` at its smallest feasible budget (``InfeasibleBudgetError.min_budget_bytes``
              after asking for 1 KiB) and at HF's measured peak (an equal-memory comparison).
Liger Kernel's fused linear cross-entropy has Triton kernels only (no CPU backend): it has no row here.

Peak: hierremat's live-tensor tracker (what a budget counts: tensors created in the step; parameters, inputs
and preallocated ``.grad`` not counted). Time: the median over ``--rounds`` rounds, the methods interleaved in a
seeded shuffled order each round. Deterministic cost beside it: stage forwards per step (plain: 1 per stage)
and hierremat's predicted step time (profiled op costs). Grad diff: max |grad - plain's| over all parameters.

    python benchmarks/bench_lm_head.py [--models gpt2-50k,llama-128k] [--rounds 5]

Writes benchmarks/results/bench_lm_head.md.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import common as C
import hierremat as hr

sys.path.insert(0, str(C.REPO_ROOT / "tests"))
from models import LossOnly  # noqa: E402

RESULTS = C.RESULTS_DIR / "bench_lm_head.md"
SEED = 1234


@dataclass
class Row:
    method: str
    setting: str
    module: torch.nn.Module
    plan: object = None
    planning_s: float | None = None
    peak: int = 0
    times: list[float] = field(default_factory=list)
    grad_diff: float | None = None


def gpt2_50k():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=50257, n_positions=1024)
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 50257, (2, 256))
    wrapped = LossOnly(model)
    return wrapped, model, (ids, ids), {}, None, "GPT-2 4 layers, 256 wide, vocabulary 50257 (tied), batch 2, seq 256, loss only"


def llama_128k():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128256, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048,
    )
    model = LlamaForCausalLM(config).train()
    ids = torch.randint(0, 128256, (1, 2048))
    return (model, model, (ids,), {"labels": ids, "use_cache": False}, "loss",
            "Llama-style 2 layers, 256 wide, vocabulary 128256 (untied), batch 1, seq 2048, outputs='loss'")


MODELS = {"gpt2-50k": gpt2_50k, "llama-128k": llama_128k}


def loss_of(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss if hasattr(out, "loss") else out[0]


def run_model(name: str, rounds: int) -> tuple[str, list[Row], list[str]]:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    model, hf_model, args, kwargs, outputs, title = MODELS[name]()
    notes: list[str] = []

    def step_of(module):
        def step():
            torch.manual_seed(SEED)
            loss_of(module(*args, **kwargs)).backward()
        return step

    params = C.params_of(model)
    plain = Row("plain", "no checkpointing", model)
    hf_copy = copy.deepcopy(hf_model)
    hf_copy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_module = LossOnly(hf_copy) if model is not hf_model else hf_copy
    hf = Row("HF", "gradient_checkpointing_enable", hf_module)
    rows = [plain, hf]
    for row in rows:
        C.zero_grads(C.params_of(row.module))
        step_of(row.module)()  # warm-up
        C.zero_grads(C.params_of(row.module))
        row.peak = C.peak_bytes(step_of(row.module), torch.device("cpu"))
    C.zero_grads(params)
    step_of(model)()
    reference = C.grads_of(params)

    started = time.perf_counter()
    smallest = C.smallest_feasible_budget(
        lambda b: hr.plan(model, args, kwargs, budget=b, outputs=outputs), notes)
    notes.append(f"smallest feasible budget {smallest} B ({smallest / C.MIB:.2f} MiB), found in "
                 f"{time.perf_counter() - started:.1f} s")
    for setting, budget in ((f"budget {smallest / C.MIB:.2f} MiB (smallest feasible)", smallest),
                            (f"budget {hf.peak / C.MIB:.2f} MiB (= HF's peak)", hf.peak)):
        if budget < smallest:
            notes.append(f"{setting}: below the smallest feasible budget, not run")
            continue
        plan = hr.plan(model, args, kwargs, budget=budget, outputs=outputs)
        rows.append(Row("hierremat", setting, hr.remat(model, args, kwargs, plan=plan), plan,
                        C.model_plan_seconds(plan)))
    for row in rows[2:]:
        C.zero_grads(params)
        step_of(row.module)()  # warm-up (and a re-plan if the first call asks for one)
        C.zero_grads(params)
        row.peak = C.peak_bytes(step_of(row.module), torch.device("cpu"))
        row.grad_diff = C.max_abs_diff(C.grads_of(params), reference)
        if row.peak > row.plan.budget_bytes:
            notes.append(f"{row.setting}: measured peak {row.peak} B above the budget {row.plan.budget_bytes} B")

    def timed(row: Row, _round: int) -> None:
        row.times.append(C.timed_step(step_of(row.module), C.params_of(row.module), torch.device("cpu")))

    done = C.interleave(rows, rounds, SEED, timed)
    plain_time = C.median(plain.times)
    table = []
    for row in rows:
        t = C.median(row.times)
        forwards = (sum(row.plan.chain.schedule.forward_counts()) if row.plan is not None
                    else None)
        table.append([
            row.method, row.setting, f"{row.peak / C.MIB:.2f}", f"{row.peak / plain.peak:.3f}", f"{t:.3f}",
            f"{t / plain_time:.3f}", f"{t / C.median(hf.times):.3f}",
            C.fmt(None if row.plan is None else float(row.plan.predicted_step_time), ".3f"),
            C.fmt(forwards, "d"), C.fmt(row.planning_s, ".1f"),
            "" if row.grad_diff is None else f"{row.grad_diff:.1e}",
        ])
    header = ["method", "setting", "peak MiB", "peak / plain", "step s", "time / plain", "time / HF",
              "pred. step s", "fwd", "plan s", "grad diff"]
    text = (f"## {name}\n\n{title}; {sum(p.numel() for p in params) / 1e6:.1f} M parameters; {done} rounds.\n\n"
            + C.markdown_table(header, table) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n")
    return text, rows, notes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    threads = torch.get_num_threads()
    info = C.device_info(torch.device("cpu"), threads)
    started = time.perf_counter()
    parts = [run_model(name, args.rounds)[0] for name in args.models.split(",")]
    head = ("# Large vocabularies: memory floor and time at HF's memory (CPU)\n\n"
            f"torch {info['torch']}, transformers {info.get('transformers', '?')}, {info['device_name']}, "
            f"{threads} threads, hierremat {info['revision']}, {info['date']}; total {time.perf_counter() - started:.0f} s. "
            "Peaks by the live-tensor tracker (preallocated `.grad` not counted); times are medians of interleaved "
            "rounds; *fwd*: stage forwards per step; *pred. step s*: hierremat's predicted step time.\n\n")
    C.write_results(RESULTS, head + "\n".join(parts))


if __name__ == "__main__":
    main()
