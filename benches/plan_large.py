"""Planning-only runs for large models on an 8x8 mesh (8 nodes x 8 GPUs):
GPT-3 175B (96 layers, hidden 12288, 96 heads, seq 2048) and a Llama-70B
config, bf16 weights with fp32 AdamW state, 80 GB per device. Built on the
meta device: no weights, no process group. Prints time and peak RSS; the
issue's target for GPT-3 is <= 30 s and <= 2 GiB on a 2-core CPU
(meta-pytorch/autoparallel: 298 s and 18 GiB).

    python benches/plan_large.py [gpt3|llama70b ...] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings

from automap import DeviceMesh
from automap.planner.search import plan
from meta_models import gpt3, llama70b, peak_rss_bytes

# 8 nodes of 8 GPUs: NVLink inside a node (inner axis), InfiniBand across.
MESH = DeviceMesh((8, 8), axis_names=("node", "gpu"), alpha_s=[1e-5, 3e-6],
                  bandwidth_bytes_per_s=[2.5e10, 2.0e11])
BUDGET_BYTES = 80 * 10**9
#: An A100/H100-class device's sustained bf16 rate (about half of peak).
FLOPS_PER_S = 150e12
VERBOSE = "--verbose" in sys.argv



def run(name: str) -> dict:
    model, inputs = {"gpt3": gpt3, "llama70b": llama70b}[name]()
    start = time.perf_counter()
    p = plan(model, inputs, MESH, BUDGET_BYTES, flops_per_s=FLOPS_PER_S, reduce_depth=True,
             verbose=VERBOSE)
    seconds = time.perf_counter() - start
    # Weight operand of each matmul: linear(x, w, b), addmm(b, x, w) (GPT-2's Conv1D).
    weight_index = {"linear": 1, "addmm": 2}
    matmuls = [n for n in p.nodes.values() if n.op in weight_index and n.module_path]
    return {
        "model": name,
        "plan_s": seconds,
        "peak_rss_bytes": peak_rss_bytes(),
        "predicted_step_s": p.predicted_step_s,
        "predicted_peak_memory_bytes": p.predicted_peak_memory_bytes,
        "budget_bytes": BUDGET_BYTES,
        "solver": p.solver,
        # How the block's weights are split: spec per linear weight input.
        "weights": {n.module_path: n.inputs[weight_index[n.op]] for n in matmuls},
        "outputs": {n.module_path: n.outputs[0] for n in matmuls},
        "summary": p.summary(),
        "checkpoint": None if p.checkpoint is None else {
            "blocks": p.checkpoint.block_count(), "recompute_s": p.checkpoint.recompute_s,
            "stages": len(p.checkpoint.stages)},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*", default=["gpt3"])
    parser.add_argument("--json", action="store_true", help="one JSON line per model")
    parser.add_argument("--verbose", action="store_true", help="print the search's steps")
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    for name in args.models:
        result = run(name)
        if args.json:
            print(json.dumps(result))
        else:
            print(f"{name}: planned in {result['plan_s']:.1f} s, peak RSS "
                  f"{result['peak_rss_bytes'] / 2**30:.2f} GiB\n  {result['summary']}")
            for path, spec in result["weights"].items():
                print(f"  {path:40} weight {spec:6} output {result['outputs'][path]}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
