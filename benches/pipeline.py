"""Pipeline planning (issue 18): GPT-3-like models on clusters of N nodes x 8
devices, the cross-node links slow (25 GB/s) or fast (400 GB/s), planned on
the meta device (no weights, depth-reduced like ``plan_scale.py``) with
``pipeline="auto"``. One row per model x cluster x link: planning seconds (of
which the stage search: its submesh plans and DPs over every stage count),
the intra-op-only plan's predicted step, the best pipeline plan's (over the
stage counts > 1 that cut the mesh), and what the search chose.

    python benches/pipeline.py [--models gpt3-13b,gpt3-39b,gpt3-76b,gpt3-175b] [--nodes 2,4,8]
                               [--links slow,fast] [--microbatches 8] [--batch 16]
                               [--budget-gib 80] [--schedules 1f1b,interleaved] [--json]

``--schedules`` plans each row under every schedule named (``interleaved``:
the search also chooses the chunks per rank, shown as ``x v``), so 1F1B's and
interleaved 1F1B's predicted steps stand side by side. ``--microbatches auto``
lets the search choose the count per stage count ``n`` (the batch's divisors
from ``n`` to ``4 n``, each on its own trace; the pairs are searched
best-first by a lower bound on their step, and those no better than a
pipeline found are skipped: ``--json`` counts both); the pipeline column
names the best pipeline's ``M``.

What to expect (ARCHITECTURE.md, "Microbatches chosen by the search"): with
slow cross-node links the larger models (39B on 2x8, 76B on 2x8 and 4x8,
175B on 4x8; no plan of 175B fits 2x8) choose stages; GPT-3 13B (and 39B on
4x8) keeps intra-op with data
parallelism across the nodes, whose gradient all-reduce hides behind the
backward, where every pipeline pays its bubble. That is the cost model's
verdict, not a missed plan: the diagnosis there gives the terms.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import warnings

import torch

from automap import DeviceMesh, InfeasibleBudgetError
from automap.planner.search import plan
from meta_models import gpt2_lm, peak_rss_bytes

FLOPS_PER_S, MEMORY_BANDWIDTH, OP_OVERHEAD_S = 1e14, 1e12, 5e-6
#: Within a node (NVLink-class) and across nodes, slow or fast.
INTRA_NODE_ALPHA_S, INTRA_NODE_BANDWIDTH = 2e-6, 3e11
CROSS_NODE_ALPHA_S = 1e-5
CROSS_NODE_BANDWIDTH = {"slow": 2.5e10, "fast": 4e11}
DEVICES_PER_NODE = 8
#: GPT-3 family configs (Brown et al., table 2.1; 13B's width rounded to a
#: multiple of its heads) and two sizes between (Megatron-LM's 39B and 76B), bf16.
CONFIGS = {"gpt3-6.7b": dict(n_layer=32, n_embd=4096, n_head=32),
           "gpt3-13b": dict(n_layer=40, n_embd=5120, n_head=40),
           "gpt3-39b": dict(n_layer=48, n_embd=8192, n_head=64),
           "gpt3-76b": dict(n_layer=60, n_embd=10240, n_head=80),
           "gpt3-175b": dict(n_layer=96, n_embd=12288, n_head=96)}


def gpt3_like(name: str, batch: int, seq: int = 2048):
    return gpt2_lm(batch, seq, torch.bfloat16, vocab_size=50257, **CONFIGS[name])


def cluster_mesh(nodes: int, link: str) -> DeviceMesh:
    return DeviceMesh((nodes, DEVICES_PER_NODE), axis_names=("node", "device"),
                      alpha_s=[CROSS_NODE_ALPHA_S, INTRA_NODE_ALPHA_S],
                      bandwidth_bytes_per_s=[CROSS_NODE_BANDWIDTH[link], INTRA_NODE_BANDWIDTH])


def row(name: str, nodes: int, link: str, batch: int, microbatches: int | str,
        budget_bytes: float | None, schedule: str = "1f1b") -> dict:
    model, inputs = gpt3_like(name, batch)
    mesh = cluster_mesh(nodes, link)
    start = time.perf_counter()
    try:
        p = plan(model, inputs, mesh, budget_bytes, flops_per_s=FLOPS_PER_S,
                 memory_bandwidth_bytes_per_s=MEMORY_BANDWIDTH, op_overhead_s=OP_OVERHEAD_S,
                 reduce_depth=True, pipeline="auto", microbatches=microbatches,
                 schedule=schedule)
    except InfeasibleBudgetError as err:
        return {"model": name, "nodes": nodes, "link": link, "schedule": schedule,
                "error": str(err)[:120], "plan_s": time.perf_counter() - start}
    plan_s = time.perf_counter() - start
    candidates = [c for c in p.solver.get("pipeline_candidates", []) if c["step_s"] is not None]
    best_pipe = min(candidates, key=lambda c: c["step_s"], default=None)
    if p.pipeline is not None:
        intra = p.pipeline.intra_op_step_s
        chosen = (f"{p.pipeline.stage_count} stages of {tuple(p.pipeline.submesh_shape)}, "
                  f"M={p.pipeline.microbatches}"
                  + (f" x {p.pipeline.virtual_stages} chunks" if p.pipeline.virtual_stages > 1
                     else "") + f", peak {p.predicted_peak_memory_bytes / 2**30:.1f} GiB")
    else:
        intra = p.predicted_step_s
        chosen = f"intra-op only on {p.mesh.shape}, peak " \
                 f"{p.predicted_peak_memory_bytes / 2**30:.1f} GiB"
    return {"model": name, "nodes": nodes, "link": link, "schedule": schedule,
            "plan_s": plan_s,
            "stage_search_s": sum(c["search_s"] for c in p.solver.get("pipeline_candidates", [])),
            # (stages, microbatches) pairs searched, and skipped by their lower bound
            "pairs_searched": sum(not c.get("pruned") for c in p.solver.get("pipeline_candidates",
                                                                              [])),
            "pairs_pruned": sum(bool(c.get("pruned")) for c in p.solver.get("pipeline_candidates",
                                                                             [])),
            "intra_op_ms": None if intra is None else intra * 1e3,
            "pipeline_ms": None if best_pipe is None else best_pipe["step_s"] * 1e3,
            "pipeline_stages": None if best_pipe is None else
            f"{best_pipe['stages']}" + (f"x{best_pipe['virtual_stages']}"
                                        if (best_pipe.get("virtual_stages") or 1) > 1 else "")
            + f" M={best_pipe['microbatches']}",
            "stages": 1 if p.pipeline is None else p.pipeline.stage_count,
            "chosen": chosen, "rss_gib": peak_rss_bytes() / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt3-13b,gpt3-39b,gpt3-76b,gpt3-175b")
    parser.add_argument("--nodes", default="2,4,8")
    parser.add_argument("--links", default="slow,fast")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", default="8",
                        help="a count, or 'auto' (the search chooses among the batch's divisors "
                             "from n to 4 n per stage count n)")
    parser.add_argument("--budget-gib", type=float, default=80.0,
                        help="memory per device (0: no limit)")
    parser.add_argument("--schedules", default="1f1b",
                        help="comma-separated: 1f1b, gpipe, interleaved")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    microbatches = args.microbatches if args.microbatches == "auto" else int(args.microbatches)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    budget = args.budget_gib * 2**30 if args.budget_gib > 0 else None
    if not args.json:
        print(f"{'model':10} {'cluster':8} {'x-node':6} {'schedule':11} {'plan s':>7} "
              f"{'(stages s)':>10} "
              f"{'intra-op ms':>12} "
              f"{'pipeline ms':>12} {'(stages)':>10}  chosen", flush=True)
    for name in args.models.split(","):
        for nodes in (int(n) for n in args.nodes.split(",")):
            for link, schedule in ((lk, sc) for lk in args.links.split(",")
                                   for sc in args.schedules.split(",")):
                r = row(name, nodes, link, args.batch, microbatches, budget, schedule)
                if args.json:
                    print(json.dumps(r), flush=True)
                    continue
                cluster = f"{nodes}x{DEVICES_PER_NODE}"
                if "error" in r:
                    print(f"{name:10} {cluster:8} {link:6} {schedule:11} {r['plan_s']:7.1f} "
                          f"{r['error']}", flush=True)
                    continue

                def ms(v):
                    return f"{v:12.1f}" if v is not None else f"{'-':>12}"

                print(f"{name:10} {cluster:8} {link:6} {schedule:11} {r['plan_s']:7.1f} "
                      f"{r['stage_search_s']:10.1f} {ms(r['intra_op_ms'])} "
                      f"{ms(r['pipeline_ms'])} {str(r['pipeline_stages'] or '-'):>10}  "
                      f"{r['chosen']}", flush=True)


if __name__ == "__main__":
    main()
