"""Layout conversions between sharding specs: the optimal path (cached in the
native core, shared by the whole process) and resharding-cost matrices."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from automap import _core
from automap._core import LayoutPath, LayoutStep

__all__ = [
    "LayoutPath",
    "LayoutStep",
    "clear_layout_cache",
    "layout_cache_stats",
    "layout_path",
    "resharding_cost_matrix",
]


def layout_path(mesh, src, dst, shape: Sequence[int], dtype_bytes: int = 4, *, method="optimal"):
    """The conversion of a tensor of global ``shape`` from spec ``src`` to
    ``dst`` on ``mesh``: ``.steps`` (all_gather / shard / all_to_all on one
    mesh axis each) and ``.cost_s`` (forward + backward seconds).

    ``method="optimal"`` (default) is the exact minimum-cost path, searched
    once per (mesh, shape, dtype, src, dst) and cached; ``"heuristic"`` is
    MAP's greedy search, for comparison."""
    return _core.layout_path(mesh, src, dst, [int(s) for s in shape], int(dtype_bytes), method)


def resharding_cost_matrix(
    mesh,
    srcs: Sequence,
    dsts: Sequence,
    shape: Sequence[int],
    dtype_bytes: int = 4,
    *,
    component: str = "total",
) -> np.ndarray:
    """``len(srcs) x len(dsts)`` array of conversion seconds between every pair
    of specs: ``component`` is ``"total"``, ``"forward"`` or ``"backward"``."""
    fwd, bwd = _core.resharding_costs(mesh, list(srcs), list(dsts), [int(s) for s in shape],
                                      int(dtype_bytes))
    shape2 = (len(srcs), len(dsts))
    forward = np.frombuffer(fwd, dtype=np.float64).reshape(shape2)
    backward = np.frombuffer(bwd, dtype=np.float64).reshape(shape2)
    if component == "forward":
        return forward.copy()
    if component == "backward":
        return backward.copy()
    if component == "total":
        return forward + backward
    raise ValueError(f"component must be 'total', 'forward' or 'backward', got {component!r}")


def layout_cache_stats() -> tuple[int, int]:
    """(cache hits, searches) of the process-wide layout cache."""
    return _core.layout_cache_stats()


def clear_layout_cache() -> None:
    """Forget every cached conversion path."""
    _core.clear_layout_cache()
