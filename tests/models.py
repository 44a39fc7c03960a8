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
