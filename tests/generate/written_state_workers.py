"""Gloo workers of ``test_written_state.py``: a model that updates a buffer in
place under ``torch.no_grad()`` (an exponential moving average), trained
under a checkpointed plan."""

from __future__ import annotations

import torch
from torch import nn

import automap

FLOAT = torch.float64


class EmaBlock(nn.Module):
    """``read_back``: the block's output reads the average too; without, the
    wrapped no-grad update returns nothing (a node that only writes)."""

    def __init__(self, width: int, read_back: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.register_buffer("ema", torch.zeros(width))
        self.read_back = read_back

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * h.mean(0))
        return h + 0.1 * self.ema if self.read_back else h


class EmaNet(nn.Module):
    def __init__(self, width: int = 64, depth: int = 6, read_back: bool = True) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[EmaBlock(width, read_back) for _ in range(depth)])
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        return self.head(self.blocks(x)).pow(2).mean()


def build(read_back: bool = True):
    torch.manual_seed(0)
    return EmaNet(read_back=read_back).to(FLOAT), (torch.randn(32, 64, dtype=FLOAT),)


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


def train_planned(rank: int, world: int, path: str, read_back: bool = True):
    model, inputs = build(read_back)
    module = automap.apply(automap.Plan.from_json(path), model, inputs)
    return train(module, inputs), module.full_state_dict()
