"""Batch norm in training mode cannot be pipelined over several microbatches
(each would be normalised by its own statistics): an explicit pipeline is
refused before any search, ``pipeline="auto"`` plans intra-op only; and the
microbatch loss weights read from the graph (``generate/microbatch_loss.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import automap
from automap import DeviceMesh
from automap.errors import InvalidPipelineError
from automap.generate.microbatch_loss import microbatch_weights
from automap.trace.tracing import trace

SPEEDS = dict(flops_per_s=1e9, memory_bandwidth_bytes_per_s=1e12, op_overhead_s=1e-6)


def _normed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 16),
                          nn.Tanh(), nn.Linear(16, 4))
    return model, (torch.randn(8, 8),)


@pytest.mark.timeout(300)
def test_batch_norm_is_refused_in_an_explicit_pipeline_of_several_microbatches():
    model, inputs = _normed()
    for microbatches in (2, "auto"):
        with pytest.raises(InvalidPipelineError, match="batch statistics"):
            automap.plan(model, inputs, DeviceMesh((2,)), pipeline=2, microbatches=microbatches,
                         schedule="gpipe", **SPEEDS)


@pytest.mark.timeout(300)
def test_batch_norm_plans_intra_op_under_auto():
    model, inputs = _normed()
    plan = automap.plan(model, inputs, DeviceMesh((2,)), pipeline="auto", **SPEEDS)
    assert plan.pipeline is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("loss,kind", [
    (lambda out, y: F.mse_loss(out, y.float()), "mean"),
    (lambda out, y: F.mse_loss(out, y.float(), reduction="sum"), "sum"),
    (lambda out, y: out.sum(), "sum"),
    # A scaled sum may be a mean over the microbatch (its size is a constant).
    (lambda out, y: out.sum() / out.numel(), "mean"),
    (lambda out, y: F.cross_entropy(out, y.argmax(-1)), "counted"),
])
def test_the_loss_weights_follow_the_reduction(loss, kind):
    model = nn.Linear(4, 4)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8, 4))
    traced = trace(model, (x,), loss_fn=lambda out: loss(out, y))
    # The target is captured (a constant), not an input: counted needs inputs.
    expected = "mean" if kind == "counted" else kind
    assert microbatch_weights(traced).kind == expected


@pytest.mark.timeout(120)
def test_counted_weights_are_each_microbatchs_share_of_the_kept_targets():
    class Shifted(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 6)

        def forward(self, x, labels):
            logits = self.fc(x)[:, :-1].reshape(-1, 6)
            return F.cross_entropy(logits, labels[:, 1:].reshape(-1))

    x, labels = torch.randn(4, 5, 4), torch.randint(0, 6, (4, 5))
    labels[0, 1:] = -100  # microbatch 0: 0 + 4 kept; microbatch 1: 4 + 4
    weights = microbatch_weights(trace(Shifted(), (x[:2], labels[:2]), loss_fn=lambda v: v))
    assert weights.kind == "counted"
    assert weights([x, labels], 2) == pytest.approx([4 / 12, 8 / 12])
