"""Planning time of GPT-2 (hidden 768, seq 1024, batch 8) on a 2x4 mesh.

Issue 4 (GPT-2 small, 12 layers, full graph): build <= 0.5 s, solve <= 1 s,
end to end <= 5 s (the original MAP code: 46 s build + 5.4 s solve;
meta-pytorch/autoparallel: 86 s end to end, 137 s for medium).
Issue 8 (depth-reduced planning, 12/24/48/96 layers): from 24 to 96 layers
the time must grow by less than 2x.

    python benches/plan_speed.py [--layers 12 24 48 96] [--full 12 24]
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings

import torch

from automap import DeviceMesh
from automap.planner.search import plan

MESH = DeviceMesh((2, 4), alpha_s=[2e-5, 5e-6], bandwidth_bytes_per_s=[2.5e10, 2e11])


def gpt2(layers: int, batch: int = 8, seq: int = 1024):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=768, n_head=12, n_positions=seq,
                        vocab_size=50257)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
        ids = torch.randint(0, config.vocab_size, (batch, seq))
    return model, {"input_ids": ids, "labels": ids}


def row(label: str, layers: int, reduce_depth: bool, tie_blocks: bool = True):
    model, inputs = gpt2(layers)
    start = time.perf_counter()
    p = plan(model, inputs, MESH, 40 * 2**30, reduce_depth=reduce_depth, tie_blocks=tie_blocks)
    total = time.perf_counter() - start
    s = p.solver
    print(f"{label:10} {layers:6d} {s['trace_s']:14.2f} {s['strategies_s'] + s['build_s']:9.2f} "
          f"{s['solve_s']:8.2f} {total:9.2f} {p.predicted_step_s * 1e3:12.3f} "
          f"{s['binaries']:9d} {s['edge_variables']:9d}")
    return total, p


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="*", default=[12, 24, 48, 96])
    parser.add_argument("--full", type=int, nargs="*", default=[12])
    parser.add_argument("--untied", type=int, nargs="*", default=[12, 24],
                        help="also plan these depths without tying (issue 8: within 2 %%)")
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    print(f"{'graph':10} {'layers':>6} {'trace+prof s':>14} {'build s':>9} {'solve s':>8} "
          f"{'total s':>9} {'step ms':>12} {'binaries':>9} {'edge vars':>9}")
    full = {n: row("full", n, False) for n in sorted(set(args.full) | set(args.untied))}
    untied = {n: row("untied", n, False, tie_blocks=False) for n in args.untied}
    reduced = {n: row("reduced", n, True) for n in args.layers}
    for n in sorted(set(full) & set(reduced)):
        a, b = full[n][1].predicted_step_s, reduced[n][1].predicted_step_s
        print(f"{n} layers: reduced-depth plan predicts {b * 1e3:.3f} ms vs full {a * 1e3:.3f} ms "
              f"({100 * (b / a - 1):+.2f} %)")
    for n in untied:
        a, b = untied[n][1].solver["objective_s"], full[n][1].solver["objective_s"]
        print(f"{n} layers: tied objective {b * 1e3:.3f} ms vs untied {a * 1e3:.3f} ms "
              f"({100 * (b / a - 1):+.2f} %, target within 2 %)")
    if 24 in reduced and 96 in reduced:
        print(f"planning time 24 -> 96 layers: x{reduced[96][0] / reduced[24][0]:.2f} "
              f"(target < 2)")


if __name__ == "__main__":
    main()
