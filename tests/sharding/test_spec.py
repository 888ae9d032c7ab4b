"""Sharding specs: parse/format round trip, validation with typed errors,
local shapes and slices (property tests with hypothesis)."""

from __future__ import annotations

import math
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import automap
from automap import DeviceMesh, InvalidSpecError, ShardingSpec


@st.composite
def spec_dims(draw, max_axes=4, max_rank=5):
    """Per-dim ordered axis lists: each of some mesh axes goes to one dim."""
    rank = draw(st.integers(0, max_rank))
    n_axes = draw(st.integers(1, max_axes))
    dims = [[] for _ in range(rank)]
    if rank:
        for axis in draw(st.permutations(range(n_axes))):
            d = draw(st.integers(-1, rank - 1))
            if d >= 0:
                dims[d].append(axis)
    return dims, n_axes


def _text(dims):
    return "".join("R" if not axes else "S" + "".join(map(str, axes)) for axes in dims)


@given(spec_dims())
def test_parse_format_round_trip(case):
    dims, _ = case
    spec = ShardingSpec.from_dims(dims)
    assert str(spec) == _text(dims)
    again = ShardingSpec.parse(str(spec))
    assert again == spec and hash(again) == hash(spec)
    assert again.dims == dims
    assert pickle.loads(pickle.dumps(spec)) == spec


@settings(max_examples=300)
@given(spec_dims(max_axes=3), st.data())
def test_validation_matches_definition(case, data):
    dims, n_axes = case
    mesh_shape = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    shape = data.draw(st.lists(st.integers(1, 12), min_size=len(dims), max_size=len(dims)))
    mesh = DeviceMesh(mesh_shape)
    spec = ShardingSpec.from_dims(dims)
    used = [a for axes in dims for a in axes]
    in_range = all(a < len(mesh_shape) for a in used)
    divisible = in_range and all(
        size % math.prod(mesh_shape[a] for a in axes) == 0 for size, axes in zip(shape, dims)
    )
    if divisible:
        spec.validate(shape, mesh)
        local = spec.local_shape(shape, mesh)
        assert local == [s // math.prod(mesh_shape[a] for a in axes)
                         for s, axes in zip(shape, dims)]
    else:
        with pytest.raises(InvalidSpecError):
            spec.validate(shape, mesh)


def test_error_messages_name_dim_and_sizes():
    mesh = DeviceMesh((2, 3))
    with pytest.raises(InvalidSpecError, match=r"dim 1 of size 4 cannot be split into 3 parts"):
        ShardingSpec.parse("RS1").validate([6, 4], mesh)
    with pytest.raises(InvalidSpecError, match=r"mesh axis 2 but the mesh \[2, 3\] has 2 axes"):
        ShardingSpec.parse("S2R").validate([6, 4], mesh)
    with pytest.raises(InvalidSpecError, match="used twice"):
        ShardingSpec.parse("S0S10")
    with pytest.raises(InvalidSpecError, match="unexpected"):
        ShardingSpec.parse("S0,R")
    with pytest.raises(InvalidSpecError, match="2 dims"):
        ShardingSpec.parse("S0R").validate([6], mesh)
    # Typed errors are also ValueErrors and AutomapErrors.
    with pytest.raises(ValueError):
        ShardingSpec.parse("Q")
    with pytest.raises(automap.AutomapError):
        ShardingSpec.parse("Q")


def test_local_slices_tile_the_tensor():
    mesh = DeviceMesh((2, 3), ranks=[5, 3, 1, 0, 2, 4])
    shape = [12, 6]
    for spec in automap.enumerate_specs(shape, mesh):
        seen = set()
        for rank in mesh.ranks:
            box = spec.local_slices(shape, mesh, rank)
            assert [b - a for a, b in box] == spec.local_shape(shape, mesh)
            seen.add(tuple(box))
        # Every shard held by exactly size / shard_count ranks, shards tile the tensor.
        assert len(seen) == spec.shard_count(mesh)
        assert sum(math.prod(b - a for a, b in box) for box in seen) == math.prod(shape)


def test_s01_order_is_major_to_minor():
    mesh = DeviceMesh((2, 2))
    s01, s10 = ShardingSpec.parse("S01"), ShardingSpec.parse("S10")
    # rank 1 is coordinate (0, 1): index 0*2+1 under S01, 1*2+0 under S10.
    assert s01.local_slices([8], mesh, 1) == [(2, 4)]
    assert s10.local_slices([8], mesh, 1) == [(4, 6)]


def test_enumerate_specs_counts():
    assert len(automap.enumerate_specs([8, 8, 8, 8], DeviceMesh((2, 2, 2)))) == 193
    specs = automap.enumerate_specs([6, 4], DeviceMesh((3, 2)))
    assert {str(s) for s in specs} == {"RR", "S0R", "S1R", "S01R", "S10R", "RS1", "S0S1"}


def test_dtensor_placements():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from automap.sharding.spec import to_dtensor_placements

    assert to_dtensor_placements(ShardingSpec.parse("S01R"), (2, 2, 2)) == [
        Shard(0), Shard(0), Replicate()]
    assert to_dtensor_placements(ShardingSpec.parse("RS1"), (2, 2)) == [Replicate(), Shard(1)]
    # Axis 1 outermost (tests/sharding/test_dtensor_placements.py checks every block).
    assert to_dtensor_placements(ShardingSpec.parse("S10"), (2, 2)) == [
        _StridedShard(0, split_factor=2), Shard(0)]
