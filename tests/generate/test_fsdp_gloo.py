"""Issue 19, point 4: sharded data parallelism (FSDP/ZeRO-3). Parameters stored
split over the axes that split the batch, gathered for their use by
``gather_shard`` (backward: reduce-scatter into the shard), train like the
serial model on 4 gloo ranks: on (4,) over the one axis, on (2,2) over both
axes and (hybrid) over axis 0 with the rest all-reduced on the shard."""

from __future__ import annotations

import pytest

from automap import DeviceMesh
from automap.launch import run_on_gloo
from generate_workers import train_cases
from test_generate_gloo import _report

pytestmark = pytest.mark.multiprocess

CASES = {(4,): ["fsdp"], (2, 2): ["fsdp", "fsdp_hybrid"]}


@pytest.mark.parametrize("mesh_shape", sorted(CASES))
@pytest.mark.timeout(400)
def test_sharded_data_parallel_trains_like_serial(mesh_shape):
    mesh = DeviceMesh(mesh_shape)
    cases = [{"model": "mlp", "mesh": mesh.to_dict(), "plan": p} for p in CASES[mesh_shape]]
    results = run_on_gloo(train_cases, mesh.size, cases, timeout_s=300)
    failures = _report(mesh_shape, results)
    for case in results[0]:
        # Every parameter is gathered by the fused op: no plain all-gather,
        # split or gradient all-reduce of a weight runs in the graph.
        assert case["code"].count("gather_shard(") >= 5, case["code"]
    assert not failures, "\n".join(failures)
