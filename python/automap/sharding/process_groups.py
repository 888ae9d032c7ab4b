"""torch.distributed process groups of a DeviceMesh: one group per fibre of
every set of mesh axes, plus the order that maps a group's member ranks to
shard indices (torch orders group members by global rank, a mesh may not)."""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field

import torch.distributed as dist

from automap.errors import InvalidMeshError

#: AxisGroups by ``compile_key`` (weakly: a group lives as long as its owner).
_BY_COMPILE_KEY: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_KEY_COUNTER = itertools.count()


def group_of_compile_key(key: str) -> AxisGroup:
    """The AxisGroup whose ``compile_key`` is ``key``."""
    return _BY_COMPILE_KEY[key]


@dataclass(frozen=True)
class SimulatedProcessGroup:
    """The ``group`` of an ``AxisGroup`` of ``SimulatedGroups``: collectives on it
    allocate what they would on ``backend`` and communicate nothing."""

    backend: str


@dataclass(frozen=True)
class AxisGroup:
    """This rank's group along some mesh axes.

    ``size``: members; ``index``: this rank's shard index along the axes;
    ``shard_of_group_rank[r]``: the shard index of the member whose rank in
    ``group`` is ``r`` (None when it is the identity); ``owner``: the
    ``MeshProcessGroups`` it belongs to (for the groups of the per-axis steps
    of a collective over several axes)."""

    group: object  # torch.distributed ProcessGroup, or None when size == 1
    axes: tuple[int, ...]
    size: int
    index: int
    shard_of_group_rank: tuple[int, ...] | None
    owner: MeshProcessGroups = field(repr=False, compare=False)

    def __post_init__(self) -> None:
        # The name compiled code passes to the collectives' custom ops (which take
        # no Python objects): registered here so that compiled code only reads it.
        key = f"axis_group_{next(_KEY_COUNTER)}"
        object.__setattr__(self, "compile_key", key)
        _BY_COMPILE_KEY[key] = self

    def along(self, axes) -> AxisGroup:
        """This rank's group along ``axes`` (one step of a collective's algorithm)."""
        return self.owner.axis_group(axes)

    def algorithm(self, kind: str, nbytes: int):
        """How a collective ``kind`` on ``nbytes`` per device runs over this
        group: the native core's choice (``DeviceMesh.collective_plan``), the
        one the planner priced."""
        return self.owner.collective_plan(kind, nbytes, self.axes)

    @property
    def simulated(self) -> bool:
        return isinstance(self.group, SimulatedProcessGroup)

    @property
    def group_rank_of_shard(self) -> tuple[int, ...] | None:
        if self.shard_of_group_rank is None:
            return None
        inverse = [0] * self.size
        for r, shard in enumerate(self.shard_of_group_rank):
            inverse[shard] = r
        return tuple(inverse)


class MeshProcessGroups:
    """Process groups for every non-empty set of axes of ``mesh``.

    Creating them is collective: every rank of the default process group
    calls this constructor (ranks outside the mesh get no groups). Groups over
    the same set of axes in another order share one torch group."""

    def __init__(self, mesh, device: str | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise InvalidMeshError(
                "torch.distributed is not initialised: call "
                "torch.distributed.init_process_group (or launch with torchrun) first"
            )
        world = dist.get_world_size()
        if max(mesh.ranks) >= world:
            raise InvalidMeshError(
                f"mesh {mesh.shape} names rank {max(mesh.ranks)} but the world has {world} "
                f"processes; build a mesh whose size matches the world "
                f"(e.g. DeviceMesh(({world},)))"
            )
        self.mesh = mesh
        self.device = device
        self.rank = dist.get_rank()
        self.in_mesh = self.rank in mesh.ranks
        self.coordinate = mesh.coordinate(self.rank) if self.in_mesh else None
        # Torch group per unordered set of axes, created in one order on every rank.
        self._torch_groups: dict[tuple[int, ...], object] = {}
        for k in range(1, mesh.ndim + 1):
            for axes in itertools.combinations(range(mesh.ndim), k):
                if all(mesh.shape[a] == 1 for a in axes):
                    continue
                for members in mesh.axis_groups(list(axes)):
                    pg = dist.new_group(ranks=sorted(members))
                    if self.rank in members:
                        self._torch_groups[axes] = pg
        self._axis_groups: dict[tuple[int, ...], AxisGroup] = {}
        self._plans: dict[tuple, object] = {}

    def collective_plan(self, kind: str, nbytes: int, axes: tuple[int, ...]):
        """``mesh.collective_plan``, memoised (the same buffers recur every step)."""
        key = (kind, nbytes, axes)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self.mesh.collective_plan(kind, nbytes, axes)
        return plan

    def axis_group(self, axes) -> AxisGroup:
        """This rank's group along ``axes`` (an axis or an ordered tuple)."""
        if not self.in_mesh:
            raise InvalidMeshError(f"rank {self.rank} is not in the mesh {self.mesh.ranks}")
        axes = (axes,) if isinstance(axes, int) else tuple(axes)
        cached = self._axis_groups.get(axes)
        if cached is not None:
            return cached
        members = next(g for g in self.mesh.axis_groups(list(axes)) if self.rank in g)
        size = len(members)
        index = members.index(self.rank)
        if size == 1:
            result = AxisGroup(None, axes, 1, 0, None, self)
        else:
            pg = self._torch_groups[tuple(sorted(axes))]
            by_group_rank = dist.get_process_group_ranks(pg)
            order = tuple(members.index(r) for r in by_group_rank)
            identity = order == tuple(range(size))
            result = AxisGroup(pg, axes, size, index, None if identity else order, self)
        self._axis_groups[axes] = result
        return result


class SimulatedGroups(MeshProcessGroups):
    """The groups of one ``rank`` of ``mesh`` without a process group: for running
    the generated program on fake tensors (``automap.generate.simulate``), where
    each collective allocates what it would on ``backend`` ("gloo" or "nccl") and
    communicates nothing."""

    def __init__(self, mesh, rank: int, backend: str = "gloo") -> None:
        if rank not in mesh.ranks:
            raise InvalidMeshError(f"rank {rank} is not in the mesh {mesh.ranks}")
        self.mesh = mesh
        self.device = None
        self.rank = rank
        self.in_mesh = True
        self.coordinate = mesh.coordinate(rank)
        self.group = SimulatedProcessGroup(backend)
        self._axis_groups = {}
        self._plans = {}

    def axis_group(self, axes) -> AxisGroup:
        axes = (axes,) if isinstance(axes, int) else tuple(axes)
        cached = self._axis_groups.get(axes)
        if cached is None:
            members = next(g for g in self.mesh.axis_groups(list(axes)) if self.rank in g)
            group = self.group if len(members) > 1 else None
            cached = self._axis_groups[axes] = AxisGroup(group, axes, len(members),
                                                         members.index(self.rank), None, self)
        return cached
