"""Benchmark: hierremat on a whole 12-layer GPT-2 vs Hugging Face gradient checkpointing (CPU).

One process, one run. Model: ``GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12,
vocab_size=50257, n_positions=1024)).train()`` built from its config (no weights downloaded), fp32,
batch 2, sequence 512; one training step = ``model(ids, labels=ids, use_cache=False).loss.backward()``.

Methods:
  (a) plain autograd (no checkpointing);
  (b) Hugging Face ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant":
      False})`` on a deepcopy of the model (every decoder block recomputed);
  (c) ``hierremat.remat(..., budget="100GiB", strategy="segments=K")`` for K in (2, 4, 7, 14): torch's
      uniform ``checkpoint_sequential`` schedule on hierremat's 14-stage chain;
  (d) ``hierremat.remat(..., budget=f"{n}B")`` (optimal plan) at budgets equal to the measured peaks
      of (b) and of every (c), plus the smallest feasible budget (``InfeasibleBudgetError.min_budget_bytes``).

Measured per method: the peak bytes of the tensors created during one step
(``hierremat.device.LiveTensorTracker``; parameters, inputs and preallocated ``.grad`` excluded; in
a separate step), the median wall time of a step over 3 interleaved rounds (round-robin), the
deterministic number of stage forwards per step (plain 14, HF 14 + 12 = 26, hierremat
``sum(plan.chain.schedule.forward_counts())``), and the max abs difference of the tied
lm_head/wte weight gradient vs plain (same ``torch.manual_seed``; dropout is active).

Targets:
  1. At the memory of HF checkpointing, hierremat is at least 10% faster at no more memory.
  2. At the memory of segments=4, hierremat is at least 15% faster than segments=4.
  3. hierremat reaches a lower peak than every baseline, at under 40% time overhead vs plain.

Output: ``benchmarks/results/bench_gpt2.md`` (+ ``.png``; ``bench_gpt2_quick.*`` with ``--quick``,
a 2-layer, n_embd=128, seq-128 model for a smoke test).
"""

from __future__ import annotations

import argparse
import copy
import gc
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import hierremat
from hierremat import InfeasibleBudgetError
from hierremat.device import LiveTensorTracker

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MIB, RESULTS_DIR as RESULTS, zero_grads  # noqa: E402  (shared with run_all.py)


@dataclass
class Method:
    name: str
    config: str
    module: torch.nn.Module
    params: list
    wte: torch.Tensor
    forwards: int
    plan: object = None
    peak: int = 0
    times: list = field(default_factory=list)
    grad_diff: float = float("nan")
    kind: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")

    @property
    def planning(self) -> float:
        if self.plan is None:
            return float("nan")
        c = self.plan.chain
        return self.plan.capture_seconds + c.profile_seconds + c.solve_seconds


def step(m: Method, ids: torch.Tensor) -> None:
    zero_grads(m.params)
    loss = m.module(ids, labels=ids, use_cache=False).loss
    loss.backward()


def measure(m: Method, ids, ref_grad, seed=1234):
    """One tracked step: peak bytes and the wte/lm_head grad diff vs plain."""
    gc.collect()
    zero_grads(m.params)
    torch.manual_seed(seed)
    with LiveTensorTracker() as tracker:
        loss = m.module(ids, labels=ids, use_cache=False).loss
        loss.backward()
        del loss
    m.peak = tracker.peak_bytes
    grad = m.wte.grad.detach().clone()
    m.grad_diff = 0.0 if ref_grad is None else (grad - ref_grad).abs().max().item()
    return grad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny 2-layer model (smoke test)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plan-deadline", type=float, default=480, help="skip further hierremat budgets after this many s")
    ap.add_argument("--time-deadline", type=float, default=780, help="stop timing rounds after this many s")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    from transformers import GPT2Config, GPT2LMHeadModel

    if args.quick:
        cfg = dict(n_layer=2, n_embd=128, n_head=4, vocab_size=50257, n_positions=1024)
        batch, seq = 2, 128
    else:
        cfg = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
        batch, seq = 2, 512
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**cfg)).train()
    hf_model = copy.deepcopy(model)
    hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_model.train()
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq))
    kwargs = {"labels": ids, "use_cache": False}
    params = list(model.parameters())
    hf_params = list(hf_model.parameters())
    n_layer = cfg["n_layer"]
    n_stages = n_layer + 2

    def log(msg):
        print(f"[{time.perf_counter() - t_start:7.1f} s] {msg}", flush=True)

    methods: list[Method] = []
    plain = Method("plain", "no checkpointing", model, params, model.transformer.wte.weight, n_stages, kind="plain")
    ref = measure(plain, ids, None)
    log(f"plain peak {plain.peak / MIB:.1f} MiB")
    methods.append(plain)
    hf = Method("HF", "gradient_checkpointing_enable", hf_model, hf_params, hf_model.transformer.wte.weight,
                n_stages + n_layer, kind="hf")
    measure(hf, ids, ref)
    log(f"HF peak {hf.peak / MIB:.1f} MiB, grad diff {hf.grad_diff:.2e}")
    methods.append(hf)

    problems: list[str] = []

    def make_hr(name, config, budget, strategy, kind):
        started = time.perf_counter()
        try:
            mod = hierremat.remat(model, (ids,), kwargs, budget=budget,
                                  settings=hierremat.Settings(strategy=strategy, defer_block_options=False))  # (the plan with its block options, timed)
        except Exception as err:  # report, do not fix the library
            import traceback
            problems.append(f"{name} {config}: {type(err).__name__}: {err}\n{traceback.format_exc()}")
            log(f"FAILED {name} {config}: {err}")
            return None
        plan = mod.plans[0]
        m = Method(name, config, mod, params, model.transformer.wte.weight,
                   sum(plan.chain.schedule.forward_counts()), plan=plan, kind=kind)
        try:
            measure(m, ids, ref)
        except Exception as err:
            import traceback
            problems.append(f"{name} {config} step: {type(err).__name__}: {err}\n{traceback.format_exc()}")
            log(f"FAILED step {name} {config}: {err}")
            return None
        log(f"{name} {config}: planned in {time.perf_counter() - started:.1f} s, peak {m.peak / MIB:.1f} MiB "
            f"(predicted {plan.predicted_peak_bytes / MIB:.1f}), forwards {m.forwards}, grad diff {m.grad_diff:.2e}")
        methods.append(m)
        return m

    segs = {}
    for k in (2, 4, 7, 14):
        if k > n_stages:
            continue
        m = make_hr("segments", f"segments={k}", "100GiB", f"segments={k}", "seg")
        if m is not None:
            segs[k] = m

    min_budget = None
    try:
        hierremat.plan(model, (ids,), kwargs, budget="1KiB")
        problems.append("a 1 KiB budget was feasible?!")
    except InfeasibleBudgetError as err:
        min_budget = err.min_budget_bytes
    log(f"min feasible budget {min_budget} B = {min_budget / MIB if min_budget else float('nan'):.1f} MiB")

    # budgets: the measured peaks of HF and every segments=K (measured-peak budgets below the smallest
    # feasible one are skipped without planning), the smallest feasible budget, and, because hierremat's
    # budget is in its own cost model's bytes, the *predicted* peak of every segments=K plan
    targets = [("HF measured peak", hf.peak)] + [(f"segments={k} measured peak", m.peak) for k, m in segs.items()]
    if min_budget is not None:
        targets.append(("min feasible", min_budget))
    targets += [(f"segments={k} predicted peak", m.plan.predicted_peak_bytes) for k, m in segs.items()]
    seen = set()
    opt = {}
    for label, b in targets:
        if b in seen:
            continue
        seen.add(b)
        if min_budget is not None and b < min_budget:
            problems.append(f"budget {b} B ({b / MIB:.1f} MiB, {label}) is below hierremat's smallest feasible "
                            f"budget {min_budget} B ({min_budget / MIB:.1f} MiB): not planned")
            log(problems[-1])
            continue
        if time.perf_counter() - t_start > args.plan_deadline:
            problems.append(f"budget {label} skipped: planning time guard ({args.plan_deadline} s) reached")
            log(problems[-1])
            continue
        m = make_hr("hierremat", f"budget={b / MIB:.1f} MiB ({label})", f"{b}B", "optimal", "opt")
        if m is not None:
            opt[label] = m

    log(f"timing: {args.rounds} rounds x {len(methods)} methods")
    for r in range(args.rounds):
        if r > 0 and time.perf_counter() - t_start > args.time_deadline:
            problems.append(f"only {r} timing rounds: time guard ({args.time_deadline} s) reached")
            log(problems[-1])
            break
        for m in methods:
            gc.collect()
            torch.manual_seed(r)
            t0 = time.perf_counter()
            step(m, ids)
            m.times.append(time.perf_counter() - t0)
        log(f"round {r + 1}: " + ", ".join(f"{m.config.split(' (')[0]} {m.times[-1]:.2f}" for m in methods))

    total = time.perf_counter() - t_start
    report = render(methods, plain, hf, segs, opt, cfg, batch, seq, args, total, problems)
    print(report)
    stem = "bench_gpt2_quick" if args.quick else "bench_gpt2"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.md").write_text(report)
    try:
        plot(methods, plain, RESULTS / f"{stem}.png")
    except Exception as err:  # plotting is optional
        print(f"plot failed: {err}", file=sys.stderr)
    return 0


def best_at(cands: list[Method], mem: int):
    fits = [m for m in cands if m.peak <= mem]
    return min(fits, key=lambda m: m.median) if fits else None


def render(methods, plain, hf, segs, opt, cfg, batch, seq, args, total, problems) -> str:
    P, T = plain.peak, plain.median
    lines = [
        "# hierremat vs Hugging Face gradient checkpointing on GPT-2 (CPU)",
        "",
        f"Model: GPT2LMHeadModel({', '.join(f'{k}={v}' for k, v in cfg.items())}), train mode (dropout on), fp32, "
        f"batch {batch}, seq {seq}; step = forward + loss.backward(). torch {torch.__version__}, "
        f"{args.threads} threads, {platform.processor() or platform.machine()}. Median of {args.rounds} interleaved rounds. "
        f"Peak = bytes of tensors created during the step (LiveTensorTracker; params, inputs, preallocated grads excluded). "
        f"Grad diff = max |d(wte/lm_head weight grad)| vs plain, same seed. Total run {total:.0f} s.",
        "",
        "| method | config | peak MiB | peak/plain | median step s | time/plain | forwards | predicted peak MiB | planning s | grad diff |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in methods:
        pred = f"{m.plan.predicted_peak_bytes / MIB:.1f}" if m.plan else "-"
        plan_s = f"{m.planning:.1f}" if m.plan else "-"
        lines.append(
            f"| {m.name} | {m.config} | {m.peak / MIB:.1f} | {m.peak / P:.3f} | {m.median:.2f} | {m.median / T:.3f} | "
            f"{m.forwards} | {pred} | {plan_s} | {m.grad_diff:.1e} |"
        )
    optl = list(opt.values())
    lines += ["", "## Comparison", ""]
    verdicts = []

    def speed_verdict(title: str, base, ratio_needed: float, vs: str, none_found: str) -> str:
        """MET when hierremat, within the baseline's measured peak, takes at most ratio_needed of its time."""
        h = best_at(optl, base.peak)
        if h is None:
            return f"{title}: NOT MET - {none_found}."
        r = h.median / base.median
        return (
            f"{title}: {'MET' if r <= ratio_needed else 'NOT MET'} - hierremat {h.config}: "
            f"peak {h.peak / MIB:.1f} MiB vs {vs}, time {h.median:.2f} s vs {base.median:.2f} s "
            f"(ratio {r:.3f}, {(1 - r) * 100:+.1f}% faster); forwards {h.forwards} vs {base.forwards}."
        )

    # 1. at HF's memory
    verdicts.append(speed_verdict(
        "Target 1 (>=10% faster than HF at no more memory)", hf, 0.90,
        f"HF {hf.peak / MIB:.1f} MiB", "no hierremat plan measured within HF's peak",
    ))
    # 2. at segments=4 memory
    s4 = segs.get(4)
    if s4 is None:
        verdicts.append("Target 2: not evaluated (segments=4 failed).")
    else:
        verdicts.append(speed_verdict(
            "Target 2 (>=15% faster than segments=4 at no more memory)", s4, 0.85,
            f"{s4.peak / MIB:.1f} MiB ({s4.peak / P:.2f}x plain)", "no hierremat plan within its peak",
        ))
    # 3. lowest peaks
    groups = {"plain": [plain], "HF": [hf], "segments=K": list(segs.values()), "hierremat optimal": optl}
    lines.append("Lowest measured peak per method:")
    lines.append("")
    low = {}
    for g, ms in groups.items():
        if not ms:
            continue
        m = min(ms, key=lambda m: m.peak)
        low[g] = m
        lines.append(f"- {g}: {m.peak / MIB:.1f} MiB ({m.peak / P:.3f}x plain) at {m.median:.2f} s "
                     f"({m.median / T:.3f}x plain), {m.config}")
    lines.append("")
    if "hierremat optimal" in low:
        hl = low["hierremat optimal"]
        base = min((low[g].peak for g in low if g != "hierremat optimal"), default=None)
        over = hl.median / T - 1
        ok = base is not None and hl.peak < base and over < 0.40
        verdicts.append(
            f"Target 3 (lower peak than every baseline at <40% overhead): {'MET' if ok else 'NOT MET'} - hierremat lowest "
            f"peak {hl.peak / MIB:.1f} MiB vs best baseline {base / MIB:.1f} MiB; overhead vs plain {over * 100:+.1f}% "
            f"(forwards {hl.forwards} vs {plain.forwards})."
        )
    lines += ["## Verdicts", ""] + [f"- {v}" for v in verdicts]
    if problems:
        lines += ["", "## Problems", ""] + [f"```\n{p}\n```" for p in problems]
    return "\n".join(lines) + "\n"


def plot(methods, plain, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"plain": ("k", "s"), "hf": ("tab:red", "D"), "seg": ("tab:orange", "o"), "opt": ("tab:blue", "^")}
    labels = {"plain": "plain", "hf": "HF checkpointing", "seg": "segments=K (uniform)", "opt": "hierremat optimal"}
    for kind in styles:
        ms = sorted((m for m in methods if m.kind == kind), key=lambda m: m.peak)
        if not ms:
            continue
        c, mk = styles[kind]
        ax.plot([m.peak / MIB for m in ms], [m.median for m in ms], marker=mk, color=c, label=labels[kind],
                linestyle="-" if len(ms) > 1 else "none")
    ax.set_xlabel("measured peak MiB")
    ax.set_ylabel("median step s")
    ax.set_title("GPT-2 training step: memory vs time (CPU)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
