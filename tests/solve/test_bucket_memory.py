"""The memory model places data-parallel gradient buckets where the program
makes them (issue 14, points 1 and 3).

``generate/grad_sync.py`` copies a bucket's gradients into one flat tensor once
its last gradient is ready and frees it at the end of the backward; a tied or
gathered parameter read converted is reduced in the graph, without a bucket.
The model counted a bucket copy per reader from each reader's backward on:
on benches/trust.py's GPT-2 the tied LM head's 2 MiB for the whole backward.
The plain plan's peak (start of the backward) hid it; the rotor chain, fitted
to the model's backward inside every layer, carried it into each checkpointed
plan (modelled 32.37 MiB against 30.34 simulated at the least budget)."""

from __future__ import annotations

import pytest
import torch

import model_zoo
from automap import DeviceMesh
from automap.checkpoint.chain import choice_of_plan
from automap.planner.search import plan
from automap.solve.gradient_buckets import gradient_buckets
from automap.solve.memory import plan_memory, timeline
from automap.solve.strategies import build_strategy_table
from automap.trace.profiling import profile_traced
from automap.trace.tracing import default_loss, trace

SPEEDS = dict(flops_per_s=1e10, memory_bandwidth_bytes_per_s=1e10, op_overhead_s=2e-5)


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    model = model_zoo.dropout_free_gpt2_lm(4, 256, 4, 2048, 128)
    ids = torch.randint(0, 2048, (16, 128), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}


def test_each_bucket_is_counted_once_where_its_last_gradient_is_ready(gpt2):
    model, inputs = gpt2
    mesh = DeviceMesh((4,))
    found = plan(model, inputs, mesh, loss_fn=default_loss, verify=False, **SPEEDS)
    traced = trace(model, inputs, loss_fn=default_loss)
    table = build_strategy_table(traced, profile_traced(traced, "adamw"), mesh, **SPEEDS)
    choice = choice_of_plan(table, found)
    line = timeline(table)
    buckets, first_use = gradient_buckets(table, choice)
    assert buckets, "no data-parallel gradients: pick another plan"
    memory = plan_memory(table, choice, line)
    # Every bucket copy at most once; positions where no bucket completes hold
    # no bucket bytes of deferred parameters.
    ready = {min(line.position[first_use[p]] for p in b.params) for b in buckets}
    assert memory.buckets.sum() <= sum(b.nbytes for b in buckets) + 1e-6
    for i, nbytes in enumerate(memory.buckets):
        assert i in ready or nbytes <= 1e-6, line.order[i]


@pytest.mark.timeout(300)
def test_a_checkpointed_gpt2_plan_is_modelled_as_its_step_allocates(gpt2):
    model, inputs = gpt2
    mesh = DeviceMesh((4,))
    free = plan(model, inputs, mesh, loss_fn=default_loss, **SPEEDS)
    found = plan(model, inputs, mesh, 0.35 * free.predicted_peak_memory_bytes,
                 loss_fn=default_loss, checkpointing="auto", **SPEEDS)
    assert found.checkpoint is not None and found.checkpoint.block_count() >= 2
    # 33.61 MB modelled, 33.15 simulated (+1.4 %, over): the LM head's share of
    # the tied embedding's gradient (0.5 MiB, held from the head's backward, as
    # the simulated step holds it) is now counted; the rotor's whole-stage view
    # over-counts about as much elsewhere, which its absence hid (-0.2 % before).
    assert found.solver["modelled_peak_bytes"] == pytest.approx(
        found.predicted_peak_memory_bytes, rel=0.02)
    assert found.solver["modelled_peak_bytes"] >= found.predicted_peak_memory_bytes * 0.995
