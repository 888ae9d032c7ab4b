"""How a mesh is cut into pipeline stages of equal submeshes.

The stages split the mesh's leading (slowest) axes: ``n`` stages take whole
leading axes and then a leading part of the next one (``n = s0 * ... *
s(j-1) * f`` with ``f`` dividing ``s(j)``), so every stage is a block of
ranks that is itself a mesh of the remaining axes (axis ``j`` shrunk to
``s(j) / f``). Row-major order makes this a reshape: stage ``k`` holds the
``k``-th row of the rank grid reshaped to ``(n, -1)``. A 1-D mesh of ``W``
ranks is cut into ``n`` stages of ``W / n`` ranks (``n`` dividing ``W``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from automap.sharding.mesh import DeviceMesh


@dataclass(frozen=True)
class StageMeshes:
    """The stages of a mesh cut ``n`` ways."""

    mesh: DeviceMesh  # the whole mesh
    submesh_shape: tuple[int, ...]
    #: Each stage's ranks, row-major in ``submesh_shape``.
    stage_ranks: tuple[tuple[int, ...], ...]
    #: The submesh of stage 0 (its axes keep the whole mesh's names and links).
    submesh: DeviceMesh

    @property
    def count(self) -> int:
        return len(self.stage_ranks)

    def link_between(self, a: int, b: int) -> tuple[float, float]:
        """(alpha_s, bandwidth_bytes_per_s) of the link between the ranks at one
        submesh position of stages ``a`` and ``b``: the most significant mesh axis
        on which they differ (the slowest link a message between them crosses)."""
        ca = self.mesh.coordinate(self.stage_ranks[a][0])
        cb = self.mesh.coordinate(self.stage_ranks[b][0])
        axis = next(i for i, (x, y) in enumerate(zip(ca, cb)) if x != y)
        return self.mesh.alpha_s[axis], self.mesh.bandwidth_bytes_per_s[axis]

    def send_s(self, a: int, b: int, nbytes: float) -> float:
        """Seconds of one point-to-point send of ``nbytes`` from stage ``a`` to
        ``b`` (every submesh position sends its own shard at once, on its own link)."""
        if nbytes <= 0:
            return 0.0
        alpha, bandwidth = self.link_between(a, b)
        return alpha + nbytes / bandwidth


def cut_axes(shape: tuple[int, ...], n: int) -> tuple[int, int] | None:
    """(j, f): the stages take axes ``0 .. j-1`` whole and ``f`` parts of axis
    ``j`` (``j == len(shape)``, ``f == 1`` when they take every axis); None when
    ``n`` cannot cut ``shape`` this way."""
    rest = n
    for j, size in enumerate(shape):
        if rest == 1:
            return j, 1
        if rest % size == 0:
            rest //= size
            continue
        return (j, rest) if size % rest == 0 else None
    return (len(shape), 1) if rest == 1 else None


def stage_counts(mesh: DeviceMesh) -> list[int]:
    """The stage counts ``n >= 1`` that cut ``mesh`` into equal submeshes."""
    return [n for n in range(1, mesh.size + 1)
            if mesh.size % n == 0 and cut_axes(mesh.shape, n) is not None]


def cut_mesh(mesh: DeviceMesh, n: int) -> StageMeshes:
    """``mesh`` cut into ``n`` stages (``n`` in ``stage_counts(mesh)``)."""
    cut = cut_axes(mesh.shape, n)
    if cut is None:
        raise ValueError(f"{n} stages do not cut mesh {mesh.shape}")
    j, f = cut
    grid = np.array(mesh.ranks, dtype=np.int64).reshape(n, -1)
    stage_ranks = tuple(tuple(int(r) for r in row) for row in grid)
    kept = list(range(j, mesh.ndim))
    shape = [mesh.shape[a] // (f if a == j else 1) for a in kept]
    if kept:
        # Axes the cut leaves of size 1 carry nothing: dropped, unless none is left.
        keep = [i for i, size in enumerate(shape) if size > 1] or [len(kept) - 1]
        axes, sub_shape = [kept[i] for i in keep], [shape[i] for i in keep]
    else:  # every axis cut: one device per stage, a mesh of one
        axes, sub_shape = [mesh.ndim - 1], [1]
    submesh = DeviceMesh(
        sub_shape, ranks=stage_ranks[0],
        axis_names=[mesh.axis_names[a] for a in axes],
        alpha_s=[mesh.alpha_s[a] for a in axes],
        bandwidth_bytes_per_s=[mesh.bandwidth_bytes_per_s[a] for a in axes],
        backend=mesh.backend)
    return StageMeshes(mesh, tuple(sub_shape), stage_ranks, submesh)
