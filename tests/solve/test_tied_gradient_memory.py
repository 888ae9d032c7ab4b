"""Issue 14, point 1: a tied weight's gradient is held from its first read's
backward. Autograd sums the gradients of every read of a tied weight before
it accumulates them (GPT-2's LM head reads the token embedding): the head's
share exists from the head's backward, at the start of the backward, not from
the embedding's, at its end. The model counted it from the embedding's
backward: the model matrix's GPT-2 on (2, 2, 2) modelled 641.8 KiB where its
simulated step holds 653.6 KiB (-1.8 %), the head's share (16 KiB) missing
at the peak. Now 653.7 KiB."""

from __future__ import annotations

import pytest

from automap import DeviceMesh
from automap.planner.search import plan
from automap.solve.memory import timeline
from automap.solve.strategies import build_strategy_table
from automap.trace.profiling import profile_traced
from automap.trace.tracing import trace
from model_matrix import build

SPEEDS = dict(flops_per_s=1e12, memory_bandwidth_bytes_per_s=1e11, op_overhead_s=1e-5)


@pytest.mark.timeout(300)
def test_a_tied_weights_gradient_is_counted_from_its_first_reads_backward():
    model, inputs, loss_fn = build("gpt2")
    traced = trace(model, inputs, loss_fn=loss_fn)
    mesh = DeviceMesh((2, 2, 2))
    table = build_strategy_table(traced, profile_traced(traced, "adamw"), mesh, **SPEEDS)
    tied = {name: node.tied_to for name, node in table.nodes.items() if node.tied_to}
    assert tied, "no tied weight in the model: pick another"
    line = timeline(table)
    for placeholder, canonical in tied.items():
        readers = [line.position[c] for p, _, c, _ in table.edges()
                   if p in (placeholder, canonical) and c in line.position]
        assert line.grad_position[canonical] == max(readers)
    found = plan(model, inputs, mesh, loss_fn=loss_fn, **SPEEDS)
    modelled = found.solver["modelled_peak_bytes"]
    assert modelled == pytest.approx(found.predicted_peak_memory_bytes, rel=0.005)
