"""Tier fitting is stable under measurement noise: pairs measured several
times (the median kept) split into tiers only where bandwidths differ beyond
the repeats' spread. Synthetic measurements with the noise of a busy machine
(log-normal, 25 % per measurement): one link class always gives one tier,
two classes 10x apart always two; a single measurement per pair at the old
fixed tolerance splits one class in a quarter of the seeds (as `automap detect` did:
2 tiers, then 1, on the same machine)."""

from __future__ import annotations

import numpy as np

from automap.cluster.topology import DEFAULT_REL_TOL, fit_tiers, significant_rel_tol

N, REPEATS, NOISE = 8, 3, 0.25


def _true_bandwidth(two_classes: bool) -> np.ndarray:
    bw = np.full((N, N), 1e9)
    if two_classes:
        half = N // 2
        bw[:half, :half] = bw[half:, half:] = 1e10
    return bw


def _measure(two_classes: bool, seed: int, repeats: int):
    """Per pair the log bandwidth of each repeat; the median matrix."""
    rng = np.random.default_rng(seed)
    iu, ju = np.triu_indices(N, 1)
    truth = np.log(_true_bandwidth(two_classes)[iu, ju])
    logs = truth[:, None] + rng.normal(0.0, NOISE, size=(len(iu), repeats))
    bandwidth = np.zeros((N, N))
    bandwidth[iu, ju] = bandwidth[ju, iu] = np.exp(np.median(logs, axis=1))
    return logs, bandwidth


def _tiers(bandwidth, rel_tol) -> int:
    return len(fit_tiers(np.full((N, N), 1e-5), bandwidth, rel_tol).tiers)


def test_repeated_medians_with_a_significance_threshold_are_stable():
    old_splits = 0
    for seed in range(200):
        logs, bandwidth = _measure(False, seed, REPEATS)
        assert _tiers(bandwidth, significant_rel_tol(logs)) == 1, seed
        logs, bandwidth = _measure(True, seed, REPEATS)
        assert _tiers(bandwidth, significant_rel_tol(logs)) == 2, seed
        # The old reading: one measurement per pair, the fixed tolerance.
        _, single = _measure(False, seed, 1)
        old_splits += _tiers(single, DEFAULT_REL_TOL) > 1
    print(f"one link class split into several tiers by the old rule in {old_splits}/200 seeds")
    assert old_splits > 20  # 49 of 200


def test_the_threshold_follows_the_noise():
    quiet = np.log(1e9) + np.random.default_rng(0).normal(0, 0.01, size=(28, 3))
    noisy = np.log(1e9) + np.random.default_rng(0).normal(0, 0.5, size=(28, 3))
    assert significant_rel_tol(quiet) == DEFAULT_REL_TOL  # never below the floor
    assert significant_rel_tol(noisy) > 1.0  # 50 % noise: gaps under 2x do not split
    assert significant_rel_tol(quiet[:, :1]) == DEFAULT_REL_TOL  # one run: no spread known
