"""The autograd collectives against their definitions on 4 gloo ranks: a
(2,2) mesh with shuffled ranks, every axis and every ordered pair of axes
(pairs run as one flat call or per axis, as the links make cheaper)."""

from __future__ import annotations

import pytest

from automap import DeviceMesh
from automap.launch import run_on_gloo
from sharding_workers import check_collectives

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(200)
@pytest.mark.parametrize("links", [
    {},  # equal links: pairs of axes run one flat call
    # No latency and a faster axis 1: pairs of axes run per axis.
    {"alpha_s": 0.0, "bandwidth_bytes_per_s": [1e10, 1e11]},
], ids=["flat", "per-axis"])
def test_collectives_and_their_duals(links):
    mesh = DeviceMesh((2, 2), ranks=[2, 0, 3, 1], **links)
    assert mesh.collective_plan("all_reduce", 64, (0, 1)).flat == (not links)
    results = run_on_gloo(check_collectives, 4, mesh.to_dict(), timeout_s=120)
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures)
