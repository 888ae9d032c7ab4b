"""Gloo workers of ``test_clip_grad_norm.py``: one backward of a planned module,
then ``clip_grad_norm_``; the norm and the clipped gradients gathered whole."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import automap
from automap.cli.demo import TinyGPT2

FLOAT = torch.float64


class Sharded(nn.Module):
    """An MLP the tests' slow device shards (tensor parallel)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)

    def forward(self, x, y):
        return F.mse_loss(self.c(torch.tanh(self.b(torch.tanh(self.a(x))))), y)


def build(name: str):
    torch.manual_seed(0)
    if name == "mlp":
        model = Sharded().to(FLOAT)
        return model, (torch.randn(8, 16, dtype=FLOAT), torch.randn(8, 8, dtype=FLOAT))
    model = TinyGPT2(vocab=64, seq=16, hidden=32, heads=2, layers=2).to(FLOAT)
    ids = torch.randint(0, 64, (4, 16))
    return model, (ids, ids)


def serial(name: str, max_norm: float, norm_type: float):
    model, inputs = build(name)
    model(*inputs).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    return float(norm), {n: p.grad.clone() for n, p in model.named_parameters()}


def clip(rank: int, world: int, cases: list[tuple[str, str, float, float]]) -> list:
    out = []
    for name, path, max_norm, norm_type in cases:
        model, inputs = build(name)
        module = automap.apply(automap.Plan.from_json(path), model, inputs)
        module(*inputs).backward()
        norm = module.clip_grad_norm_(max_norm, norm_type)
        grads = module.full_state_dict(gradients=True) \
            if isinstance(module, automap.ParallelModule) else None
        out.append((float(norm), grads))
    return out
