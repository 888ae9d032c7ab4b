"""Execute a layout conversion on real tensors. A path is searched (and
cached) at planning time; executing it only replays its steps."""

from __future__ import annotations

import torch

from automap.errors import InvalidSpecError
from automap.sharding.collectives import all_gather_dim, all_to_all_dims, split_dim
from automap.sharding.layout import LayoutPath
from automap.sharding.process_groups import MeshProcessGroups


def redistribute(x: torch.Tensor, path: LayoutPath, groups: MeshProcessGroups) -> torch.Tensor:
    """Turn this rank's shard of a tensor laid out as ``path.src`` into its
    shard under ``path.dst``; differentiable (each step's backward is its dual)."""
    expected = tuple(path.src.local_shape(path.shape, groups.mesh))
    if tuple(x.shape) != expected:
        raise InvalidSpecError(
            f"redistribute: local tensor has shape {tuple(x.shape)} but a {path.src} shard of "
            f"{tuple(path.shape)} on mesh {groups.mesh.shape} has shape {expected}"
        )
    for step in path.steps:
        g = groups.axis_group(step.axis)
        if step.kind == "all_gather":
            x = all_gather_dim(x, step.dim, g)
        elif step.kind == "shard":
            x = split_dim(x, step.dim, g)
        else:
            x = all_to_all_dims(x, step.dim, step.to_dim, g)
    return x
