"""Collectives over several mesh axes run the algorithm their price assumed
(issue 14, point 5): on 4 gloo ranks, the process-group calls each collective
makes are the steps of ``DeviceMesh.collective_plan``, and its values are those
of one flat call on the whole group."""

from __future__ import annotations

import pytest

from automap import DeviceMesh
from automap.launch import run_on_gloo
from sharding_workers import check_collective_algorithms

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(300)
def test_executed_steps_are_the_priced_steps():
    meshes = [
        # Slow axis 0, fast axis 1, shuffled ranks: 512 B run flat, 8 MiB per axis.
        DeviceMesh((2, 2), ranks=[2, 0, 3, 1], alpha_s=[2e-5, 5e-6],
                   bandwidth_bytes_per_s=[2.5e10, 2e11]),
        # A size-1 axis in between, fast axis first.
        DeviceMesh((2, 1, 2), alpha_s=[1e-6, 1e-6, 1e-5],
                   bandwidth_bytes_per_s=[1e11, 1e11, 1e10]),
        # Equal links: always one flat call.
        DeviceMesh((2, 2)),
        # Latency on the fast axis: 100 KiB all-reduce along each axis in turn.
        DeviceMesh((2, 2), alpha_s=[1e-5, 1e-4], bandwidth_bytes_per_s=[1e9, 1e10]),
        # Priced as gloo runs a reduce-scatter (an all-reduce): the choice follows.
        DeviceMesh((2, 2), ranks=[2, 0, 3, 1], alpha_s=[2e-5, 5e-6],
                   bandwidth_bytes_per_s=[2.5e10, 2e11], backend="gloo"),
    ]
    results = run_on_gloo(check_collective_algorithms, 4, [m.to_dict() for m in meshes],
                          timeout_s=240)
    failures = [f for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures)
    seen = results[0]["seen"]
    assert seen["all_reduce"] == [
        "all_reduce all_reduce", "flat", "reduce_scatter all_reduce all_gather"]
    assert seen["reduce_scatter"] == ["flat", "reduce_scatter reduce_scatter"]
    assert seen["all_gather"] == ["all_gather all_gather", "flat"]
    assert seen["all_to_all"] == ["all_to_all all_to_all", "flat"]
