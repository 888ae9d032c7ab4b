"""A pipelined step's loss and gradients are the whole batch's for losses that
are not a mean over equally many terms per microbatch: a sum-reduced loss
(came out divided by M), cross-entropy whose kept targets fall unevenly
across the microbatches (2.1522 against the serial 2.1230), with and without
class weights, a microbatch keeping none (NaN), and a loss returned first in
a tuple (2x: its default loss summed the scalar) (``generate/microbatch_loss.py``)."""

from __future__ import annotations

import pytest
import torch

import automap
from automap import DeviceMesh
from automap.launch import run_on_gloo
from pipeline_loss_workers import build, loss_fn_of, serial, step

pytestmark = pytest.mark.multiprocess

SPEEDS = dict(flops_per_s=1e9, memory_bandwidth_bytes_per_s=1e12, op_overhead_s=1e-6)
KINDS = ("sum", "ce", "ce_weighted", "ce_empty", "tuple", "tuple_sum")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pipeline_losses")
    cases = []
    for kind in KINDS:
        model, inputs = build(kind)
        plan = automap.plan(model, inputs, DeviceMesh((2,)), loss_fn=loss_fn_of(kind),
                            pipeline=2, microbatches=2, schedule="gpipe", **SPEEDS)
        assert plan.pipeline is not None and len(plan.pipeline.stages) == 2
        path = folder / f"{kind}.json"
        plan.to_json(path)
        cases.append((kind, str(path)))
    return run_on_gloo(step, 2, cases, timeout_s=300)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(len(KINDS)), ids=KINDS)
def test_the_pipelined_step_is_the_batchs(runs, index):
    loss, grads = serial(KINDS[index])
    for rank in runs:
        parallel_loss, parallel_grads = rank[index]
        assert abs(parallel_loss - loss) <= 1e-12 * abs(loss), (parallel_loss, loss)
    merged = {}
    for rank in runs:
        merged.update(rank[index][1])
    assert merged.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(merged[name], grad, rtol=1e-10, atol=1e-13)
