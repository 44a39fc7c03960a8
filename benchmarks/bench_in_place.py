"""In-place pointwise operators (hierremat.blocks.variants.in_place): what running them in place buys.

Models (random weights, fp32, train mode, CPU), planned with ``hierremat.plan_sequential``:
  gpt2-blocks  4 Hugging Face GPT-2 decoder blocks (n_embd 128, 4 heads, dropout 0.1) as an nn.Sequential; input
               hidden states (2, 256, 128);
  relu-mlp     bench_relu_masks' MLP (6 x Linear 256->1024, ReLU, Dropout, Linear 1024->256); input (512, 64);
  resnet       run_all's ResNet-style nn.Sequential (stem + 6 BasicBlocks); input (8, 3, 64, 64).
Methods, side by side: hierremat with every operator variant ("in place"), and the same with the in-place rewrite
switched off ("without": every other variant still on), on the same model and input.

Deterministic figures only (no wall time): the smallest feasible budget (``InfeasibleBudgetError.min_budget_bytes``
after asking for 1 KiB), and at the larger of the two floors and at 1.5x and 2x it, the plan's predicted step as
overhead over keeping everything (both from the same profile). One real step at each floor checks the live-tensor
peak against the budget and the gradients against plain autograd's.

    python benchmarks/bench_in_place.py

Writes benchmarks/results/bench_in_place.md.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from transformers import GPT2Config
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from bench_relu_masks import compare, relu_mlp, resnet, rewrite_switched


class DecoderBlock(nn.Module):
    """A GPT-2 block returning its hidden states only."""

    def __init__(self, config: GPT2Config, index: int):
        super().__init__()
        self.block = GPT2Block(config, layer_idx=index)

    def forward(self, x):
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out


def gpt2_blocks():
    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=128, n_head=4, n_positions=256)
    return nn.Sequential(*(DecoderBlock(config, i) for i in range(4))), torch.randn(2, 256, 128)


in_place = functools.partial(rewrite_switched, "run_in_place")


def main() -> None:
    compare((("gpt2-blocks", gpt2_blocks), ("relu-mlp", relu_mlp), ("resnet", resnet)), in_place,
            ("without", "in place"), "pointwise ops", "In-place pointwise operators: floors and predicted overheads",
            "bench_in_place.md")


if __name__ == "__main__":
    main()
