"""Collectives over several mesh axes priced as the algorithm that runs
(issue 14, point 5): GPT-2 small (transformers' GPT2Config defaults, seq 1024,
batch 8, on the meta device) planned on a 2x4 mesh with a slow axis 0 (20 us,
25 GB/s) and a fast axis 1 (5 us, 200 GB/s), AdamW, no memory budget.

For three plans it prints the predicted step time (compute + communication)
and the bytes each mesh axis carries per step (``collective_bytes_per_axis``):
the planner's plan; the best plan that leaves axis 0 idle (what the planner
chose while a collective over both axes was priced as one ring at the slow
axis's pace); and 8-way data parallelism (batch split over both axes). Then
how the largest gradient all-reduce over both axes runs.

Before this change (one flat ring per collective over several axes, commit
a87ac9f, same settings, bytes counted the same way with every collective flat):

    plan                     step ms   compute      comm  axis 0 GB  axis 1 GB
    planner's choice           22.10     17.50      4.60      0.000      0.766
    8-way data parallel        46.98      8.75     38.23      0.874      0.895

    python benches/hierarchical_collectives.py [--layers 12]
"""

from __future__ import annotations

import argparse
import logging
import re
import warnings

import torch

from automap import DeviceMesh
from automap.planner.search import plan
from automap.planner.traffic import collective_bytes_per_axis

MESH = DeviceMesh((2, 4), alpha_s=[2e-5, 5e-6], bandwidth_bytes_per_s=[2.5e10, 2e11])


def gpt2_small(layers: int = 12, batch: int = 8, seq: int = 1024):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
        ids = torch.randint(0, config.vocab_size, (batch, seq))
    return model, {"input_ids": ids, "labels": ids}


def _specs(node, i):
    return (*node.in_specs[i], *node.out_specs[i])


def fast_axis_only(table, node):
    """Strategies that leave axis 0 idle (no spec names it)."""
    return [all("0" not in s for s in _specs(node, i)) for i in range(len(node))]


def data_parallel(table, node):
    """Batch split over both axes; parameters (stored and used) and everything
    else whole."""
    pattern = r"R*" if node.kind == "parameter" else r"(S01)?R*"
    return [all(re.fullmatch(pattern, s) for s in _specs(node, i)) for i in range(len(node))]


PLANS = {"planner's choice": None, "axis 0 idle": fast_axis_only,
         "8-way data parallel": data_parallel}


def plans(layers: int = 12, which=PLANS):
    model, inputs = gpt2_small(layers)
    return {label: plan(model, inputs, MESH, strategy_filter=PLANS[label]) for label in which}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    print(f"GPT-2 ({args.layers} layers), seq 1024, batch 8, mesh {MESH.shape}, "
          f"alpha {list(MESH.alpha_s)} s, bandwidth {list(MESH.bandwidth_bytes_per_s)} B/s")
    print(f"{'plan':22} {'step ms':>9} {'compute':>9} {'comm':>9} {'axis 0 GB':>10} "
          f"{'axis 1 GB':>10}")
    found = plans(args.layers)
    for label, p in found.items():
        per_axis = collective_bytes_per_axis(p)
        print(f"{label:22} {p.predicted_step_s * 1e3:9.2f} {p.predicted_compute_s * 1e3:9.2f} "
              f"{p.predicted_communication_s * 1e3:9.2f} {per_axis[0] / 1e9:10.3f} "
              f"{per_axis[1] / 1e9:10.3f}")
    best, idle = found["planner's choice"], found["axis 0 idle"]
    print(f"planner's choice vs axis 0 idle: x{idle.predicted_step_s / best.predicted_step_s:.2f} "
          f"faster")
    model, _ = gpt2_small(args.layers)
    grad_bytes = 4 * sum(p.numel() for p in model.parameters())
    algo = MESH.collective_plan("all_reduce", grad_bytes, (0, 1))
    # One ring over all 8 devices at axis 0's pace, as every such collective was priced before.
    ring_s = 2 * 7 / 8 * grad_bytes / MESH.bandwidth_bytes_per_s[0] + MESH.alpha_s[0]
    print(f"all-reduce of all {grad_bytes / 1e6:.0f} MB of gradients over both axes: "
          f"{algo.cost_s * 1e3:.2f} ms by "
          + ", ".join(f"{s.kind} {s.axes} {s.nbytes / 1e6:.1f} MB" for s in algo.steps)
          + f" (one ring: {ring_s * 1e3:.2f} ms)")

if __name__ == "__main__":
    main()
