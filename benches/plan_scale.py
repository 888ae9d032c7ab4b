"""Planning at scale (issue 15): GPT-2 (small, medium), GPT-3 175B and a
Llama-7B config (both planned depth-reduced) on 3-D and 2-D meshes under budgets
of 1.0x, 0.5x and 0.3x the unconstrained plan's peak, checkpointing auto,
on the meta device (no weights). One row per model x mesh x budget: trace,
strategy-table and solve seconds, total seconds, binaries, edge variables,
predicted step time, the ILP's gap to its LP bound, peak RSS; with
``--reduced`` the same rows again with the reduction stage's multi-input
followers (``reduce_formulation=True``, see ``automap.solve.reduce``) and
the ratios reduced/default of total time and of predicted step time; with ``--exact``
the same rows again with every budgeted ILP solved by branch and bound (the
formulation before LP dives, ``exact_columns=inf``); with ``--whole`` the
same rows again without the search's second family, plans with every parameter
whole (``search.SEARCH_WHOLE_PARAMETERS=False``, the search before stop 28), and
the ratios default/without of total time and of predicted step time; with
``--pairs`` the same rows again with one ILP column per (producer spec,
consumer spec) pair on every edge (``ilp.EDGE_FORMULATION="pairs"``, the
formulation before flow edges) and the ratios default/pairs of total time, edge
variables and predicted step time; with ``--flow-memory`` the same rows again
with flow edges under budgets too (``"flow-memory"``) and the ratios
flow-memory/default.

    python benches/plan_scale.py [--models gpt2,gpt2-medium,gpt3,llama7b] [--meshes 2x2x2,2x4]
                                 [--budgets 1.0,0.5,0.3] [--reduced] [--exact] [--whole]
                                 [--pairs] [--flow-memory] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
import warnings

from automap import DeviceMesh, InfeasibleBudgetError, SolverTimeLimitError
from automap.planner import search
from automap.planner.search import plan
from automap.solve import ilp
from meta_models import gpt2_lm, gpt3, llama7b, peak_rss_bytes

FLOPS_PER_S, MEMORY_BANDWIDTH, OP_OVERHEAD_S = 1e14, 1e12, 5e-6
#: Per mesh axis, outermost first: across nodes, within a node, within a board.
ALPHA_S, BANDWIDTH = [1e-5, 5e-6, 2e-6], [2.5e10, 1e11, 2e11]
CONFIGS = {"gpt2": dict(n_layer=12, n_embd=768, n_head=12),
           "gpt2-medium": dict(n_layer=24, n_embd=1024, n_head=16)}


def gpt2(name: str, batch: int = 8, seq: int = 1024):
    return gpt2_lm(batch, seq, **CONFIGS[name])


#: name -> (builder, plan depth-reduced)
MODELS = {"gpt2": (lambda: gpt2("gpt2"), False),
          "gpt2-medium": (lambda: gpt2("gpt2-medium"), False),
          "gpt3": (gpt3, True), "llama7b": (llama7b, True)}


def mesh_of(text: str) -> DeviceMesh:
    shape = tuple(int(s) for s in text.split("x"))
    return DeviceMesh(shape, alpha_s=ALPHA_S[-len(shape):],
                      bandwidth_bytes_per_s=BANDWIDTH[-len(shape):])


def row(model, inputs, mesh, budget, kind: str, reduce_depth: bool) -> dict:
    """One plan; ``kind``: "new" (the default formulation), "reduced"
    (multi-input followers), "exact" (branch and bound under every budget),
    "whole" (the default without the whole-parameter family), "pairs" (a
    column per spec pair on every edge) or "flow_memory" (flow edges under
    budgets too)."""
    start = time.perf_counter()
    options = dict(flops_per_s=FLOPS_PER_S, memory_bandwidth_bytes_per_s=MEMORY_BANDWIDTH,
                   op_overhead_s=OP_OVERHEAD_S, reduce_depth=reduce_depth)
    if kind == "exact":
        options["exact_columns"] = math.inf
    if kind == "reduced":
        options["reduce_formulation"] = True
    search.SEARCH_WHOLE_PARAMETERS = kind != "whole"
    ilp.EDGE_FORMULATION = {"pairs": "pairs", "flow_memory": "flow-memory"}.get(kind, "flow")
    try:
        p = plan(model, inputs, mesh, budget, **options)
    except (InfeasibleBudgetError, SolverTimeLimitError) as err:
        return {"error": type(err).__name__, "total_s": time.perf_counter() - start}
    finally:
        search.SEARCH_WHOLE_PARAMETERS = True
        ilp.EDGE_FORMULATION = "flow"
    s = p.solver
    return {"total_s": time.perf_counter() - start, "trace_s": s["trace_s"],
            "strategies_s": s["strategies_s"], "solve_s": s["solve_s"],
            "binaries": s["binaries"], "edge_variables": s["edge_variables"],
            "step_ms": p.predicted_step_s * 1e3, "gap": s["gap"],
            "peak_gib": p.predicted_peak_memory_bytes / 2**30,
            "checkpoint_blocks": 0 if p.checkpoint is None else p.checkpoint.block_count()}


def _both(a: dict | None, b: dict | None) -> bool:
    """Both rows ran and planned."""
    return a is not None and b is not None and "error" not in a and "error" not in b


def _untraced(r: dict) -> float:
    return r["total_s"] - r["trace_s"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt2")
    parser.add_argument("--meshes", default="2x2x2,2x4,2x2x4")
    parser.add_argument("--budgets", default="1.0,0.5,0.3")
    parser.add_argument("--reduced", action="store_true",
                        help="also plan with the reduction stage's multi-input followers")
    parser.add_argument("--exact", action="store_true",
                        help="also solve every budgeted ILP by branch and bound")
    parser.add_argument("--whole", action="store_true",
                        help="also plan without the search's whole-parameter family")
    parser.add_argument("--pairs", action="store_true",
                        help="also plan with a column per spec pair on every edge")
    parser.add_argument("--flow-memory", action="store_true",
                        help="also plan with flow edges under budgets too")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    for name in args.models.split(","):
        build, reduce_depth = MODELS[name]
        model, inputs = build()
        for mesh_text in args.meshes.split(","):
            mesh = mesh_of(mesh_text)
            free = plan(model, inputs, mesh, None, flops_per_s=FLOPS_PER_S,
                        memory_bandwidth_bytes_per_s=MEMORY_BANDWIDTH,
                        op_overhead_s=OP_OVERHEAD_S, reduce_depth=reduce_depth)
            for fraction in (float(b) for b in args.budgets.split(",")):
                budget = fraction * free.predicted_peak_memory_bytes
                result = {"model": name, "mesh": mesh_text, "budget_x": fraction,
                          "new": row(model, inputs, mesh, budget, "new", reduce_depth)}
                for kind in ("reduced", "exact", "whole", "pairs", "flow_memory"):
                    if getattr(args, kind):
                        result[kind] = row(model, inputs, mesh, budget, kind, reduce_depth)
                result["peak_rss_gib"] = peak_rss_bytes() / 2**30
                if args.json:
                    print(json.dumps(result), flush=True)
                    continue
                for kind in ("new", "reduced", "exact", "whole", "pairs", "flow_memory"):
                    r = result.get(kind)
                    if r is None:
                        continue
                    if "error" in r:
                        print(f"{name:12} {mesh_text:6} {fraction:4.2f}x {kind:7} "
                              f"{r['error']} after {r['total_s']:.1f} s", flush=True)
                        continue
                    print(f"{name:12} {mesh_text:6} {fraction:4.2f}x {kind:7} "
                          f"total {r['total_s']:6.1f} s (trace {r['trace_s']:.1f}, strategies "
                          f"{r['strategies_s']:.1f}, last ILP {r['solve_s']:.1f}) "
                          f"bin {r['binaries']:5} edge vars {r['edge_variables']:7} "
                          f"step {r['step_ms']:7.2f} ms gap {r['gap']:.3f} peak "
                          f"{r['peak_gib']:.2f} GiB ckpt {r['checkpoint_blocks']} "
                          f"RSS {result['peak_rss_gib']:.2f} GiB", flush=True)
                old, exact = result["new"], result.get("exact")
                head = f"{name:12} {mesh_text:6} {fraction:4.2f}x"
                if _both(exact, old):
                    print(f"{head} new/exact: step {old['step_ms'] / exact['step_ms']:.4f}x "
                          f"(exact's own gap to its bound {exact['gap']:.4f}), total "
                          f"{old['total_s'] / exact['total_s']:.2f}x", flush=True)
                # (label, numerator, denominator) of the other comparisons.
                for label, a, b in (("new/without whole", old, result.get("whole")),
                                    ("new/pairs", old, result.get("pairs")),
                                    ("flow-memory/new", result.get("flow_memory"), old),
                                    ("reduced/new", result.get("reduced"), old)):
                    if _both(a, b):
                        print(f"{head} {label}: total {a['total_s'] / b['total_s']:.2f}x "
                              f"(after tracing {_untraced(a) / _untraced(b):.2f}x), edge vars "
                              f"{a['edge_variables'] / max(b['edge_variables'], 1):.3f}x, step "
                              f"{a['step_ms'] / b['step_ms']:.4f}x", flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
