"""The autograd collectives against their definitions on 4 gloo ranks: a
(2,2) mesh with shuffled ranks, every axis and every ordered pair of axes."""

from __future__ import annotations

import pytest

from automap import DeviceMesh
from automap.launch import run_on_gloo
from sharding_workers import check_collectives

pytestmark = pytest.mark.multiprocess


def test_collectives_and_their_duals():
    mesh = DeviceMesh((2, 2), ranks=[2, 0, 3, 1])
    results = run_on_gloo(check_collectives, 4, mesh.to_dict(), timeout_s=120)
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures)
