"""Data-parallel gradient synchronisation: bucketed asynchronous all-reduce
(``GradientSync``) against one in-graph all-reduce per parameter use, on 4 gloo
ranks of this machine, for the demo's tiny GPT-2 under a pure data-parallel plan.
Prints the median training-step time of each and the ratio.

    python benches/grad_sync.py
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "support"))

STEPS, WARMUP = 12, 3
SETTINGS = {"in-graph, per use": None, "buckets of 64 KiB": 64 * 2**10,
            "buckets of 25 MiB": 25 * 2**20}


def _batch_only(ins, outs) -> bool:
    return all(re.fullmatch(r"(S0)?R*", spec) for spec in (*ins, *outs))


def _rank_main(rank: int, world: int) -> dict:
    from automap import DeviceMesh
    from automap.cli.demo import TinyGPT2, _batch
    from automap.generate.program import generate
    from automap.trace.tracing import trace
    from forced_plans import forced_plan

    torch.manual_seed(0)
    model = TinyGPT2()
    mesh = DeviceMesh((world,))
    ids, labels = _batch(0)
    # Pure data parallelism: every tensor split on its first (batch) dim or whole.
    ops = {n.name: _batch_only for n in trace(model, (ids, labels)).graph.nodes
           if n.op == "call_function"}
    traced, plan = forced_plan(model, (ids, labels), None, mesh, params={},
                               inputs={"args_0": "S0R", "args_1": "S0R"}, ops=ops)
    groups = mesh.process_groups()
    out = {}
    for label, bucket_bytes in SETTINGS.items():
        module = generate(traced, plan, model, groups, grad_bucket_bytes=bucket_bytes)
        opt = torch.optim.SGD(module.parameters(), lr=1e-3)
        times = []
        for _ in range(STEPS + WARMUP):
            torch.distributed.barrier()
            start = time.perf_counter()
            module(ids, labels).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        collectives = module.code.count("identity_all_reduce_grad(")
        out[label] = (statistics.median(times[WARMUP:]), collectives,
                      len(module.gradient_sync.buckets))
    return out


def main() -> None:
    from automap.launch import run_on_gloo

    results = run_on_gloo(_rank_main, 4, timeout_s=600)
    base = max(r["in-graph, per use"][0] for r in results)
    for label in SETTINGS:
        step_s = max(r[label][0] for r in results)
        _, in_graph, buckets = results[0][label]
        print(f"{label:20} step {step_s * 1e3:7.2f} ms  ({in_graph} in-graph all-reduces, "
              f"{buckets} buckets)  speed-up x{base / step_s:.2f}")


if __name__ == "__main__":
    main()
