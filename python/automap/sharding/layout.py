"""Layout conversions between sharding specs: the optimal path (cached in the
native core, shared by the whole process) and resharding-cost matrices."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from automap import _core
from automap._core import LayoutPath, LayoutStep, ShardingSpec
from automap.errors import InvalidArgumentError

if TYPE_CHECKING:
    from automap.sharding.mesh import DeviceMesh

__all__ = [
    "LayoutPath",
    "LayoutStep",
    "ConversionNetwork",
    "clear_layout_cache",
    "conversion_network",
    "layout_cache_stats",
    "layout_path",
    "resharding_cost_matrix",
]


def layout_path(mesh: DeviceMesh, src: ShardingSpec | str, dst: ShardingSpec | str,
                shape: Sequence[int], dtype_bytes: int = 4, *, method: str = "optimal"
                ) -> LayoutPath:
    """The conversion of a tensor of global ``shape`` from spec ``src`` to
    ``dst`` on ``mesh``: ``.steps`` (all_gather / shard / all_to_all on one
    mesh axis each) and ``.cost_s`` (forward + backward seconds).

    ``method="optimal"`` (default) is the exact minimum-cost path, searched
    once per (mesh, shape, dtype, src, dst) and cached; ``"heuristic"`` is
    MAP's greedy search, for comparison."""
    return _core.layout_path(mesh, src, dst, shape, _dtype_bytes(dtype_bytes), method)


def resharding_cost_matrix(
    mesh: DeviceMesh,
    srcs: Sequence[ShardingSpec | str],
    dsts: Sequence[ShardingSpec | str],
    shape: Sequence[int],
    dtype_bytes: int = 4,
    *,
    component: str = "total",
) -> np.ndarray:
    """``len(srcs) x len(dsts)`` array of conversion seconds between every pair
    of specs: ``component`` is ``"total"``, ``"forward"`` or ``"backward"``."""
    if component not in ("total", "forward", "backward"):
        raise InvalidArgumentError(
            f"component must be 'total', 'forward' or 'backward', got {component!r}")
    fwd, bwd = _core.resharding_costs(mesh, _specs(srcs, "srcs"), _specs(dsts, "dsts"), shape,
                                      _dtype_bytes(dtype_bytes))
    shape2 = (len(srcs), len(dsts))
    forward = np.frombuffer(fwd, dtype=np.float64).reshape(shape2)
    backward = np.frombuffer(bwd, dtype=np.float64).reshape(shape2)
    if component == "forward":
        return forward.copy()
    if component == "backward":
        return backward.copy()
    return forward + backward


@dataclass(frozen=True)
class ConversionNetwork:
    """The optimal paths between two lists of specs as one network: specs are
    numbered ``0 .. num_specs - 1`` (``src_pos`` / ``dst_pos`` give each
    source's and target's number); arc ``k`` is one single step from spec
    ``arc_from[k]`` to ``arc_to[k]`` costing ``arc_cost_s[k]`` (forward +
    backward). The cheapest path between a source and a target in it costs
    what ``resharding_cost_matrix`` says (``solve.ilp``'s flow edges)."""

    num_specs: int
    src_pos: np.ndarray
    dst_pos: np.ndarray
    arc_from: np.ndarray
    arc_to: np.ndarray
    arc_cost_s: np.ndarray


def conversion_network(mesh: DeviceMesh, srcs: Sequence[ShardingSpec | str],
                       dsts: Sequence[ShardingSpec | str], shape: Sequence[int],
                       dtype_bytes: int = 4) -> ConversionNetwork:
    """The network of one optimal path per (src, dst) pair (see
    ``ConversionNetwork``)."""
    n, src, dst, tail, head, cost = _core.conversion_network(
        mesh, _specs(srcs, "srcs"), _specs(dsts, "dsts"), shape, _dtype_bytes(dtype_bytes))
    u32 = lambda buf: np.frombuffer(buf, dtype=np.uint32).astype(np.int64)  # noqa: E731
    return ConversionNetwork(n, u32(src), u32(dst), u32(tail), u32(head),
                             np.frombuffer(cost, dtype=np.float64).copy())


def _dtype_bytes(value: object) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) \
            or not 1 <= int(value) <= 16:
        raise InvalidArgumentError(f"dtype_bytes must be an integer from 1 to 16 (bytes per "
                                   f"element), got {value!r}")
    return int(value)


def _specs(value: object, what: str) -> list:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidArgumentError(f"{what} must be a list of specs, got {value!r}")
    return list(value)


def layout_cache_stats() -> tuple[int, int]:
    """(cache hits, searches) of the process-wide layout cache."""
    return _core.layout_cache_stats()


def clear_layout_cache() -> None:
    """Forget every cached conversion path."""
    _core.clear_layout_cache()
