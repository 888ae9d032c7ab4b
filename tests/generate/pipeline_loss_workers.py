"""Gloo workers of ``test_pipeline_losses.py``: one pipelined step of a model
whose loss is not a plain mean over equal microbatches."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import automap

FLOAT = torch.float64


class Net(nn.Module):
    """Four layers and a head; ``kind``: "sum" (a sum-reduced squared error),
    "ce" (cross-entropy over shifted labels with ignored targets, as language
    models compute it), "ce_weighted" (with class weights too), "ce_empty"
    (cross-entropy whose first microbatch keeps no target at all: its own loss
    is 0 / 0), "tuple" and "tuple_sum" (cross-entropy returned first in a tuple
    with the logits, taken by the default loss and by ``first_summed``: both
    were weighted as a sum, twice the loss with two microbatches)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 8)
        self.register_buffer("class_weight", torch.linspace(0.5, 2.0, 8))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        out = self.head(x)
        if self.kind == "sum":
            return F.mse_loss(out, y, reduction="sum")
        logits = out[:, :-1].reshape(-1, 8)
        labels = y[:, 1:].reshape(-1)
        weight = self.class_weight if self.kind == "ce_weighted" else None
        loss = F.cross_entropy(logits, labels, weight=weight)
        return (loss, out) if self.kind.startswith("tuple") else loss


def first_summed(output):
    return output[0].sum()


def _itself(loss):
    return loss


#: The loss function each kind plans and applies with (None: the default).
LOSS_FNS = {"tuple": None, "tuple_sum": first_summed}


def loss_fn_of(kind: str):
    return LOSS_FNS.get(kind, _itself)


def build(kind: str):
    torch.manual_seed(0)
    model = Net(kind).to(FLOAT)
    if kind == "sum":
        return model, (torch.randn(8, 16, dtype=FLOAT), torch.randn(8, 8, dtype=FLOAT))
    x = torch.randn(8, 5, 16, dtype=FLOAT)
    y = torch.randint(0, 8, (8, 5))
    y[1:4] = -100  # the first microbatch keeps far fewer targets than the second
    y[0, 2:] = -100
    if kind == "ce_empty":
        y[0] = -100
    return model, (x, y)


def serial(kind: str):
    model, inputs = build(kind)
    loss = model(*inputs)
    loss = loss[0] if isinstance(loss, tuple) else loss
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}


def step(rank: int, world: int, cases: list[tuple[str, str]]) -> list:
    out = []
    for kind, path in cases:
        model, inputs = build(kind)
        module = automap.apply(automap.Plan.from_json(path), model, inputs,
                               loss_fn=loss_fn_of(kind))
        loss = module(*inputs)
        loss.backward()
        grads = {}
        for chunk in module.chunks:
            grads.update(chunk.full_state_dict(gradients=True))
        out.append((float(loss), grads))
    return out
