"""Issue 19, point 1: a state spec's DTensor placements (``to_dtensor_placements``)
put every rank's block where automap's ``local_slices`` does, for every spec of
small tensors on 1-, 2- and 3-D meshes (axes in any order: ``S10`` needs
``_StridedShard``). Checked two ways, with no process group: the block DTensor
itself cuts (its placements' ``_split_tensor`` mesh axis by mesh axis, as
``distribute_tensor`` does) and the shape and offset torch's checkpointing writes
(``_compute_local_shape_and_global_offset``, what DCP records per chunk)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

import automap
from automap import DeviceMesh, InvalidSpecError, ShardingSpec
from automap.sharding.spec import to_dtensor_placements

CASES = [((4,), [8, 4]), ((2, 2), [8, 4]), ((2, 3), [12, 6]), ((3, 2), [6, 12]),
         ((2, 2, 2), [8, 8]), ((2, 3, 2), [12, 4]), ((2, 2, 2), [16])]


def _dtensor_block(full: torch.Tensor, placements, mesh_shape, coordinate) -> torch.Tensor:
    """The local tensor DTensor holds at ``coordinate`` (distribute_tensor's cut)."""
    local = full
    for axis, placement in enumerate(placements):
        if isinstance(placement, (Shard, _StridedShard)):
            pieces, _ = placement._split_tensor(local, mesh_shape[axis], with_padding=False)
            local = pieces[coordinate[axis]]
    return local


@pytest.mark.parametrize("mesh_shape,shape", CASES)
def test_every_spec_block_matches_local_slices(mesh_shape, shape):
    mesh = DeviceMesh(mesh_shape)
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    specs = automap.enumerate_specs(shape, mesh)
    strided = 0
    for spec in specs:
        placements = to_dtensor_placements(spec, mesh)
        strided += any(isinstance(p, _StridedShard) for p in placements)
        for rank in range(mesh.size):
            bounds = spec.local_slices(shape, mesh, rank)
            expected = full[tuple(slice(a, b) for a, b in bounds)]
            coordinate = mesh.coordinate(rank)
            got = _dtensor_block(full, placements, mesh_shape, coordinate)
            assert torch.equal(got, expected), (str(spec), rank, placements)
            local_shape, offset = _compute_local_shape_and_global_offset(
                shape, mesh_shape, list(coordinate), placements)
            assert list(local_shape) == [b - a for a, b in bounds], (str(spec), rank)
            assert list(offset) == [a for a, _ in bounds], (str(spec), rank)
    if mesh.ndim > 1:
        assert strided > 0  # specs with axes out of order were covered


def test_examples():
    mesh = DeviceMesh((2, 2, 2))
    assert to_dtensor_placements("S01R", mesh) == [Shard(0), Shard(0), Replicate()]
    assert to_dtensor_placements(ShardingSpec.parse("RS1"), (2, 2)) == [Replicate(), Shard(1)]
    # Axis 1 outermost: axis 0 is split after a split of 2 by axis 1.
    assert to_dtensor_placements("S10", (2, 2)) == [_StridedShard(0, split_factor=2), Shard(0)]
    assert to_dtensor_placements("S210", (2, 3, 4)) == [
        _StridedShard(0, split_factor=12), _StridedShard(0, split_factor=4), Shard(0)]
    assert to_dtensor_placements("S20S1", mesh) == [
        _StridedShard(0, split_factor=2), Shard(1), Shard(0)]


def test_axis_outside_the_mesh_is_refused():
    with pytest.raises(InvalidSpecError, match="names mesh axis 2"):
        to_dtensor_placements("S2", (2, 2))


def test_all_orders_of_three_axes():
    mesh = DeviceMesh((2, 3, 2))
    full = torch.arange(24)
    for order in itertools.permutations(range(3)):
        spec = ShardingSpec.parse("S" + "".join(map(str, order)))
        placements = to_dtensor_placements(spec, mesh)
        for rank in range(mesh.size):
            (a, b), = spec.local_slices([24], mesh, rank)
            got = _dtensor_block(full, placements, mesh.shape, mesh.coordinate(rank))
            assert torch.equal(got, full[a:b]), (order, rank)
