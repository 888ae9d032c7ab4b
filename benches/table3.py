"""The MAP paper's Table 3/4 (weak scaling of GPT-2 on its 8xA100 box): 4
layers, seq 1024, hidden 2048/4096/8192/16384 on 1/2/4/8 GPUs. The box:
NVLink pairs 0-1, 2-3, 4-5, 6-7 (200 GB/s), PCIe inside each NUMA node
{0..3}, {4..7} (20 GB/s), PCIe across NUMA (10 GB/s).

For each config, automap plans on the cluster's top candidate meshes and
keeps the fastest; Megatron's 1-D tensor parallelism (every matmul weight
split, activations never split along batch or sequence) is priced under the
same cost model on a 1-D mesh over the same GPUs. Assumptions: A100 at a
sustained 150 TFLOP/s (bf16 tensor cores at about half of peak), bf16
weights, AdamW, 80 GB per GPU, global batch 64 (the paper does not give
its batch; at 8 the token count is too small for data parallelism to pay
off anywhere). Prints estimated throughput
and the ratio beside the paper's measured one.

    python benches/table3.py
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from automap import Cluster, DeviceMesh, ShardingSpec
from automap.planner.search import plan

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gpt2_block import Block  # noqa: E402  (the example's GPT-2 block, separate q/k/v)

SUSTAINED_FLOPS_PER_S = 150e12
#: The rest of an A100's profile: HBM bandwidth and the launch of one kernel.
A100 = {"flops_per_s": SUSTAINED_FLOPS_PER_S, "memory_bandwidth_bytes_per_s": 1.5e12,
        "op_overhead_s": 5e-6}
BUDGET_BYTES = 80 * 10**9
BATCH, SEQ, LAYERS, VOCAB = 64, 1024, 4, 50304  # vocabulary padded to a multiple of 128
CONFIGS = [("alpha", 1, 2048, 1.00), ("beta", 2, 4096, 1.02), ("gamma", 4, 8192, 1.14),
           ("delta", 8, 16384, 1.13)]
TIERS = [(2, 5e-6, 2e11), (4, 1e-5, 2e10), (8, 2e-5, 1e10)]  # group size, alpha, bandwidth


class GPT2(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, hidden), nn.Embedding(SEQ, hidden)
        self.h = nn.ModuleList(Block(hidden, hidden // 128) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(hidden)

    def forward(self, ids, labels):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.h:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def model_and_inputs(hidden: int):
    with torch.device("meta"):
        model = GPT2(hidden).to(torch.bfloat16)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return model, (ids, ids)


def cluster(gpus: int) -> Cluster:
    tiers = [{"group_size": g, "alpha_s": a, "bandwidth_bytes_per_s": b}
             for g, a, b in TIERS if g <= gpus]
    return Cluster.from_dict({"version": 1, "devices": gpus, "tiers": tiers,
                              "device": {"sustained_flops_per_s": SUSTAINED_FLOPS_PER_S,
                                         "memory_bandwidth_bytes_per_s": 1.5e12,
                                         "op_overhead_s": 5e-6}})


def megatron_only(table, node):
    """Keep strategies that split no activation along batch or sequence and
    split every matmul weight (Megatron's 1-D tensor parallelism)."""
    params = {n for n, opts in table.nodes.items() if opts.kind in ("parameter", "buffer")}
    keep = []
    for ins, outs in zip(node.in_specs, node.out_specs):
        activations = [s for (p, _), s in zip(node.inputs, ins) if p not in params] + list(outs)
        ok = all(not _splits_tokens(s) for s in activations if s)
        if node.op in ("linear", "embedding") and len(ins) > 1:
            weight = ins[1] if node.op == "linear" else ins[0]
            ok = ok and "S" in weight
        keep.append(ok)
    return keep


def _splits_tokens(spec: str) -> bool:
    dims = ShardingSpec.parse(spec).dims
    # Token dims lead: (batch, seq, ...) activations, (batch*seq, ...) when flattened.
    return bool(dims[0]) or (len(dims) >= 3 and bool(dims[1]) and len(dims) != 4)


def table3(configs=CONFIGS):
    """Rows (name, gpus, hidden, our plan, Megatron plan, tokens FLOPs, paper ratio)."""
    rows = []
    for name, gpus, hidden, paper in configs:
        model, inputs = model_and_inputs(hidden)
        candidates = cluster(gpus).meshes()
        best = None
        for mesh in candidates[:3]:
            p = plan(model, inputs, mesh, BUDGET_BYTES, **A100)
            if best is None or p.predicted_step_s < best.predicted_step_s:
                best = p
        line = candidates[-1]  # the 1-D mesh over all GPUs: its slowest link sets the pace
        one_d = DeviceMesh((gpus,), alpha_s=max(line.alpha_s),
                           bandwidth_bytes_per_s=min(line.bandwidth_bytes_per_s))
        megatron = plan(model, inputs, one_d, BUDGET_BYTES, **A100,
                        strategy_filter=megatron_only if gpus > 1 else None)
        flops = 6 * BATCH * SEQ * sum(p.numel() for p in model.parameters())  # 6 N T
        rows.append((name, gpus, hidden, best, megatron, flops, paper))
    return rows


def main() -> None:
    logging.getLogger("automap").setLevel(logging.WARNING)
    warnings.simplefilter("ignore")
    print(f"{'id':6} {'GPUs':>4} {'hidden':>6} {'automap mesh':>13} {'automap TFLOP/s':>16} "
          f"{'Megatron TFLOP/s':>17} {'ours/Megatron':>14} {'paper':>6}")
    for name, gpus, hidden, ours, megatron, flops, paper in table3():
        a, b = flops / ours.predicted_step_s, flops / megatron.predicted_step_s
        print(f"{name:6} {gpus:4d} {hidden:6d} {'x'.join(map(str, ours.mesh.shape)):>13} "
              f"{a / 1e12:16.1f} {b / 1e12:17.1f} {a / b:14.2f} {paper:6.2f}")
    print("TFLOP/s: 6 x parameters x tokens / predicted step time (same cost model for both)")


if __name__ == "__main__":
    main()
