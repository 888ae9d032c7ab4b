"""Issue 6, acceptance 5: the two-stage search (intra-op ILP on a ladder of
budgets: B and P / 1.25^n above it, P the fastest plan's peak; each solution
checkpointed by the rotor DP within B)
against each stage alone, by estimated step time under one cost model:

- ILP alone: the intra-op plan must fit B with every activation kept;
- checkpointing alone on a data-parallel plan: parameters replicated (the
  ILP picks the rest without a budget), the rotor DP makes it fit B;
- checkpointing alone on the fastest plan (``checkpointing="only"``);
- two-stage (``checkpointing="auto"``, the default within a budget).

Model: a wide, shallow GPT-2 (hidden 2048, 8 layers, 32 heads, vocabulary
8192, sequence 256, global batch 16; AdamW, fp32) on the meta device, on a
4-device mesh at 25 GB/s and 10 us per message, 100 TFLOP/s per device.
Wide layers make parameter memory large next to activations: data
parallelism must recompute a lot to fit, tensor parallelism alone
communicates a lot; sharding part of the model and checkpointing part of the
activations beats both.

    python benches/two_stage.py [fraction ...]   # budgets as fractions of the
                                                 # fastest plan's peak (0.9 0.8)
"""

from __future__ import annotations

import logging
import sys
import time
import warnings

import torch

from automap import DeviceMesh, InfeasibleBudgetError
from automap.planner.search import plan_traced
from automap.solve.strategies import parameters_whole
from automap.trace.profiling import profile_traced
from automap.trace.tracing import default_loss, trace

HIDDEN, LAYERS, SEQ, BATCH, VOCAB = 2048, 8, 256, 16, 8192
FLOPS_PER_S = 100e12


def traced_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    cfg = GPT2Config(n_layer=LAYERS, n_embd=HIDDEN, n_head=HIDDEN // 64, vocab_size=VOCAB,
                     n_positions=SEQ, bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
        ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    traced = trace(model, {"input_ids": ids, "labels": ids}, loss_fn=default_loss)
    return traced, profile_traced(traced)


def mesh() -> DeviceMesh:
    # gloo's collectives and this CPU's memory speeds wherever it runs (a GPU
    # in view would otherwise make the plans NCCL's: other optimizer kernels).
    return DeviceMesh((4,), alpha_s=[1e-5], bandwidth_bytes_per_s=[25e9], backend="gloo")


def compare(fractions=(0.9, 0.8)) -> list[dict]:
    """Per budget fraction: estimated step seconds of each search (inf when
    nothing fits), and planning seconds."""
    traced, profile = traced_model()
    options = {"flops_per_s": FLOPS_PER_S}
    fastest = plan_traced(traced, profile, mesh(), None, **options)
    searches = {
        "ilp_alone": {"checkpointing": "off"},
        "checkpointing_alone_dp": {"checkpointing": "only",
                                   "strategy_filter": parameters_whole},
        "checkpointing_alone_fastest": {"checkpointing": "only"},
        "two_stage": {"checkpointing": "auto"},
    }
    rows = []
    for fraction in fractions:
        budget = fraction * fastest.predicted_peak_memory_bytes
        row = {"fraction": fraction, "budget_bytes": budget,
               "unconstrained_step_s": fastest.predicted_step_s}
        for label, extra in searches.items():
            t0 = time.perf_counter()
            try:
                found = plan_traced(traced, profile, mesh(), budget, **options, **extra)
                row[label] = found.predicted_step_s
                if label == "two_stage":
                    row["two_stage_plan"] = found
            except InfeasibleBudgetError:
                row[label] = float("inf")
            row[label + "_planning_s"] = time.perf_counter() - t0
        rows.append(row)
    return rows


def main() -> None:
    fractions = [float(a) for a in sys.argv[1:]] or [0.9, 0.8]
    rows = compare(fractions)
    print(f"GPT-2 hidden {HIDDEN}, {LAYERS} layers, seq {SEQ}, batch {BATCH}, mesh (4,) at "
          f"25 GB/s; unconstrained step {rows[0]['unconstrained_step_s'] * 1e3:.2f} ms")
    labels = ("ilp_alone", "checkpointing_alone_dp", "checkpointing_alone_fastest", "two_stage")
    print(f"{'budget':>10} " + " ".join(f"{label:>28}" for label in labels))
    for row in rows:
        cells = " ".join(f"{row[k] * 1e3:>21.2f} ms ({row[k + '_planning_s']:.1f}s)"
                         for k in labels)
        print(f"{row['budget_bytes'] / 2**30:7.2f} GiB {cells}")
        plan = row.get("two_stage_plan")
        if plan is not None and plan.checkpoint is not None:
            ck = plan.checkpoint
            rung = ("unconstrained" if ck.ilp_budget_bytes is None
                    else f"{ck.ilp_budget_bytes / 2**30:.2f} GiB")
            print(f"{'':11}two-stage: sharding planned for {rung}, {ck.block_count()} checkpoint "
                  f"blocks, recomputation {ck.recompute_s * 1e3:.2f} ms, communication "
                  f"{plan.predicted_communication_s * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
