"""Gloo workers of ``test_written_state.py``: a model that updates a buffer in
place under ``torch.no_grad()`` (an exponential moving average), trained
under a checkpointed plan."""

from __future__ import annotations

import torch
from torch import nn

import automap

FLOAT = torch.float64


class EmaBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.register_buffer("ema", torch.zeros(width))

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * h.mean(0))
        return h + 0.1 * self.ema


class EmaNet(nn.Module):
    def __init__(self, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[EmaBlock(width) for _ in range(depth)])
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        return self.head(self.blocks(x)).pow(2).mean()


def build():
    torch.manual_seed(0)
    return EmaNet().to(FLOAT), (torch.randn(32, 64, dtype=FLOAT),)


def train(module, inputs, steps: int = 3):
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = module(*inputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def train_planned(rank: int, world: int, path: str):
    model, inputs = build()
    module = automap.apply(automap.Plan.from_json(path), model, inputs)
    return train(module, inputs), module.full_state_dict()
