"""Topology-aware device meshes from a measured link matrix (MAP, section 4.2).

Three steps, all pure functions over numpy arrays:

1. **Tiers.** The bandwidths of all pairs are clustered in log space: sorted
   from fastest to slowest, a new tier starts wherever two neighbouring values
   differ by more than ``rel_tol`` (relative). The detector measures each pair
   several times, takes the median, and widens ``rel_tol`` until a gap is
   significant against the repeat-to-repeat noise (``significant_rel_tol``),
   so noise on a busy machine does not split a tier, while real link classes
   (NVLink, PCIe, across NUMA, across hosts) differ by far more. Each tier
   gets the median bandwidth and the median latency of its pairs.
2. **Hierarchy.** Adding the links tier by tier, fastest first, and taking
   connected components gives nested groups (NVLink pairs, then NUMA nodes,
   then the host ...). The *tree order* lists the devices so that every group
   of every tier is a contiguous block.
3. **Meshes.** Every ordered factorisation of N into up to ``max_axes`` axes
   is laid row-major over the tree order, so inner (last) axes fall inside the
   smallest groups: on the fastest links, and homogeneous wherever the shape
   follows the hierarchy. Each axis is charged the slowest bandwidth and the
   largest latency among the tiers of the links inside its groups (a ring
   over the group is paced by its slowest hop), or the measured values of a
   group all-reduce over exactly its groups when the detector made one.

Cost is polynomial: O(N^2) for the tiers and hierarchy, O(N * axis size) per
axis of each candidate shape; no search over device permutations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from automap.errors import InvalidMeshError
from automap.sharding.mesh import DEFAULT_BANDWIDTH_BYTES_PER_S, DeviceMesh

#: Neighbouring bandwidths (sorted) further apart than this, relatively, start a new tier.
DEFAULT_REL_TOL = 0.25
#: A tier splits only at a gap this many standard errors of a difference of two
#: pair bandwidths wide (their repeat-to-repeat spread, in log space).
SIGNIFICANCE_Z = 3.0
#: Buffer of the all-reduce whose time ranks the candidate meshes (1 GiB, gradient-sized).
SCORE_BYTES = 2**30


@dataclass(frozen=True)
class Tier:
    """One class of links. ``groups``: the connected components of the links
    of this tier and all faster tiers (the hierarchy's groups at this tier)."""

    bandwidth_bytes_per_s: float
    alpha_s: float
    pairs: int
    groups: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class GroupLink:
    """A measured group all-reduce: all ``groups`` ran concurrently; the
    slowest group's fitted latency and bus bandwidth."""

    groups: tuple[tuple[int, ...], ...]
    alpha_s: float
    bandwidth_bytes_per_s: float

    def key(self) -> frozenset:
        return _partition_key(self.groups)


@dataclass(frozen=True, eq=False)
class Topology:
    """The fitted tiers (fastest first), the tier of every pair (-1 on the
    diagonal) and the tree order of the devices."""

    tiers: tuple[Tier, ...]
    tier_of_pair: np.ndarray
    order: tuple[int, ...]

    @property
    def num_devices(self) -> int:
        return len(self.order)


@dataclass(frozen=True)
class MeshCandidate:
    """A candidate mesh and why it ranks where it does.

    ``score_s``: time of a hierarchical all-reduce of ``SCORE_BYTES`` over the
    whole mesh under the mesh's own link model (lower is better).
    ``axis_tiers[k]``: the tiers of the links inside axis k's groups.
    ``measured_axes[k]``: whether axis k's costs come from a group all-reduce."""

    mesh: DeviceMesh
    score_s: float
    axis_tiers: tuple[tuple[int, ...], ...]
    measured_axes: tuple[bool, ...]

    @property
    def homogeneous(self) -> tuple[bool, ...]:
        """Per axis: every link inside its groups is of one tier."""
        return tuple(len(t) <= 1 for t in self.axis_tiers)


def _partition_key(groups) -> frozenset:
    return frozenset(frozenset(int(r) for r in g) for g in groups)


def check_link_matrices(alpha_s, bandwidth_bytes_per_s) -> tuple[np.ndarray, np.ndarray]:
    """Validate an N x N latency and bandwidth matrix and make them symmetric
    with the slower direction of each pair (the diagonal is ignored)."""
    alpha = np.array(alpha_s, dtype=np.float64)
    bandwidth = np.array(bandwidth_bytes_per_s, dtype=np.float64)
    if bandwidth.ndim != 2 or bandwidth.shape[0] != bandwidth.shape[1]:
        raise InvalidMeshError(f"bandwidth matrix must be N x N, got shape {bandwidth.shape}")
    if alpha.shape != bandwidth.shape:
        raise InvalidMeshError(
            f"latency matrix has shape {alpha.shape} but bandwidth matrix {bandwidth.shape}"
        )
    off = ~np.eye(len(bandwidth), dtype=bool)
    if not (np.isfinite(bandwidth[off]).all() and (bandwidth[off] > 0).all()):
        raise InvalidMeshError("every off-diagonal bandwidth must be finite and > 0")
    if not (np.isfinite(alpha[off]).all() and (alpha[off] >= 0).all()):
        raise InvalidMeshError("every off-diagonal latency must be finite and >= 0")
    bandwidth = np.minimum(bandwidth, bandwidth.T)
    alpha = np.maximum(alpha, alpha.T)
    np.fill_diagonal(bandwidth, 0.0)
    np.fill_diagonal(alpha, 0.0)
    return alpha, bandwidth


def significant_rel_tol(log_repeats: np.ndarray, floor: float = DEFAULT_REL_TOL,
                        z: float = SIGNIFICANCE_Z) -> float:
    """The tier tolerance that makes a split significant: ``log_repeats`` holds,
    per pair (rows), the log bandwidth of each repeated measurement (columns).
    The pooled repeat-to-repeat standard deviation ``s`` of one measurement
    gives a pair median (of R repeats) a spread of about ``1.25 s / sqrt(R)``;
    two medians differ by noise alone less than ``z`` times ``sqrt(2)`` of that
    (``z = 3``: about 3 in 1000 of neighbouring pairs), so gaps narrower than
    that do not split a tier. Never below ``floor``."""
    logs = np.asarray(log_repeats, dtype=np.float64)
    if logs.ndim != 2 or logs.shape[1] < 2:
        return floor
    spread = float(np.sqrt(np.mean(np.var(logs, axis=1, ddof=1))))
    median_sd = 1.2533 * spread / np.sqrt(logs.shape[1])
    return max(floor, float(np.expm1(z * np.sqrt(2.0) * median_sd)))


def cluster_values(values: np.ndarray, rel_tol: float = DEFAULT_REL_TOL) -> np.ndarray:
    """Label positive values by tier, 0 for the largest: sorted in decreasing
    order, a new tier starts at each gap wider than ``rel_tol`` relatively."""
    if rel_tol <= 0:
        raise InvalidMeshError(f"rel_tol must be > 0, got {rel_tol}")
    values = np.asarray(values, dtype=np.float64)
    order = np.argsort(-values, kind="stable")
    logs = np.log(values[order])
    gaps = logs[:-1] - logs[1:]
    labels = np.empty(len(values), dtype=np.int64)
    labels[order] = np.concatenate([[0], np.cumsum(gaps > np.log1p(rel_tol))])
    return labels


def _components(parent: list[int]) -> list[tuple[int, ...]]:
    groups: dict[int, list[int]] = {}
    for d in range(len(parent)):
        groups.setdefault(_find(parent, d), []).append(d)
    return sorted(tuple(g) for g in groups.values())


def _find(parent: list[int], d: int) -> int:
    while parent[d] != d:
        parent[d] = parent[parent[d]]
        d = parent[d]
    return d


def fit_tiers(alpha_s, bandwidth_bytes_per_s, rel_tol: float = DEFAULT_REL_TOL) -> Topology:
    """Tiers, pair tiers and tree order of a link matrix (see the module doc)."""
    alpha, bandwidth = check_link_matrices(alpha_s, bandwidth_bytes_per_s)
    n = len(bandwidth)
    tier_of_pair = np.full((n, n), -1, dtype=np.int64)
    if n < 2:
        return Topology((), tier_of_pair, tuple(range(n)))
    iu, ju = np.triu_indices(n, 1)
    labels = cluster_values(bandwidth[iu, ju], rel_tol)
    tier_of_pair[iu, ju] = labels
    tier_of_pair[ju, iu] = labels

    # Kruskal by tier: the components after each tier are the hierarchy's
    # groups. Components are recomputed only when a tier merges some, so
    # noisy data with many tiers still costs O(N^2) overall.
    by_tier = np.argsort(labels, kind="stable")
    bounds = np.searchsorted(labels[by_tier], np.arange(int(labels.max()) + 2))
    parent = list(range(n))
    groups = tuple((d,) for d in range(n))
    partitions = []  # the distinct ones, finest first
    tiers = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        pairs = by_tier[start:end]
        merged = False
        for i, j in zip(iu[pairs].tolist(), ju[pairs].tolist()):
            ri, rj = _find(parent, i), _find(parent, j)
            if ri != rj:
                parent[max(ri, rj)] = min(ri, rj)
                merged = True
        if merged:
            groups = tuple(_components(parent))
            partitions.append(groups)
        tiers.append(
            Tier(
                bandwidth_bytes_per_s=float(np.median(bandwidth[iu[pairs], ju[pairs]])),
                alpha_s=float(np.median(alpha[iu[pairs], ju[pairs]])),
                pairs=len(pairs),
                groups=groups,
            )
        )

    # Tree order: sort by group index from the coarsest partition to the
    # finest, so every group of every tier is one contiguous block.
    keys = [[] for _ in range(n)]
    for partition in reversed(partitions):
        for index, group in enumerate(partition):
            for d in group:
                keys[d].append(index)
    order = tuple(sorted(range(n), key=lambda d: (keys[d], d)))
    return Topology(tuple(tiers), tier_of_pair, order)


def factorizations(n: int, max_axes: int = 3) -> list[tuple[int, ...]]:
    """Every ordered factorisation of ``n`` into 1..``max_axes`` factors > 1
    (just ``(n,)`` for n <= 1)."""
    if n <= 1:
        return [(max(n, 1),)]
    found = []

    def extend(prefix: tuple[int, ...], rest: int) -> None:
        if len(prefix) == max_axes - 1:
            found.append(prefix + (rest,))
            return
        found.append(prefix + (rest,))
        for f in range(2, rest):
            if rest % f == 0:
                extend(prefix + (f,), rest // f)

    extend((), n)
    return sorted(found, key=lambda s: (len(s), s))


def _axis_groups(grid: np.ndarray, axis: int) -> np.ndarray:
    return np.moveaxis(grid, axis, -1).reshape(-1, grid.shape[axis])


def _score_s(mesh: DeviceMesh, nbytes: float) -> float:
    # Reduce-scatter axis by axis from the innermost, then all-gather back:
    # the large early shards travel on the inner (fastest) axes.
    total = 0.0
    for axis in reversed(range(mesh.ndim)):
        total += 2.0 * mesh.reduce_scatter_cost_s(nbytes, axis)
        nbytes /= mesh.shape[axis]
    return total


def candidate_meshes(
    topology: Topology,
    *,
    max_axes: int = 3,
    group_links: Sequence[GroupLink] = (),
    score_bytes: float = SCORE_BYTES,
) -> list[MeshCandidate]:
    """Candidate meshes over the tree order, best first.

    Ranking: ``score_s`` (the hierarchical all-reduce time, see
    ``MeshCandidate``), then fewer axes (a smaller planning problem), then
    the shape in decreasing order; scores equal to 9 significant digits tie.
    On a uniform cluster all shapes move the same bytes, so the extra
    latencies put the 1-D mesh first; on a hierarchical one the mesh with an
    axis per tier wins because it keeps the large shards on the fast links."""
    n = topology.num_devices
    tiers = topology.tiers
    measured = {g.key(): g for g in group_links}
    ranks = np.array(topology.order, dtype=np.int64)
    candidates = []
    for shape in factorizations(n, max_axes):
        grid = ranks.reshape(shape)
        alphas, bandwidths, axis_tiers, from_groups = [], [], [], []
        for axis, size in enumerate(shape):
            groups = _axis_groups(grid, axis)
            if size > 1:
                links = topology.tier_of_pair[groups[:, :, None], groups[:, None, :]]
                present = tuple(int(t) for t in np.unique(links[links >= 0]))
            else:
                present = ()
            link = measured.get(_partition_key(groups.tolist()))
            if link is not None:
                alphas.append(link.alpha_s)
                bandwidths.append(link.bandwidth_bytes_per_s)
            elif present:
                alphas.append(max(tiers[t].alpha_s for t in present))
                bandwidths.append(min(tiers[t].bandwidth_bytes_per_s for t in present))
            else:  # a single device: its axis never communicates
                alphas.append(0.0)
                bandwidths.append(DEFAULT_BANDWIDTH_BYTES_PER_S)
            axis_tiers.append(present)
            from_groups.append(link is not None)
        mesh = DeviceMesh(
            shape, ranks=ranks.tolist(), alpha_s=alphas, bandwidth_bytes_per_s=bandwidths
        )
        candidates.append(
            MeshCandidate(mesh, _score_s(mesh, score_bytes), tuple(axis_tiers), tuple(from_groups))
        )
    candidates.sort(
        key=lambda c: (float(f"{c.score_s:.9g}"), c.mesh.ndim, tuple(-s for s in c.mesh.shape))
    )
    return candidates
