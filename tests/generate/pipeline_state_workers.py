"""Gloo workers of ``test_pipeline_state.py``: a pipelined module's state dict
by the user's names, and a serial state dict loaded into it."""

from __future__ import annotations

import torch
from torch import nn

import automap

FLOAT = torch.float64


def build():
    torch.manual_seed(0)
    layers = [m for _ in range(8) for m in (nn.Linear(16, 16), nn.Tanh())]
    model = nn.Sequential(*layers, nn.Linear(16, 4)).to(FLOAT)
    return model, (torch.randn(8, 16, dtype=FLOAT),)


def state_round_trip(rank: int, world: int, path: str) -> dict:
    model, inputs = build()
    module = automap.apply(automap.Plan.from_json(path), model, inputs)
    state = module.state_dict()  # collective the first time: every rank
    whole = {k: v.full_tensor() for k, v in state.items()}
    # A serial model's state loads into the stage's shards by the same names.
    torch.manual_seed(1)
    other, _ = build()
    module.load_state_dict(other.state_dict(), strict=True)
    loaded = {}
    for chunk in module.chunks:
        loaded.update(chunk.full_state_dict())
    return {"keys": sorted(state), "whole": whole,
            "loaded": {k: v for k, v in loaded.items()},
            "other": {k: v for k, v in other.state_dict().items() if k in loaded}}
