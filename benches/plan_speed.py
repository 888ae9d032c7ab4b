"""Planning time of GPT-2 small (12 layers, seq 1024, batch 8) and medium
(24 layers) on a 2x4 mesh: trace + profile, strategies + resharding costs
(the ILP build), and the solve. Issue 4's targets for small: build <= 0.5 s,
solve <= 1 s, end to end <= 5 s (the original MAP code: 46 s build + 5.4 s
solve; meta-pytorch/autoparallel: 86 s end to end, 137 s for medium).

    python benches/plan_speed.py [--layers 12 24]
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings

import torch
from automap import DeviceMesh
from automap.planner import plan_traced
from automap.profiling import profile_traced
from automap.tracing import default_loss, trace


def gpt2(layers: int, batch: int = 8, seq: int = 1024):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=768, n_head=12, n_positions=seq,
                        vocab_size=50257)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
        ids = torch.randint(0, config.vocab_size, (batch, seq))
    return model, {"input_ids": ids, "labels": ids}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[12])
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    mesh = DeviceMesh((2, 4), alpha_s=[2e-5, 5e-6], bandwidth_bytes_per_s=[2.5e10, 2e11])
    print(f"{'model':14} {'trace+profile s':>16} {'strategies+ILP build s':>23} "
          f"{'solve s':>8} {'end to end s':>13}  plan")
    for layers in args.layers:
        model, inputs = gpt2(layers)
        start = time.perf_counter()
        traced = trace(model, inputs, loss_fn=default_loss)
        profile = profile_traced(traced)
        traced_s = time.perf_counter() - start
        p = plan_traced(traced, profile, mesh, 40 * 2**30, trace_s=traced_s)
        total = time.perf_counter() - start
        build = p.solver["strategies_s"] + p.solver["build_s"]
        print(f"GPT-2 {layers:2d} layers {traced_s:16.2f} {build:23.2f} "
              f"{p.solver['solve_s']:8.2f} {total:13.2f}  {p.summary()[:60]}")
        print(f"   binaries {p.solver['binaries']}, edge variables {p.solver['edge_variables']}, "
              f"rows {p.solver['rows']}, status {p.solver['status']}")


if __name__ == "__main__":
    main()
