"""``automap.autoparallelize(..., pipeline=2)`` on 4 gloo ranks: the planner's
stages run as a PipelineModule that trains like the serial model with the usual
loop (float64, 3 AdamW steps, an MLP whose loss takes the targets as input)."""

from __future__ import annotations

import inspect
import os
import sys

import pytest

import automap
from automap.launch import run_on_gloo

pytestmark = pytest.mark.multiprocess
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "generate"))


@pytest.mark.skipif("pipeline" not in inspect.signature(automap.plan).parameters,
                    reason="automap.plan has no pipeline search yet")
@pytest.mark.timeout(300)
def test_autoparallelize_runs_the_planned_pipeline():
    from pipeline_api_workers import train_autoparallelized

    results = run_on_gloo(train_autoparallelized, 4, "mlp", 2, 2, "gpipe", timeout_s=240)
    for row in results:
        assert row["type"] == "PipelineModule" and row["stages"] == 2, row
        assert row["rel_loss"] <= 1e-12 and row["rel_param"] <= 1e-10, row
    assert set().union(*(r["params"] for r in results)) == {
        f"{layer}.{kind}" for layer in ("fc1", "fc2", "fc3", "head") for kind in ("weight",
                                                                                   "bias")}
