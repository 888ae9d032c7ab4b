"""Sharding specs (the native ``ShardingSpec``) and spec enumeration."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from automap import _core
from automap._core import ShardingSpec

if TYPE_CHECKING:
    from automap.sharding.mesh import DeviceMesh

__all__ = ["ShardingSpec", "enumerate_specs", "to_dtensor_placements"]


def enumerate_specs(shape: Sequence[int], mesh: DeviceMesh) -> list[ShardingSpec]:
    """Every valid sharding spec of a tensor of ``shape`` on ``mesh``, replicated
    first. Raises ``LimitExceededError`` past 100 000 specs (a 2-D tensor has
    634 889 on eight mesh axes of size 2)."""
    return _core.enumerate_specs(shape, mesh)


def to_dtensor_placements(spec: ShardingSpec | str, mesh: DeviceMesh | Sequence[int]) -> list:
    """The DTensor placements (one per mesh axis) of a state tensor's ``spec``.

    ``mesh``: an automap ``DeviceMesh`` or its shape (a sequence of axis sizes).
    Each axis that splits dim ``d`` gets ``Shard(d)``, every other axis
    ``Replicate()``. DTensor splits a dim over several mesh axes outermost-first by
    mesh axis index; automap's spec lists them outermost-first in any order
    (``S10``: axis 1 outermost). A dim whose axes are not increasing gets
    ``_StridedShard(d, split_factor=f)`` on each axis that an axis of higher index
    splits before it, ``f`` the product of those axes' sizes (torch's own encoding
    of a shard order, ``DTensorSpec._convert_shard_order_to_StridedShard``), so
    every rank's DTensor block is the one ``spec.local_slices`` gives. Specs split
    dims evenly, so no placement pads. Partial sums never occur in state specs.
    Needs no process group."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from automap.errors import InvalidSpecError

    if isinstance(spec, str):
        spec = ShardingSpec.parse(spec)
    sizes = list(mesh.shape) if hasattr(mesh, "shape") else [int(s) for s in mesh]
    placements: list = [Replicate() for _ in sizes]
    for d, axes in enumerate(spec.dims):
        axes = list(axes)
        for position, axis in enumerate(axes):
            if axis >= len(sizes):
                raise InvalidSpecError(
                    f"spec {spec} names mesh axis {axis}; the mesh {tuple(sizes)} has axes 0 "
                    f"to {len(sizes) - 1}")
            # Axes listed before this one (outer in automap's order) but of
            # higher index: DTensor would have applied them after it.
            factor = math.prod(sizes[a] for a in axes[:position] if a > axis)
            placements[axis] = Shard(d) if factor == 1 else _StridedShard(d, split_factor=factor)
    return placements
