"""The logical device mesh: an N-D grid of global ranks with a per-axis
alpha-beta link model. Geometry and costs live in the native core; this
wrapper adds names, defaults and the torch.distributed process groups."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, TypeGuard

from automap import _core
from automap.errors import InvalidArgumentError, InvalidMeshError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

    from automap.sharding.process_groups import MeshProcessGroups

#: One mesh axis (index or name) or a sequence of them, first most significant.
Axes = int | str | Sequence[int | str]

#: Link model used when the cluster has not been measured: 10 us latency,
#: 100 GB/s (NVLink-class). ``automap.detect_cluster`` replaces these.
DEFAULT_ALPHA_S = 1e-5
DEFAULT_BANDWIDTH_BYTES_PER_S = 1e11

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")

#: Backends whose reduce-scatter all-reduces its whole input (torch's gloo
#: binding has no reduce-scatter of its own; ``sharding.collectives`` runs it
#: so), so that a reduce-scatter there costs an all-reduce.
REDUCE_SCATTER_AS_ALL_REDUCE = frozenset({"gloo"})


#: The link figures a mesh accepts: latency up to a minute, bandwidth from
#: 1 kB/s to 1 PB/s. Outside them collective prices leave the range the
#: planner's solver works in (and no real link is there).
MAX_ALPHA_S = 60.0
MIN_BANDWIDTH_BYTES_PER_S, MAX_BANDWIDTH_BYTES_PER_S = 1e3, 1e15


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _ints(value: object, what: str) -> list[int]:
    """A sequence of integers (not a string: "22" is not the shape (2, 2))."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidMeshError(f"{what} must be a sequence of integers, got {value!r}")
    items = list(value)
    bad = [v for v in items if not _is_int(v)]
    if bad:
        raise InvalidMeshError(f"{what} must be a sequence of integers, got {value!r} "
                               f"(entry {bad[0]!r})")
    return [int(v) for v in items]


def _nbytes(value: object) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise InvalidArgumentError(f"nbytes must be a number of bytes, got {value!r}")
    return float(value)


def _per_axis(value: object, ndim: int, default: float, what: str, low: float, high: float,
              allowed: str) -> list[float]:
    if value is None:
        return [default] * ndim
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        values = [float(value)] * ndim
    elif isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidMeshError(f"{what} must be a number or one number per axis, got {value!r}")
    else:
        values = list(value)
        if not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values):
            raise InvalidMeshError(f"{what} must be numbers, got {value!r}")
        values = [float(v) for v in values]
    if len(values) != ndim:
        raise InvalidMeshError(f"{what} has {len(values)} entries but the mesh has {ndim} axes")
    for axis, v in enumerate(values):
        if not (math.isfinite(v) and low <= v <= high):
            raise InvalidMeshError(f"{what} of axis {axis} must be {allowed}, got {v}")
    return values


class DeviceMesh:
    """An N-D logical mesh over global ranks.

    ``shape``: devices per axis, any sizes (not only powers of two).
    ``ranks``: the global rank at each position, row-major (last axis fastest);
    default ``range(prod(shape))``. ``axis_names``: optional names.
    ``alpha_s`` and ``bandwidth_bytes_per_s``: latency and bandwidth of each
    axis, a number for all axes or one per axis. ``backend``: the
    torch.distributed backend the collectives will run on ("gloo", "nccl",
    ...), where it changes how they run and so what they cost (gloo's
    reduce-scatter is an all-reduce); None prices native collectives.
    ``autoparallelize`` sets it to the process group's backend.
    """

    def __init__(
        self,
        shape: Sequence[int] | int,
        *,
        ranks: Sequence[int] | None = None,
        axis_names: Sequence[str] | None = None,
        alpha_s: Sequence[float] | float | None = None,
        bandwidth_bytes_per_s: Sequence[float] | float | None = None,
        backend: str | None = None,
    ) -> None:
        shape = [int(shape)] if _is_int(shape) else _ints(shape, "mesh shape")
        for axis, size in enumerate(shape):
            if size < 1:
                raise InvalidMeshError(f"mesh axis {axis} has size {size} in shape "
                                       f"{tuple(shape)}; sizes must be >= 1")
        ndim = len(shape)
        alphas = _per_axis(alpha_s, ndim, DEFAULT_ALPHA_S, "alpha_s", 0.0, MAX_ALPHA_S,
                           f"finite and >= 0 (seconds, at most {MAX_ALPHA_S:g})")
        bandwidths = _per_axis(
            bandwidth_bytes_per_s, ndim, DEFAULT_BANDWIDTH_BYTES_PER_S, "bandwidth_bytes_per_s",
            MIN_BANDWIDTH_BYTES_PER_S, MAX_BANDWIDTH_BYTES_PER_S,
            f"finite and > 0 (bytes/s, {MIN_BANDWIDTH_BYTES_PER_S:g} to "
            f"{MAX_BANDWIDTH_BYTES_PER_S:g})")
        if axis_names is None:
            axis_names = [f"axis{i}" for i in range(ndim)]
        if isinstance(axis_names, (str, bytes)) or not isinstance(axis_names, Iterable):
            raise InvalidMeshError(f"axis_names must be a sequence of names, got {axis_names!r}")
        axis_names = [str(n) for n in axis_names]
        if len(axis_names) != ndim or len(set(axis_names)) != ndim:
            raise InvalidMeshError(
                f"axis_names {axis_names} must name each of the {ndim} axes once"
            )
        if ranks is not None:
            ranks = _ints(ranks, "ranks")
        if backend is not None and (not isinstance(backend, str) or not backend):
            raise InvalidMeshError(f"backend must be None or a torch.distributed backend name "
                                   f"such as 'gloo' or 'nccl', got {backend!r}")
        self._native = _core.Mesh(shape, ranks, alphas, bandwidths,
                                  backend in REDUCE_SCATTER_AS_ALL_REDUCE)
        self.axis_names: tuple[str, ...] = tuple(axis_names)
        self.backend = backend

    # Geometry -------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._native.shape)

    @property
    def ndim(self) -> int:
        return len(self._native.shape)

    @property
    def size(self) -> int:
        return len(self._native.ranks)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(self._native.ranks)

    @property
    def alpha_s(self) -> tuple[float, ...]:
        return tuple(self._native.alpha_s)

    @property
    def bandwidth_bytes_per_s(self) -> tuple[float, ...]:
        return tuple(self._native.bandwidth_bytes_per_s)

    @property
    def reduce_scatter_as_all_reduce(self) -> bool:
        """Whether this mesh's backend runs a reduce-scatter as an all-reduce of
        its whole input (gloo), and so prices and sends it as one."""
        return self._native.reduce_scatter_as_all_reduce

    def with_backend(self, backend: str | None) -> DeviceMesh:
        """This mesh (same ranks, names and links) with collectives priced as
        ``backend`` runs them."""
        if backend == self.backend:
            return self
        return DeviceMesh(self.shape, ranks=self.ranks, axis_names=self.axis_names,
                          alpha_s=self.alpha_s, bandwidth_bytes_per_s=self.bandwidth_bytes_per_s,
                          backend=backend)

    def axis_index(self, axis: int | str) -> int:
        """The index of an axis given by index or name."""
        if isinstance(axis, str):
            if axis not in self.axis_names:
                raise InvalidMeshError(f"no mesh axis named {axis!r} (axes: {self.axis_names})")
            return self.axis_names.index(axis)
        if not _is_int(axis) or not 0 <= axis < self.ndim:
            raise InvalidMeshError(f"mesh axis {axis!r} is out of range for a {self.ndim}-D "
                                   f"mesh (axes 0 to {self.ndim - 1} or {list(self.axis_names)})")
        return int(axis)

    def _axes(self, axes: Axes) -> list[int]:
        if isinstance(axes, (numbers.Integral, str)):
            axes = [axes]
        if not isinstance(axes, Iterable):
            raise InvalidMeshError(f"axes must be a mesh axis (index or name) or a sequence of "
                                   f"them, got {axes!r}")
        return [self.axis_index(a) for a in axes]

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """The mesh coordinate of a global rank."""
        return tuple(self._native.coordinate(rank))

    def rank_at(self, coordinate: Sequence[int]) -> int:
        """The global rank at a mesh coordinate."""
        return self._native.rank_at(coordinate)

    def axis_groups(self, axes: Axes) -> list[list[int]]:
        """The groups of ranks that communicate along ``axes`` (one axis or
        several, first most significant). A rank's index in its group is its
        shard index along those axes."""
        return self._native.axis_groups(self._axes(axes))

    # Costs ------------------------------------------------------------------
    def collective_cost_s(self, kind: str, nbytes: float, axes: Axes = (0,)) -> float:
        """Alpha-beta time of one collective over ``axes`` by the algorithm
        ``collective_plan`` chooses. ``nbytes`` is the per-device buffer: the
        output of an all-gather, the input of a reduce-scatter, the buffer of
        an all-reduce, all-to-all or broadcast."""
        return self._native.collective_cost_s(kind, _nbytes(nbytes), self._axes(axes))

    def collective_plan(self, kind: str, nbytes: float, axes: Axes = (0,)
                        ) -> _core.CollectivePlan:
        """How one collective over ``axes`` runs: the cheaper under the link
        model of one flat ring over all their devices (``.flat``, one step) and
        per-axis steps (e.g. an all-reduce as a reduce-scatter along the fast
        axis, an all-reduce of the share along the slow one, an all-gather
        back). ``.steps``: kind, axes, nbytes and cost_s of each, in order;
        ``.cost_s`` is what ``collective_cost_s`` returns. The generated
        program runs these steps (``automap.sharding.collectives``)."""
        return self._native.collective_plan(kind, _nbytes(nbytes), self._axes(axes))

    def all_gather_cost_s(self, nbytes: float, axes: Axes = (0,)) -> float:
        return self.collective_cost_s("all_gather", nbytes, axes)

    def reduce_scatter_cost_s(self, nbytes: float, axes: Axes = (0,)) -> float:
        return self.collective_cost_s("reduce_scatter", nbytes, axes)

    def all_reduce_cost_s(self, nbytes: float, axes: Axes = (0,)) -> float:
        return self.collective_cost_s("all_reduce", nbytes, axes)

    def all_to_all_cost_s(self, nbytes: float, axes: Axes = (0,)) -> float:
        return self.collective_cost_s("all_to_all", nbytes, axes)

    def broadcast_cost_s(self, nbytes: float, axes: Axes = (0,)) -> float:
        return self.collective_cost_s("broadcast", nbytes, axes)

    # Runtime ----------------------------------------------------------------
    def process_groups(self, backend_device: str | None = None) -> MeshProcessGroups:
        """The torch.distributed groups of every axis and set of axes (see
        ``automap.sharding.process_groups.MeshProcessGroups``). Collective: every rank
        of the default group must call it, in the same order."""
        from automap.sharding.process_groups import MeshProcessGroups

        return MeshProcessGroups(self, device=backend_device)

    def to_torch(self, device_type: str = "cpu") -> TorchDeviceMesh:
        """This mesh as a ``torch.distributed.device_mesh.DeviceMesh`` (for
        DTensor users). Needs an initialised default process group."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
        from torch.distributed.device_mesh import init_device_mesh

        names = self.axis_names
        if self.ranks == tuple(range(self.size)):
            return init_device_mesh(device_type, self.shape, mesh_dim_names=names)
        mesh = torch.tensor(self.ranks, dtype=torch.int64).reshape(self.shape)
        return TorchDeviceMesh(device_type, mesh, mesh_dim_names=names)

    # Identity ---------------------------------------------------------------
    def _key(self) -> tuple:
        return (self.shape, self.ranks, self.alpha_s, self.bandwidth_bytes_per_s, self.axis_names,
                self.backend)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceMesh) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        extra = "" if self.ranks == tuple(range(self.size)) else f", ranks={list(self.ranks)}"
        if self.backend is not None:
            extra += f", backend={self.backend!r}"
        return (
            f"DeviceMesh({self.shape}{extra}, axis_names={self.axis_names}, "
            f"alpha_s={self.alpha_s}, bandwidth_bytes_per_s={self.bandwidth_bytes_per_s})"
        )

    def to_dict(self) -> dict:
        return {
            "shape": list(self.shape),
            "ranks": list(self.ranks),
            "axis_names": list(self.axis_names),
            "alpha_s": list(self.alpha_s),
            "bandwidth_bytes_per_s": list(self.bandwidth_bytes_per_s),
            **({} if self.backend is None else {"backend": self.backend}),
        }

    @classmethod
    def from_dict(cls, data: dict) -> DeviceMesh:
        """The mesh of ``to_dict``; the shape must be a list of integers."""
        if not isinstance(data, dict) or "shape" not in data:
            raise InvalidMeshError(f"a mesh record is a dict with a 'shape', got {data!r}")
        if not isinstance(data["shape"], (list, tuple)):
            raise InvalidMeshError(f"a mesh record's shape must be a list of integers, got "
                                   f"{data['shape']!r}")
        return cls(
            data["shape"],
            ranks=data.get("ranks"),
            axis_names=data.get("axis_names"),
            alpha_s=data.get("alpha_s"),
            bandwidth_bytes_per_s=data.get("bandwidth_bytes_per_s"),
            backend=data.get("backend"),
        )
