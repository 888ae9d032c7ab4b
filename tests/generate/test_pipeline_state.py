"""A pipelined module's ``state_dict()`` has the user model's names (each rank
its stage's entries, DTensors on the stage's submesh; it had the chunks'
attribute paths, ``chunks.0.0.weight``), the interleaved schedule's included
(its per-chunk torch meshes were made by each stage's ranks alone, and the
call hung), and ``load_state_dict`` takes a serial model's state dict."""

from __future__ import annotations

import pytest
import torch

import automap
from automap import DeviceMesh
from automap.launch import run_on_gloo
from pipeline_state_workers import build, state_round_trip

pytestmark = pytest.mark.multiprocess

SPEEDS = dict(flops_per_s=1e9, memory_bandwidth_bytes_per_s=1e12, op_overhead_s=1e-6)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule", ["interleaved", "1f1b"])
def test_a_pipelined_state_dict_has_the_users_names(tmp_path, schedule):
    model, inputs = build()
    plan = automap.plan(model, inputs, DeviceMesh((4,)), pipeline=2, microbatches=4,
                        schedule=schedule, **SPEEDS)
    path = tmp_path / "plan.json"
    plan.to_json(path)
    results = run_on_gloo(state_round_trip, 4, str(path), timeout_s=300)
    serial = model.state_dict()
    assert set().union(*(r["keys"] for r in results)) == set(serial)
    for r in results:
        for key, value in r["whole"].items():
            torch.testing.assert_close(value, serial[key], rtol=0, atol=0)
        assert r["loaded"].keys() == r["other"].keys() and r["loaded"]
        for key, value in r["loaded"].items():
            torch.testing.assert_close(value, r["other"][key], rtol=0, atol=0)
