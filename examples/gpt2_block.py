"""A GPT-2 block (hidden 1024, 16 heads) built on the meta device, for
`automap plan` and `automap estimate`:

    automap plan examples/gpt2_block.py:build --batch 2 --mesh 4 --memory 160MiB \
        --alpha-s 5e-6 --bandwidth 2e11 --flops 30e12 --memory-bandwidth 1.5e12 \
        --op-overhead 5e-6 -o plan.json
    automap explain plan.json
"""

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, hidden: int = 1024, heads: int = 16) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.proj = nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        y = self.ln_1(x)

        def split(t):
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

        a = F.scaled_dot_product_attention(split(self.q(y)), split(self.k(y)), split(self.v(y)),
                                           is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln_2(x))))


def build(batch: int = 2, seq: int = 1024):
    with torch.device("meta"):
        model = Block()
        x = torch.randn(batch, seq, 1024)
    return model, (x,), lambda out: out.pow(2).mean()
