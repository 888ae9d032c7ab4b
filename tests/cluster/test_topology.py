"""Mesh construction from a link matrix (issue 7, acceptance 2): the MAP
paper's 8-GPU box, relabelled, noisy, and clusters of other sizes."""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from automap.cluster.cluster import Cluster
from automap.cluster.topology import DEFAULT_REL_TOL, cluster_values, factorizations, fit_tiers

GB = 1e9
NVLINK, PCIE, CROSS_NUMA = 200 * GB, 20 * GB, 10 * GB
LATENCY_S = {NVLINK: 5e-6, PCIE: 10e-6, CROSS_NUMA: 15e-6}


def hierarchy_links(level_sizes, bandwidths, perm=None, noise=0.0, seed=0):
    """Link matrices of a hierarchy: devices a and b are linked at the first
    level whose consecutive blocks of ``level_sizes[l]`` devices hold both
    (before relabelling by ``perm``: physical device d gets id perm[d]);
    multiplicative uniform noise of +-``noise`` on every pair."""
    n = level_sizes[-1]
    perm = list(range(n)) if perm is None else list(perm)
    rng = np.random.default_rng(seed)
    bandwidth = np.zeros((n, n))
    alpha = np.zeros((n, n))
    for a, b in itertools.combinations(range(n), 2):
        level = next(i for i, s in enumerate(level_sizes) if a // s == b // s)
        bw = bandwidths[level]
        scale_bw, scale_alpha = 1 + noise * rng.uniform(-1, 1, size=2)
        i, j = perm[a], perm[b]
        bandwidth[i, j] = bandwidth[j, i] = bw * scale_bw
        alpha[i, j] = alpha[j, i] = LATENCY_S.get(bw, 1e-5) * scale_alpha
    return alpha, bandwidth


def paper_box(perm=None, noise=0.0, seed=0) -> Cluster:
    """NVLink pairs 0-1, 2-3, 4-5, 6-7; PCIe inside NUMA {0..3}, {4..7}; a
    slower link across NUMA."""
    return Cluster(8, *hierarchy_links((2, 4, 8), (NVLINK, PCIE, CROSS_NUMA), perm, noise, seed))


def partition(groups) -> frozenset:
    return frozenset(frozenset(g) for g in groups)


def suffix_partitions(mesh) -> list[frozenset]:
    """The groups over the innermost k axes, k = 1 .. ndim-1: the hierarchy
    the mesh follows, which no relabelling may change."""
    return [partition(mesh.axis_groups(list(range(k, mesh.ndim)))) for k in range(1, mesh.ndim)]


def relabel(groups, perm) -> frozenset:
    return partition([[perm[d] for d in g] for g in groups])


def test_paper_box_gives_2x2x2_with_nvlink_inside_and_numa_outside():
    cluster = paper_box()
    assert [t.bandwidth_bytes_per_s for t in cluster.tiers] == [NVLINK, PCIE, CROSS_NUMA]
    assert cluster.tiers[0].groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert cluster.tiers[1].groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    best = cluster.candidates()[0]
    mesh = best.mesh
    assert mesh.shape == (2, 2, 2)
    assert best.homogeneous == (True, True, True)
    assert partition(mesh.axis_groups(2)) == partition([[0, 1], [2, 3], [4, 5], [6, 7]])
    numa = [set(range(4)), set(range(4, 8))]
    for group in mesh.axis_groups(1):  # inside one NUMA node, across NVLink pairs
        assert any(set(group) <= node for node in numa)
        assert group[0] // 2 != group[1] // 2
    for group in mesh.axis_groups(0):  # one device from each NUMA node
        assert sorted(d // 4 for d in group) == [0, 1]
    assert mesh.bandwidth_bytes_per_s == (CROSS_NUMA, PCIE, NVLINK)
    assert mesh.alpha_s == (15e-6, 10e-6, 5e-6)


def test_paper_box_ranking_and_conservative_costs():
    candidates = paper_box().candidates()
    shapes = [c.mesh.shape for c in candidates]
    assert shapes == [(2, 2, 2), (4, 2), (2, 4), (8,)]
    scores = [c.score_s for c in candidates]
    assert scores == sorted(scores)
    by_shape = {c.mesh.shape: c for c in candidates}
    # An axis mixing tiers is charged its slowest link: the (2, 4) mesh's
    # inner axis is a NUMA node (NVLink and PCIe), so PCIe.
    assert by_shape[(2, 4)].mesh.bandwidth_bytes_per_s == (CROSS_NUMA, PCIE)
    assert by_shape[(2, 4)].homogeneous == (True, False)
    assert by_shape[(8,)].mesh.bandwidth_bytes_per_s == (CROSS_NUMA,)
    # The hierarchical all-reduce that ranks them, by hand for the 2x2x2 mesh.
    b = 2.0**30
    expected = 2 * sum(
        0.5 * (b / inner) / bw + alpha
        for inner, bw, alpha in [(1, NVLINK, 5e-6), (2, PCIE, 10e-6), (4, CROSS_NUMA, 15e-6)]
    )
    assert math.isclose(candidates[0].score_s, expected, rel_tol=1e-12)


@settings(max_examples=30, deadline=None)
@given(st.permutations(range(8)))
def test_relabelled_box_gives_the_same_mesh_relabelled(perm):
    reference = paper_box().meshes()
    relabelled = paper_box(perm=perm).meshes()
    assert [(m.shape, m.alpha_s, m.bandwidth_bytes_per_s) for m in relabelled] == [
        (m.shape, m.alpha_s, m.bandwidth_bytes_per_s) for m in reference
    ]
    for ref, got in zip(reference, relabelled):
        assert suffix_partitions(got) == [relabel(p, perm) for p in suffix_partitions(ref)]
    # Each single axis links the same kind of devices as before.
    best, ref = relabelled[0], reference[0]
    physical = np.argsort(perm)

    def link_kinds(mesh, axis, device):  # (same NVLink pair, same NUMA node) per group
        return {(device[a] // 2 == device[b] // 2, device[a] // 4 == device[b] // 4)
                for a, b in mesh.axis_groups(axis)}

    for axis in range(3):
        kinds = link_kinds(best, axis, physical)
        assert kinds == link_kinds(ref, axis, np.arange(8)) and len(kinds) == 1


@pytest.mark.parametrize("noise, rel_tol", [(0.10, DEFAULT_REL_TOL), (0.15, 0.4)])
@settings(max_examples=25, deadline=None)
@given(perm=st.permutations(range(8)), seed=st.integers(0, 2**32 - 1))
def test_noise_does_not_change_the_mesh(noise, rel_tol, perm, seed):
    # +-10% noise spreads a tier by at most 1.1/0.9 < 1.25 and leaves a gap
    # of 18/11 between PCIe and across NUMA; +-15% needs the tolerance the
    # detector derives from noise of that size (its spread is 1.35 < 1.4).
    clean = paper_box(perm=perm).meshes()[0]
    alpha, bandwidth = hierarchy_links((2, 4, 8), (NVLINK, PCIE, CROSS_NUMA), perm, noise, seed)
    noisy = Cluster(8, alpha, bandwidth, rel_tol=rel_tol)
    assert len(noisy.tiers) == 3
    mesh = noisy.meshes()[0]
    assert mesh.shape == clean.shape and suffix_partitions(mesh) == suffix_partitions(clean)
    for got, want in zip(mesh.bandwidth_bytes_per_s, clean.bandwidth_bytes_per_s):
        assert abs(got / want - 1) <= noise


@pytest.mark.parametrize(
    "level_sizes, bandwidths, shape",
    [
        ((2, 6, 12), (NVLINK, PCIE, CROSS_NUMA), (2, 3, 2)),  # 2 NUMA x 3 NVLink pairs
        ((2, 6), (NVLINK, 25 * GB), (3, 2)),  # 3 hosts of 2 GPUs
        ((3, 6), (NVLINK, 25 * GB), (2, 3)),  # 2 hosts of 3 GPUs
        ((3, 9), (NVLINK, 25 * GB), (3, 3)),
    ],
)
def test_non_power_of_two_clusters(level_sizes, bandwidths, shape):
    n = level_sizes[-1]
    for perm in (None, list(np.random.default_rng(n).permutation(n))):
        alpha, bandwidth = hierarchy_links(level_sizes, bandwidths, perm)
        best = Cluster(n, alpha, bandwidth).candidates()[0]
        assert best.mesh.shape == shape
        assert all(best.homogeneous)
        assert best.mesh.bandwidth_bytes_per_s == tuple(reversed(bandwidths))
        physical = np.argsort(perm) if perm is not None else np.arange(n)
        for k, size in enumerate(level_sizes[:-1]):  # inner axes span exactly the blocks
            axes = list(range(len(shape) - 1 - k, len(shape)))
            blocks = {frozenset(int(physical[d]) // size for d in g)
                      for g in best.mesh.axis_groups(axes)}
            assert all(len(b) == 1 for b in blocks)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(2, 4), min_size=1, max_size=3), st.randoms(use_true_random=False))
def test_any_relabelled_hierarchy_gives_one_axis_per_tier(branching, random):
    # Levels innermost first, each at least 2x slower than the one inside it.
    level_sizes = tuple(itertools.accumulate(branching, lambda a, b: a * b))
    bandwidths = tuple(NVLINK / 3**k for k in range(len(branching)))
    n = level_sizes[-1]
    perm = random.sample(range(n), n)
    best = Cluster(n, *hierarchy_links(level_sizes, bandwidths, perm)).candidates()[0]
    assert best.mesh.shape == tuple(reversed(branching))
    assert all(best.homogeneous)
    assert best.mesh.bandwidth_bytes_per_s == tuple(reversed(bandwidths))
    blocks = [partition([[perm[d] for d in range(s, s + size)] for s in range(0, n, size)])
              for size in reversed(level_sizes[:-1])]
    assert suffix_partitions(best.mesh) == blocks


def test_uniform_cluster_prefers_the_flat_mesh():
    n = 6
    bandwidth = np.full((n, n), 50 * GB)
    candidates = Cluster(n, np.full((n, n), 1e-5), bandwidth).candidates()
    assert candidates[0].mesh.shape == (6,)
    assert all(all(c.homogeneous) for c in candidates)
    assert {c.mesh.shape for c in candidates} == set(factorizations(6))


def test_ring_links_that_are_not_a_hierarchy():
    # NVLink ring 0-1-2-3-0, diagonals over PCIe: the fast component is not a
    # clique, yet the best mesh keeps both axes pure and charges them honestly.
    bandwidth = np.full((4, 4), PCIE)
    for a in range(4):
        b = (a + 1) % 4
        bandwidth[a, b] = bandwidth[b, a] = NVLINK
    best = Cluster(4, np.full((4, 4), 1e-5), bandwidth).candidates()[0]
    assert best.mesh.shape == (2, 2)
    assert best.homogeneous == (True, True)
    assert best.mesh.bandwidth_bytes_per_s == (PCIE, NVLINK)
    for g in best.mesh.axis_groups(1):
        assert bandwidth[g[0], g[1]] == NVLINK


def test_single_device():
    cluster = Cluster(1, [[0.0]], [[0.0]])
    assert cluster.tiers == ()
    [mesh] = cluster.meshes()
    assert mesh.shape == (1,) and mesh.ranks == (0,)


def test_512_devices_in_polynomial_time():
    n = 512
    ids = np.arange(n)
    same_host = ids[:, None] // 8 == ids[None, :] // 8
    rng = np.random.default_rng(0)
    bandwidth = np.where(same_host, 200 * GB, 25 * GB) * rng.uniform(0.9, 1.1, (n, n))
    start = time.perf_counter()
    cluster = Cluster(n, np.full((n, n), 1e-5), bandwidth)
    candidates = cluster.candidates()
    elapsed_s = time.perf_counter() - start
    assert len(candidates) == len(factorizations(512)) == 37
    best = candidates[0].mesh
    assert best.shape == (64, 8)
    assert all(len({d // 8 for d in g}) == 1 for g in best.axis_groups(1))
    assert elapsed_s < 20, f"mesh construction for 512 devices took {elapsed_s:.1f} s"
    # Structureless values and a tiny tolerance: a thousand tiers, still fast.
    start = time.perf_counter()
    noise = Cluster(n, np.full((n, n), 1e-5), np.maximum(bandwidth, bandwidth.T), rel_tol=1e-4)
    assert len(noise.tiers) > 500 and noise.meshes()
    assert time.perf_counter() - start < 20


@given(st.integers(1, 400), st.integers(1, 3))
def test_factorizations_are_all_ordered_factorisations(n, max_axes):
    found = factorizations(n, max_axes)
    brute = {
        shape
        for k in range(1, max_axes + 1)
        for shape in itertools.product([d for d in range(2, n + 1) if n % d == 0], repeat=k)
        if math.prod(shape) == n
    } or {(1,)}
    assert sorted(found) == sorted(brute) and len(found) == len(set(found))


@given(
    st.lists(st.floats(1e8, 1e12), min_size=1, max_size=4, unique=True),
    st.integers(0, 2**32 - 1),
)
def test_cluster_values_recovers_separated_tiers(centres, seed):
    centres = sorted(centres, reverse=True)
    if any(a / b < 2.0 for a, b in zip(centres, centres[1:])):
        return  # tiers at least 2x apart, noise +-10%: gaps of 1.6x > 1 + rel_tol
    rng = np.random.default_rng(seed)
    truth = rng.integers(0, len(centres), size=50)
    truth[: len(centres)] = range(len(centres))
    values = np.array(centres)[truth] * rng.uniform(0.9, 1.1, size=50)
    assert (cluster_values(values) == truth).all()


def test_tree_order_makes_every_tier_group_contiguous():
    perm = [5, 2, 7, 0, 3, 6, 1, 4]
    topology = fit_tiers(*hierarchy_links((2, 4, 8), (NVLINK, PCIE, CROSS_NUMA), perm))
    position = {d: i for i, d in enumerate(topology.order)}
    for tier in topology.tiers:
        for group in tier.groups:
            spots = sorted(position[d] for d in group)
            assert spots == list(range(spots[0], spots[0] + len(group)))
