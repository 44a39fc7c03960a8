"""A long training run of the GPT-2 example's tiny model under a tight budget (tests/test_long_run.py).

Trains ``--steps`` steps (AdamW, the example's shipped text, its model and data code) through
``hierremat.remat`` at ``--budget-fraction`` of plain autograd's peak (or the smallest feasible
budget if higher), and prints JSON: the live-tensor peak of the step and the process's resident
set size after it, at step 10 and at the last step. Run with ``MALLOC_MMAP_THRESHOLD_=65536`` so
that freed large blocks go back to the system and the RSS shows what is really held.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

import hierremat as hr
from hierremat.device import LiveTensorTracker

ROOT = Path(__file__).resolve().parents[1]


def _example():
    spec = importlib.util.spec_from_file_location("finetune", ROOT / "examples" / "gpt2" / "finetune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--budget-fraction", type=float, default=0.5)
    args = ap.parse_args(argv)
    example = _example()
    torch.manual_seed(0)
    ex_args = example.parse_args(["--size", "tiny", "--seq-len", "128", "--batch", "4"])
    model, tokenizer = example.load_model_and_tokenizer(ex_args)
    model.train()
    train, _ = example.load_data(ex_args.data, tokenizer, ex_args.seq_len)
    stream = example.batches(train, ex_args.batch, torch.Generator().manual_seed(0))
    probe = next(stream)
    with LiveTensorTracker() as tracker:
        model(probe, labels=probe, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=False)
    try:
        hr.plan(model, (probe,), {"labels": probe, "use_cache": False}, budget="1KiB")
    except hr.InfeasibleBudgetError as err:
        smallest = err.min_budget_bytes
    budget = max(smallest, int(args.budget_fraction * tracker.peak_bytes))
    module = hr.remat(model, (probe,), {"labels": probe, "use_cache": False}, budget=f"{budget}B")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    marks = {10, args.steps}
    out = {"steps": args.steps, "budget_bytes": budget, "plain_peak_bytes": tracker.peak_bytes, "at": {}}
    for step in range(1, args.steps + 1):
        batch = next(stream)
        if step in marks:
            with LiveTensorTracker() as meter:
                loss = module(batch, labels=batch, use_cache=False).loss
                loss.backward()
        else:
            loss = module(batch, labels=batch, use_cache=False).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # .grad persists across steps: what a budget excludes
        if step in marks:
            del loss
            gc.collect()
            out["at"][str(step)] = {"peak_bytes": meter.peak_bytes, "rss_bytes": rss_bytes(),
                                    "plans": len(module.plans)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
