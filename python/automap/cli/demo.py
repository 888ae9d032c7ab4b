"""`automap demo`: plan a tiny GPT-2 on a 2x2 mesh of 4 gloo ranks on this
machine, train it 20 steps with the generated parallel module, and print each
step's loss next to the serial model's loss (computed on rank 0 alongside)."""

from __future__ import annotations

import copy
import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from automap.launch import run_on_gloo
from automap.progress import console, stage

log = logging.getLogger(__name__)

VOCAB, SEQ, HIDDEN, HEADS, LAYERS, BATCH = 256, 16, 64, 4, 2, 8
_COLLECTIVES = ("all_reduce_sum", "reduce_scatter_dim", "all_gather_dim", "split_dim",
                "all_to_all_dims", "identity_all_reduce_grad", "vocab_parallel_embedding")
#: FLOP/s the demo plans with: a CPU's, so that splitting compute pays off.
DEMO_FLOPS_PER_S = 2e9


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.proj = nn.Linear(hidden, hidden)
        self.fc, self.fc_proj = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = self.ln_1(x)

        def heads(t):
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

        a = F.scaled_dot_product_attention(heads(self.q(y)), heads(self.k(y)), heads(self.v(y)),
                                           is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))


class TinyGPT2(nn.Module):
    """GPT-2 in plain PyTorch (learned positions, pre-LN blocks, tied LM head)."""

    def __init__(self, vocab: int = VOCAB, seq: int = SEQ, hidden: int = HIDDEN,
                 heads: int = HEADS, layers: int = LAYERS) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(_Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        nn.init.normal_(self.wte.weight, std=0.02)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _rank_main(rank: int, world: int, steps: int, quiet: bool = False) -> dict:
    # A spawned process: rank 0 shows its steps on the terminal's stderr.
    with console(enabled=rank == 0 and not quiet):
        return _train(rank, world, steps)


def _train(rank: int, world: int, steps: int) -> dict:
    from automap.api import autoparallelize
    from automap.sharding.mesh import DeviceMesh

    torch.manual_seed(0)
    model = TinyGPT2()
    serial = copy.deepcopy(model) if rank == 0 else None
    mesh = DeviceMesh((2, 2), axis_names=("rows", "cols"))
    start = time.perf_counter()
    with stage(log, "planned and generated the parallel module", enabled=rank == 0):
        module = autoparallelize(model, _batch(0), mesh, flops_per_s=DEMO_FLOPS_PER_S)
    setup_s = time.perf_counter() - start
    opt = torch.optim.AdamW(module.parameters(), lr=3e-3)
    serial_opt = torch.optim.AdamW(serial.parameters(), lr=3e-3) if serial else None
    training = stage(log, f"trained {steps} steps", total=steps, enabled=rank == 0)
    with training:
        rows = _steps(module, opt, serial, serial_opt, steps, training)
    out = {"rows": rows, "setup_s": setup_s}
    if rank == 0:
        out["summary"] = module.plan.summary()
        out["collectives"] = {name: module.code.count(name + "(") for name in _COLLECTIVES
                              if name + "(" in module.code}
        out["buckets"] = len(module.gradient_sync.buckets)
        out["parameter_bytes"] = module.local_parameter_bytes()
        out["serial_bytes"] = sum(p.numel() * p.element_size() for p in serial.parameters())
    return out


def _steps(module, opt, serial, serial_opt, steps: int, progress) -> list:
    """Train ``steps`` steps (the serial model beside, on rank 0): per step
    (step, loss, serial loss, seconds)."""
    rows = []
    for step in range(steps):
        ids, labels = _batch(step)
        t0 = time.perf_counter()
        loss = module(ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_s = time.perf_counter() - t0
        serial_loss = float("nan")
        if serial is not None:
            s_loss = serial(ids, labels)
            s_loss.backward()
            serial_opt.step()
            serial_opt.zero_grad(set_to_none=True)
            serial_loss = s_loss.item()
        rows.append((step, loss.item(), serial_loss, step_s))
        progress.advance(f"step {step}")
    return rows


def run_training_demo(world_size: int = 4, steps: int = 20, quiet: bool = False) -> int:
    print(f"automap demo: a tiny GPT-2 ({LAYERS} layers, hidden {HIDDEN}, vocab {VOCAB}) on "
          f"{world_size} gloo ranks of this machine, a (2, 2) mesh; the planner chooses what "
          f"each mesh axis splits")
    print("planning (rank 0), generating the parallel module (every rank), training...\n",
          flush=True)  # before the ranks' progress on stderr
    results = run_on_gloo(_rank_main, world_size, steps, quiet, timeout_s=600)
    head = results[0]
    print(head["summary"])
    used = ", ".join(f"{n} x{c}" for n, c in head["collectives"].items()) or "none"
    buckets = head["buckets"]
    synced = (f"data-parallel gradients all-reduced in {buckets} "
              f"bucket{'' if buckets == 1 else 's'} after the backward" if buckets else
              "no gradient is left to a data-parallel all-reduce after the backward (the plan "
              "reduces every gradient inside the graph)")
    print(f"generated module calls: {used}; {synced}")
    print(f"parameters per rank: {head['parameter_bytes']} bytes (serial model: "
          f"{head['serial_bytes']} bytes); set up in {head['setup_s']:.1f} s\n")
    print(f"{'step':>4}  {'parallel loss':>14}  {'serial loss':>12}  {'rel. diff':>9}")
    worst = 0.0
    for step, loss, serial_loss, _ in head["rows"]:
        rel = abs(loss - serial_loss) / abs(serial_loss)
        worst = max(worst, rel)
        print(f"{step:4d}  {loss:14.6f}  {serial_loss:12.6f}  {rel:9.1e}")
    agree = all(r["rows"][i][1] == head["rows"][i][1] for r in results
                for i in range(len(head["rows"])))
    ok = worst <= 1e-5 and agree
    print(f"\nlargest relative difference {worst:.1e}; every rank saw the same loss: {agree}")
    print("the parallel module trains like the serial model" if ok else
          "MISMATCH: the parallel module diverged from the serial model")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(run_training_demo())
