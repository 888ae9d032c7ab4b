"""Acceptance 1 of the foundation: for every ordered pair of valid specs on
meshes (4,), (2,2), (3,2), (2,2,2) (and a (2,2) mesh with shuffled ranks),
the conversion path run on gloo gives each rank exactly its target shard,
and backward gives exactly the gradient of the identity. One spawn of
processes per world size."""

from __future__ import annotations

import pytest

from automap import DeviceMesh
from automap.launch import run_on_gloo
from sharding_workers import check_all_conversions

pytestmark = pytest.mark.multiprocess

CASES_BY_WORLD = {
    4: [
        (DeviceMesh((4,)), [[8], [4, 8], [4, 4, 4], [4, 4, 4, 4]]),
        (DeviceMesh((2, 2)), [[8], [4, 4], [4, 4, 2], [4, 2, 2, 2]]),
        # Ranks not in row-major order: torch orders group members by rank,
        # shard indices follow the mesh.
        (DeviceMesh((2, 2), ranks=[3, 1, 0, 2]), [[4, 4], [4, 2, 2]]),
    ],
    6: [(DeviceMesh((3, 2)), [[6], [6, 6], [6, 6, 2], [6, 3, 2, 2]])],
    # 3-D: every axis order on one dim, on two, and one axis per dim; a 4-D
    # tensor of 2s (5329 pairs, half of this case's time) adds no new kind of step.
    8: [(DeviceMesh((2, 2, 2)), [[8], [8, 8], [4, 2, 2]])],
}


def _expected_pairs(cases) -> int:
    from automap import enumerate_specs

    return sum(len(enumerate_specs(s, m)) ** 2 for m, shapes in cases for s in shapes)


@pytest.mark.parametrize("world", sorted(CASES_BY_WORLD))
@pytest.mark.timeout(700)
def test_every_spec_pair_converts_exactly(world):
    cases = CASES_BY_WORLD[world]
    assert all(m.size == world for m, _ in cases)
    results = run_on_gloo(
        check_all_conversions,
        world,
        [(m.to_dict(), shapes) for m, shapes in cases],
        timeout_s=600,
    )
    failures = [f for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures[:20])
    expected = _expected_pairs(cases)
    assert all(r["pairs"] == expected for r in results)
    print(f"world {world}: {expected} pairs, {max(r['seconds'] for r in results):.1f} s")
