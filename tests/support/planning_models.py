"""Models for the planner's tests, built on the meta device (no weights)."""

from __future__ import annotations

import torch

from gpt2_block import Block as GPT2Block  # examples/: a GPT-2 block with separate q/k/v


def gpt2_block_case(batch=8, seq=1024, hidden=1024, heads=16):
    with torch.device("meta"):
        model = GPT2Block(hidden, heads)
        x = torch.randn(batch, seq, hidden)
    return model, (x,), lambda out: out.float().pow(2).mean()
