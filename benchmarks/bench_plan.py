"""Benchmark of hierremat's cold planning time for whole models (``hierremat.plan``).

Each config runs in a fresh Python subprocess (``--one NAME``), so nothing cached in
memory helps. Measured there, with the model and inputs built beforehand:
  - total cold s: wall time of the first ``hierremat.plan`` call, including the lazy
    import of hierremat's torch side, the Numba kernel load, torch.export capture,
    segmentation, profiling and the DP solve;
  - its breakdown: capture s (torch.export + segmentation), profile s (per-stage
    profiling, identical stages once), options s (per distinct block: joint graph trace,
    per-op profiling, ILP menu sweep) with its number of ILP solves, solve s (chain DP);
    stages and distinct signatures;
  - warm s: a second ``hierremat.plan`` call in the same process (menus from the cache's
    memory layer);
  - disk s / disk solves: the first plan of a *new* subprocess sharing the first one's
    on-disk option cache (each config starts with an empty cache directory);
  - process s (printed below the table): the subprocess' wall time (imports, model build),
    and the 1-minute load average when the config started: torch's CPU kernels slow down
    several-fold when other processes compete for the cores, so compare runs on an idle machine.
If the budget is infeasible, the plan is retried at the reported ``min_budget_bytes``.
Targets (2-core CPU): gpt2-4l-256 (b2, s128) under 10 s; gpt2-12l-768 (b2, s512) under
30 s; resnet-8b-32 (a ResNet-style CNN, b16, 64x64) under 10 s; t5-3+3l-128 (T5, 3+3 layers,
128 wide, b2, source 64, target 32) under 30 s; unet-3lv-32 (tests/models.py's UNet, 3
levels, 32 wide, b8, 64x64) under 60 s.
Usage: python benchmarks/bench_plan.py [--quick] [--threads N]   (--quick: gpt2-4l-256 only)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "bench_plan.md"
# name: (kind, model kwargs, batch, seq or image side, budget, target s)
CONFIGS = {
    "gpt2-4l-256": ("gpt2", {"n_layer": 4, "n_embd": 256, "n_head": 4}, 2, 128, "1GiB", 10.0),
    "gpt2-12l-768": ("gpt2", {"n_layer": 12, "n_embd": 768, "n_head": 12}, 2, 512, "4GiB", 30.0),
    "resnet-8b-32": ("resnet", {"width": 32}, 16, 64, "1GiB", 10.0),
    # an encoder-decoder (each layer a stage, the encoder output and position biases carried as residents)
    "t5-3+3l-128": ("t5", {"layers": 3, "d_model": 128}, 2, 64, "1GiB", 30.0),
    # a UNet with long skip connections (tests/models.py), each level a stage
    "unet-3lv-32": ("unet", {"width": 32, "levels": 3}, 8, 64, "1GiB", 60.0),
}


def build(name: str):
    """Model, args and kwargs of a config (random init, nothing downloaded)."""
    import torch
    from torch import nn

    kind, kw, batch, size, _, _ = CONFIGS[name]
    torch.manual_seed(0)
    if kind in ("t5", "unet"):
        sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
        from models import TinyUNet, seq2seq_call, tiny_t5

        if kind == "t5":
            return tiny_t5(**kw), (), {**seq2seq_call(batch, size, size // 2), "use_cache": False}
        return TinyUNet(**kw).train(), (torch.randn(batch, 3, size, size), torch.randn(batch, 3, size, size)), {}
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        model = GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_positions=1024, **kw)).train()
        ids = torch.randint(0, 50257, (batch, size))
        return model, (ids,), {"labels": ids, "use_cache": False}

    def conv_bn(c_in, c_out, k=3, stride=1):
        return [nn.Conv2d(c_in, c_out, k, stride=stride, padding=k // 2, bias=False), nn.BatchNorm2d(c_out)]

    class Block(nn.Module):  # ResNet basic block
        def __init__(self, c_in, c_out, stride):
            super().__init__()
            self.body = nn.Sequential(*conv_bn(c_in, c_out, 3, stride), nn.ReLU(), *conv_bn(c_out, c_out))
            self.short = nn.Sequential(*conv_bn(c_in, c_out, 1, stride)) if stride > 1 or c_in != c_out else nn.Identity()

        def forward(self, x):
            return torch.relu(self.body(x) + self.short(x))

    w = kw["width"]
    widths = [w, w, 2 * w, 2 * w, 4 * w, 4 * w, 8 * w, 8 * w]
    blocks = [Block(c_in, c_out, 2 if c_out != c_in else 1) for c_in, c_out in zip([w] + widths[:-1], widths)]
    model = nn.Sequential(*conv_bn(3, w), nn.ReLU(), *blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8 * w, 10))
    return model.train(), (torch.randn(batch, 3, size, size),), {}


def run_one(name: str, threads: int | None) -> dict:
    """Plan ``name`` twice in this process (cold, then warm); return the measurements."""
    import torch

    import hierremat

    if threads:
        torch.set_num_threads(threads)

    model, args, kwargs = build(name)
    budget = CONFIGS[name][4]

    def plan():
        nonlocal budget
        started = time.perf_counter()
        try:
            p = hierremat.plan(model, args, kwargs, budget=budget)
        except hierremat.InfeasibleBudgetError as err:
            budget = f"{err.min_budget_bytes}B"
            p = hierremat.plan(model, args, kwargs, budget=budget)
        return p, time.perf_counter() - started

    p, cold = plan()
    again, warm = plan()
    return {
        "config": name, "stages": len(p.stages), "distinct": len(set(p.signatures)), "capture": p.capture_seconds,
        "profile": p.chain.profile_seconds, "solve": p.chain.solve_seconds, "cold": cold, "warm": warm,
        "options": p.options_seconds, "solves": p.options_solves, "warm_solves": again.options_solves,
        "budget": budget, "peak": hierremat.format_bytes(p.predicted_peak_bytes), "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only gpt2-4l-256")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads in each subprocess (default: torch's)")
    parser.add_argument("--one", choices=CONFIGS, help=argparse.SUPPRESS)  # internal: one config, JSON out
    opts = parser.parse_args()
    if opts.one:
        print("RESULT " + json.dumps(run_one(opts.one, opts.threads)), flush=True)
        return
    import torch

    names = ["gpt2-4l-256"] if opts.quick else list(CONFIGS)
    header = (f"bench_plan {datetime.datetime.now():%Y-%m-%d %H:%M} | {platform.platform()} | "
              f"os.cpu_count()={os.cpu_count()} | torch {torch.__version__} | python {platform.python_version()}")
    rows = [
        ("| config | stages | distinct | capture s | profile s | options s (ILP solves) | solve s | total cold s "
         "| warm s (solves) | disk s (solves) | target s | met? | budget | predicted peak |"),
        "|" + "---|" * 14,
    ]
    notes = []
    for name in names:
        load, started = os.getloadavg()[0], time.perf_counter()
        cmd = [sys.executable, __file__, "--one", name] + (["--threads", str(opts.threads)] if opts.threads else [])
        cache_dir = tempfile.mkdtemp(prefix="hierremat-bench-plan-")
        env = {**os.environ, "HIERREMAT_CACHE_DIR": cache_dir}
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
        wall = time.perf_counter() - started
        disk = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
        disk_lines = [ln for ln in disk.stdout.splitlines() if ln.startswith("RESULT ")]
        d = json.loads(disk_lines[-1][7:]) if disk.returncode == 0 and disk_lines else None
        shutil.rmtree(cache_dir, ignore_errors=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            rows.append(f"| {name} | FAILED (rc {proc.returncode}) |" + " |" * 12)
            notes.append(f"{name} failed:\n```\n{proc.stderr[-4000:]}\n```")
            print(f"{name}: FAILED\n{proc.stderr[-4000:]}", file=sys.stderr)
            continue
        r, target = json.loads(lines[-1][7:]), CONFIGS[name][5]
        rows.append(
            f"| {name} | {r['stages']} | {r['distinct']} | {r['capture']:.2f} | {r['profile']:.2f} | "
            f"{r['options']:.2f} ({r['solves']}) | {r['solve']:.3f} | {r['cold']:.2f} | "
            f"{r['warm']:.2f} ({r['warm_solves']}) | "
            + (f"{d['cold']:.2f} ({d['solves']})" if d else "failed")
            + f" | {target:.0f} | "
            f"{'yes' if r['cold'] < target else 'NO'} | {r['budget']} | {r['peak']} |"
        )
        notes.append(f"{name}: subprocess wall {wall:.1f} s (imports + model build + 2 plans), "
                     f"torch threads {r['threads']}, load average at start {load:.2f}")
        print(rows[-1], flush=True)
    text = "\n".join([header, "", *rows, "", *notes]) + "\n"
    print("\n" + text)
    if not opts.quick:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(text)
        print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
