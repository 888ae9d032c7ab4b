"""The stage search's lower bound (issue 18, ``planner/pipeline_bound.py``):
the (stages, microbatches) pairs are searched best-first by a bound on their
step, and those whose bound is no better than a pipeline found are skipped.
The plan must be the one the exhaustive search (no bound) returns, and the
bound must be below the step of every pair searched. Meta tensors, no process
group."""

from __future__ import annotations

import pytest
import torch

import automap
from automap import DeviceMesh
from automap.planner import search
from automap.planner.pipeline_bound import step_lower_bound_s
from automap.planner.pipeline_mesh import cut_mesh
from automap.planner.pipeline_partition import schedule_step_s
from pipeline_plans import DeepMLP, mean_square_loss

SPEEDS = dict(flops_per_s=1e10, memory_bandwidth_bytes_per_s=1e11, op_overhead_s=1e-7)


def _gpt2(batch: int):
    """A 6-layer GPT-2 with a causal attention, planned depth-reduced (the
    bound counts the last traced block for every layer it stands for)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=64, n_head=4, vocab_size=256,
                                           n_positions=16))
        ids = torch.randint(0, 256, (batch, 16))
    return model, {"input_ids": ids, "labels": ids}, dict(reduce_depth=True)


def _mlp(batch: int):
    with torch.device("meta"):
        model, x = DeepMLP(256, 4), torch.randn(batch, 256)
    return model, (x,), dict(loss_fn=mean_square_loss)


def _plan(case, monkeypatch=None, exhaustive: bool = False, **options):
    model, inputs, extra = case
    if exhaustive:  # a bound of 0: every pair is searched before any is verified
        monkeypatch.setattr(search, "batch_work_s", lambda *args: 0.0)
    return automap.plan(model, inputs, DeviceMesh((4,)), pipeline="auto",
                        microbatches="auto", **extra, **{**SPEEDS, **options})


@pytest.mark.parametrize("case, options", [
    (lambda: _mlp(64), {}),  # compute-bound: the bound is close, pairs are pruned
    (lambda: _mlp(64), dict(op_overhead_s=1e-1)),  # kernel-bound: nothing is pruned
    (lambda: _gpt2(8), {}),
    (lambda: _gpt2(4), dict(memory_bandwidth_bytes_per_s=1e9)),  # microbatches of 1 sample
    (lambda: _gpt2(8), dict(schedule="interleaved")),  # bounded at the most chunks per rank
], ids=["mlp", "mlp-overheads", "gpt2", "gpt2-memory-bound", "gpt2-interleaved"])
def test_best_first_finds_the_exhaustive_plan(monkeypatch, case, options):
    found = _plan(case(), **options)
    with monkeypatch.context() as patched:
        every = _plan(case(), patched, exhaustive=True, **options)
    assert found.predicted_step_s == every.predicted_step_s
    assert found.pipeline == every.pipeline
    steps = {(c["stages"], c["microbatches"]): c["step_s"]
             for c in every.solver["pipeline_candidates"]}
    assert not any(c["pruned"] for c in every.solver["pipeline_candidates"])
    searched = [c for c in found.solver["pipeline_candidates"] if not c["pruned"]]
    pruned = [c for c in found.solver["pipeline_candidates"] if c["pruned"]]
    assert {(c["stages"], c["microbatches"]) for c in searched + pruned} == set(steps)
    best = min(s for s in steps.values() if s is not None)
    for c in searched:  # the same step as searched exhaustively, and above its bound
        assert c["step_s"] == steps[(c["stages"], c["microbatches"])]
        if c["step_s"] is not None:
            assert c["lower_bound_s"] <= c["step_s"]
    for c in pruned:  # skipped only where no better than the best pipeline
        assert c["lower_bound_s"] >= best and c["step_s"] is None
        exhaustive = steps[(c["stages"], c["microbatches"])]
        assert exhaustive is None or c["lower_bound_s"] <= exhaustive
    # The best pipeline is always searched (the bench prints it beside intra-op).
    assert min(c["step_s"] for c in searched if c["step_s"] is not None) == best


def test_compute_bound_pairs_are_pruned():
    plan = _plan(_mlp(64))
    pruned = {(c["stages"], c["microbatches"]) for c in plan.solver["pipeline_candidates"]
              if c["pruned"]}
    # The fewest microbatches per stage pay the largest bubble: skipped.
    assert (2, 2) in pruned and (4, 4) in pruned


def test_bound_is_the_schedule_at_even_stages():
    """``W / (M S)`` per microbatch over all stages, the largest at their mean;
    more chunks per rank only lower it (interleaved takes the most)."""
    stages = cut_mesh(DeviceMesh((2, 4)), 2)
    total = 8.0 / (4 * 4)
    assert step_lower_bound_s(8.0, stages, 4) == pytest.approx(
        schedule_step_s(total, total / 2, 4))
    assert step_lower_bound_s(8.0, stages, 4) == pytest.approx(8.0 / 8 * (4 + 1) / 4)
    assert step_lower_bound_s(8.0, stages, 4, virtual=2) < step_lower_bound_s(8.0, stages, 4)
    # Ranks sharing their compute: no faster than the whole work with all busy.
    assert step_lower_bound_s(8.0, stages, 4, shared_slowdown=100.0) == pytest.approx(8.0 / 8)
