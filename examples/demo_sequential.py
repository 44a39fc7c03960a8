"""Plan and train a sequential model under a memory budget, printing the plan and measured memory.

The main job of the README until the GPT-2 example exists. CPU by default (``--device
cuda`` on a GPU machine). Steps:
  1. measure the peak of one plain-autograd training step;
  2. plan hierremat at a fraction of it (``--fraction``, default 0.6) and print the plan;
  3. train a few steps with ``hierremat.checkpoint_sequential`` and print, per step, the
     loss, the measured peak (live-tensor tracker on CPU, allocator stats on CUDA) and
     the step time, next to plain autograd's.
"""

from __future__ import annotations

import argparse
import copy
import logging
import time

import torch
from torch import nn

import hierremat as hr
from hierremat.device import measure_peak


def make_model(width: int, depth: int) -> nn.Sequential:
    stages: list[nn.Module] = [nn.Linear(width, width)]
    for _ in range(depth):
        stages += [
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU()),
            nn.Sequential(nn.Linear(4 * width, width), nn.Dropout(0.1)),
            nn.BatchNorm1d(width),
        ]
    stages.append(nn.Linear(width, 16))
    return nn.Sequential(*stages)


def train_step(model, x, target, optimizer, budget=None):
    optimizer.zero_grad()  # PyTorch's default: the step allocates .grad, and the budget counts it
    with measure_peak(x.device) as meter:
        start = time.perf_counter()
        y = model(x) if budget is None else hr.checkpoint_sequential(model, budget, x)
        loss = nn.functional.cross_entropy(y, target)
        loss.backward()
        if x.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    optimizer.step()
    return loss.item(), meter.peak_bytes, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=6, help="number of (norm, MLP, norm) groups")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--fraction", type=float, default=0.6, help="budget as a fraction of plain autograd's peak")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    device = torch.device(args.device)

    model = make_model(args.width, args.depth).to(device)
    plain_model = copy.deepcopy(model)
    x = torch.randn(args.batch, args.width, device=device)
    target = torch.randint(0, 16, (args.batch,), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=1e-3)
    for m in (model, plain_model):
        for p in m.parameters():
            p.grad = torch.zeros_like(p)  # as after the first step, so .grad storage is not counted

    _, plain_peak, _ = train_step(copy.deepcopy(plain_model), x, target, torch.optim.SGD(plain_model.parameters(), lr=0))
    budget = int(plain_peak * args.fraction)
    print(f"model: {len(model)} stages; plain autograd peak {hr.format_bytes(plain_peak)}; "
          f"budget {hr.format_bytes(budget)} ({args.fraction:.0%})\n")
    try:
        plan = hr.plan_sequential(model, f"{budget}B", x)
    except hr.InfeasibleBudgetError as err:
        print(f"{err}\nplanning at the smallest feasible budget instead\n")
        budget = err.min_budget_bytes
        plan = hr.plan_sequential(model, f"{budget}B", x)
    print(plan.summary(), "\n")

    hr.checkpoint_sequential(model, f"{budget}B", x)  # first call plans; later calls reuse the plan
    print(f"{'step':>4} {'loss':>8} {'hierremat peak':>15} {'plain peak':>11} {'ms':>7} {'plain ms':>8}")
    for step in range(args.steps):
        torch.manual_seed(step)
        loss, peak, seconds = train_step(model, x, target, opt, f"{budget}B")
        torch.manual_seed(step)
        plain_loss, plain_step_peak, plain_seconds = train_step(plain_model, x, target, plain_opt)
        assert abs(loss - plain_loss) <= 1e-4 * max(1.0, abs(plain_loss)), (loss, plain_loss)
        assert peak <= budget, "measured peak above the budget"
        print(f"{step:>4} {loss:>8.4f} {hr.format_bytes(peak):>15} {hr.format_bytes(plain_step_peak):>11} "
              f"{seconds * 1e3:>7.1f} {plain_seconds * 1e3:>8.1f}")
    print(f"\nmeasured peak {hr.format_bytes(peak)} <= budget {hr.format_bytes(budget)}; "
          f"predicted {hr.format_bytes(plan.predicted_peak_bytes)}; losses equal plain autograd's")


if __name__ == "__main__":
    main()
