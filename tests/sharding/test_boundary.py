"""The native core answers bad input with typed errors, never a panic
(``PanicException``), an abort or a silently wrong answer: each case below
once reached Python as a panic, crashed the process, or read a stale cache."""

from __future__ import annotations

import random
import time

import pytest

import automap
from automap import (
    InvalidArgumentError,
    InvalidChainError,
    InvalidMeshError,
    InvalidSpecError,
    LimitExceededError,
    _core,
)


def test_huge_meshes_are_refused_before_allocating():
    for shape in [(10**6, 10**6), (2**32, 2**32)]:  # 8 TB of ranks; a product that wraps to 0
        with pytest.raises(LimitExceededError, match="at most 1048576"):
            automap.DeviceMesh(shape)
    assert automap.DeviceMesh((1024, 1024)).size == 2**20


def test_a_string_is_not_a_mesh_shape():
    with pytest.raises(InvalidMeshError, match="'22'"):
        automap.DeviceMesh("22")


def test_reported_panics_are_typed_errors():
    mesh = automap.DeviceMesh((2,))
    with pytest.raises(InvalidSpecError, match="mesh axis 3"):
        automap.ShardingSpec.parse("S3").shard_count(mesh)
    with pytest.raises(InvalidArgumentError, match="32 dims"):
        automap.enumerate_specs([2] * 32, mesh)
    with pytest.raises(InvalidChainError, match="stage times add up"):
        _core.solve_rotor([1e39, 1e39, 1e39], [1.0, 1.0, 1.0], [10] * 3, [20] * 3, 70)
    with pytest.raises(InvalidArgumentError, match="earlier nodes"):
        _core.detect_blocks(["a"], ["a"], ["h.0"], [[5]])
    with pytest.raises(InvalidArgumentError, match="coordinate"):
        mesh.rank_at([2**64 - 1])
    with pytest.raises(InvalidArgumentError, match="coordinate"):
        mesh.rank_at([-1])
    with pytest.raises(InvalidArgumentError, match="each entry of dims must be a sequence"):
        automap.ShardingSpec.from_dims([0, 1])


def test_specs_are_validated_before_the_layout_cache_is_read():
    mesh = automap.DeviceMesh((2, 2))
    automap.layout_path(mesh, "RRR", "RRR", (8, 8, 8))  # caches the (no axes, no axes) pair
    with pytest.raises(InvalidSpecError, match="RRRR has 4 dims"):
        automap.layout_path(mesh, "RRRR", "RRR", (8, 8, 8))
    with pytest.raises(InvalidSpecError, match="RRRR has 4 dims"):
        automap.resharding_cost_matrix(mesh, ["RRRR"], ["RRR"], (8, 8, 8))


def test_byte_counts_do_not_overflow():
    mesh = automap.DeviceMesh((2,))
    with pytest.raises(LimitExceededError, match="more than 2\\^64 bytes"):
        automap.layout_path(mesh, "S0R", "RR", (2**62, 2))
    with pytest.raises(InvalidArgumentError, match="dtype_bytes"):
        automap.layout_path(mesh, "S0", "R", (4,), dtype_bytes=0)


def test_enumeration_is_capped_and_large_cost_matrices_stay_fast():
    mesh = automap.DeviceMesh((2,) * 8)
    with pytest.raises(LimitExceededError, match="more than 100000 sharding specs"):
        automap.enumerate_specs([64, 64], mesh)  # 634 889 specs
    specs = automap.enumerate_specs([16, 4], mesh)  # 4 + 4 axes at most: within the cap
    rows = random.Random(0).sample(specs, 10)
    automap.clear_layout_cache()
    start = time.perf_counter()
    costs = automap.resharding_cost_matrix(mesh, rows, rows, [64, 64])
    print(f"10 x 10 cost matrix on 8 mesh axes: {time.perf_counter() - start:.2f} s "
          f"(one Dijkstra per row took 10.6 s before)")
    assert costs.shape == (10, 10) and (costs.diagonal() == 0).all() and (costs >= 0).all()
