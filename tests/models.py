"""Random chains of modules for runtime tests (seeded, small, CPU)."""

from __future__ import annotations

import torch
from torch import nn


def random_mlp_chain(seed: int, stages: int = 8, width: int = 96) -> nn.Sequential:
    g = torch.Generator().manual_seed(seed)
    choices = ["linear", "gelu", "dropout", "bn", "relu", "tanh", "block"]
    layers = [nn.Linear(width, width)]
    for _ in range(stages - 2):
        kind = choices[int(torch.randint(len(choices), (1,), generator=g))]
        layers.append(
            {
                "linear": lambda: nn.Linear(width, width),
                "gelu": nn.GELU,
                "dropout": lambda: nn.Dropout(0.3),
                "bn": lambda: nn.BatchNorm1d(width),
                "relu": nn.ReLU,
                "tanh": nn.Tanh,
                "block": lambda: nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(0.2), nn.Linear(2 * width, width)),
            }[kind]()
        )
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def conv_chain(channels: int = 8) -> nn.Sequential:
    def conv_block(c_in, c_out, stride=1):
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1), nn.BatchNorm2d(c_out), nn.ReLU())

    return nn.Sequential(
        conv_block(3, channels),
        conv_block(channels, channels),
        nn.Dropout2d(0.2),
        conv_block(channels, 2 * channels, stride=2),
        nn.GELU(),
        conv_block(2 * channels, 2 * channels),
        nn.BatchNorm2d(2 * channels),
        nn.Conv2d(2 * channels, 2 * channels, 3, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * channels, 10),
    )


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 convs with BatchNorm and a residual connection."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))
            if stride != 1 or c_in != c_out
            else nn.Identity()
        )

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class TinyResNet(nn.Module):
    def __init__(self, width: int = 8, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 2 * width))
        self.head = nn.Linear(2 * width, classes)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, labels=None):
        x = self.layer2(self.layer1(self.stem(x)))
        logits = self.head(self.drop(x.mean(dim=(2, 3))))
        if labels is None:
            return logits
        return nn.functional.cross_entropy(logits, labels), logits


def tiny_gpt2(n_layer: int = 2, n_embd: int = 64, n_positions: int = 128, vocab_size: int = 256):
    """A randomly initialised Hugging Face GPT-2 (nothing downloaded)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = GPT2Config(
        n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=vocab_size, n_positions=n_positions,
        bos_token_id=0, eos_token_id=0,
    )
    return GPT2LMHeadModel(config).train()
