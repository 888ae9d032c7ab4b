"""Issue 19, point 4: sharded data parallelism (FSDP/ZeRO-3). Parameters stored
split over the axes that split the batch, gathered for their use by
``gather_shard`` (backward: reduce-scatter into the shard), train like the
serial model on 4 gloo ranks: forced on (4,) over the one axis, on (2,2) over
both axes and (hybrid) over axis 0 with the rest all-reduced on the shard, and
chosen by the planner within a budget the data-parallel plan exceeds. The
plans' simulated peaks are what the ranks measure."""

from __future__ import annotations

import pytest

from automap import DeviceMesh
from automap.launch import run_on_gloo
from fsdp_workers import measure_cases
from generate_workers import train_cases
from test_generate_gloo import _report

pytestmark = pytest.mark.multiprocess

CASES = {(4,): [("mlp", "fsdp"), ("gpt2", "fsdp_budget")],
         (2, 2): [("mlp", "fsdp"), ("mlp", "fsdp_hybrid")]}


@pytest.mark.parametrize("mesh_shape", sorted(CASES))
@pytest.mark.timeout(400)
def test_sharded_data_parallel_trains_like_serial(mesh_shape):
    mesh = DeviceMesh(mesh_shape)
    cases = [{"model": m, "mesh": mesh.to_dict(), "plan": p} for m, p in CASES[mesh_shape]]
    results = run_on_gloo(train_cases, mesh.size, cases, timeout_s=300)
    failures = _report(mesh_shape, results)
    for case in results[0]:
        # The fused op gathers the parameters (forced: all five of them; the
        # budget's plan: some of them).
        uses = case["code"].count("gather_shard(")
        assert uses >= (5 if case["case"]["plan"] != "fsdp_budget" else 1), case["code"]
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(400)
def test_sharded_data_parallel_simulated_peak_is_measured():
    mesh = DeviceMesh((4,))
    cases = [{"model": m, "mesh": mesh.to_dict(), "plan": p}
             for m, p in (("mlp", "fsdp"), ("gpt2", "fsdp_budget"), ("mlp", "dp"))]
    results = run_on_gloo(measure_cases, mesh.size, cases, timeout_s=300)
    for i, case in enumerate(results[0]):
        peaks = sorted(r[i]["peak_bytes"] for r in results)
        simulated = case["simulated_bytes"]
        print(f"{case['case']['plan']}: measured {peaks}, simulated {simulated}, modelled "
              f"{case['modelled_bytes']}, budget {case['budget_bytes']}")
        assert abs(peaks[len(peaks) // 2] - simulated) <= 0.02 * simulated, (case["case"], peaks)
        if case["budget_bytes"] is not None:
            assert "gather_shard(" in case["code"]
            assert peaks[len(peaks) // 2] <= case["budget_bytes"]
