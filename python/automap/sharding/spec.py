"""Sharding specs (the native ``ShardingSpec``) and spec enumeration."""

from __future__ import annotations

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


def to_dtensor_placements(spec: ShardingSpec, mesh_ndim: int) -> list:
    """The DTensor placements (one per mesh axis) of ``spec``: ``Shard(d)`` on
    each axis that splits dim ``d``, ``Replicate()`` elsewhere. DTensor splits a
    dim over several mesh axes outermost-first by mesh axis index, so a dim
    whose axes are not in increasing order (e.g. ``S10``) has no plain
    placement form and raises ``InvalidSpecError``."""
    from torch.distributed.tensor import Replicate, Shard

    from automap.errors import InvalidSpecError

    placements: list = [Replicate() for _ in range(mesh_ndim)]
    for d, axes in enumerate(spec.dims):
        if list(axes) != sorted(axes):
            raise InvalidSpecError(
                f"spec {spec}: dim {d} is split over mesh axes {axes} in that order; DTensor "
                f"placements can only split a dim over increasing mesh axes"
            )
        for a in axes:
            if a >= mesh_ndim:
                raise InvalidSpecError(f"spec {spec} names mesh axis {a} of a {mesh_ndim}-D mesh")
            placements[a] = Shard(d)
    return placements
