"""Models for the planner's tests, built on the meta device (no weights)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GPT2Block(nn.Module):
    """A GPT-2 transformer block (pre-LN attention and MLP with residuals), with
    separate q/k/v projections."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(hidden)
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.attn_proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = self.ln_1(x)

        def heads(t):
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

        a = F.scaled_dot_product_attention(heads(self.q(y)), heads(self.k(y)), heads(self.v(y)),
                                           is_causal=True)
        x = x + self.attn_proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln_2(x))))


def gpt2_block_case(batch=8, seq=1024, hidden=1024, heads=16):
    with torch.device("meta"):
        model = GPT2Block(hidden, heads)
        x = torch.randn(batch, seq, hidden)
    return model, (x,), lambda out: out.float().pow(2).mean()
