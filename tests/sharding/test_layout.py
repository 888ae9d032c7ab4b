"""Layout manager: optimal paths (checked against an independent pure-Python
search), never worse than MAP's heuristic, cost matrices, the shared cache."""

from __future__ import annotations

import numpy as np
import pytest

import automap
from automap import DeviceMesh, InvalidSpecError, ShardingSpec, enumerate_specs, layout_path
from pure_python_layout import PyLayoutProblem, to_tuple_spec

MESHES = [
    DeviceMesh((4,)),
    DeviceMesh((2, 2), alpha_s=[1e-6, 1e-5], bandwidth_bytes_per_s=[2e11, 2e10]),
    DeviceMesh((3, 2), alpha_s=[5e-6, 2e-6], bandwidth_bytes_per_s=[5e10, 1e11]),
    DeviceMesh((2, 2, 2), alpha_s=[1e-6, 5e-6, 2e-5], bandwidth_bytes_per_s=[2e11, 2e10, 1e10]),
]
SHAPES = {1: [[12, 24, 8]], 2: [[12, 12, 4]], 3: [[12, 6, 4]]}


def _walk(path):
    at = path.src
    for step in path.steps:
        assert step.before == at
        at = step.after
    return at


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(map(str, m.shape)))
def test_optimal_matches_reference_and_beats_heuristic(mesh):
    for shape in SHAPES[mesh.ndim]:
        specs = enumerate_specs(shape, mesh)
        ref = PyLayoutProblem(mesh.shape, mesh.alpha_s, mesh.bandwidth_bytes_per_s, shape, 2)
        for src in specs:
            for dst in specs:
                opt = layout_path(mesh, src, dst, shape, 2)
                heur = layout_path(mesh, src, dst, shape, 2, method="heuristic")
                assert _walk(opt) == dst and _walk(heur) == dst
                assert opt.cost_s <= heur.cost_s * (1 + 1e-12)
                ref_cost, ref_steps = ref.optimal_path(to_tuple_spec(src), to_tuple_spec(dst))
                assert opt.cost_s == pytest.approx(ref_cost, rel=1e-12, abs=1e-18)
                assert len(opt) == len(ref_steps)


def test_step_costs_follow_the_alpha_beta_model():
    mesh = DeviceMesh((4,), alpha_s=1e-5, bandwidth_bytes_per_s=1e9)
    shape, nbytes = [64, 32], 64 * 32 * 4
    gather = layout_path(mesh, "S0R", "RR", shape).steps[0]
    assert gather.kind == "all_gather"
    assert gather.forward_cost_s == pytest.approx(3 / 4 * nbytes / 1e9 + 1e-5)
    assert gather.backward_cost_s == 0.0  # its dual is a local split
    shard = layout_path(mesh, "RR", "S0R", shape).steps[0]
    assert shard.kind == "shard" and shard.forward_cost_s == 0.0
    assert shard.backward_cost_s == pytest.approx(gather.forward_cost_s)
    a2a = layout_path(mesh, "S0R", "RS0", shape)
    assert [s.kind for s in a2a.steps] == ["all_to_all"]
    assert a2a.forward_cost_s == pytest.approx(3 / 4 * nbytes / 4 / 1e9 + 1e-5)
    assert a2a.cost_s == pytest.approx(2 * a2a.forward_cost_s)
    assert len(layout_path(mesh, "S0R", "S0R", shape)) == 0


def test_cost_matrix_equals_single_paths():
    mesh = MESHES[3]
    shape = [8, 8]
    specs = enumerate_specs(shape, mesh)[:20]
    total = automap.resharding_cost_matrix(mesh, specs, specs[::-1], shape)
    fwd = automap.resharding_cost_matrix(mesh, specs, specs[::-1], shape, component="forward")
    assert total.shape == (20, 20)
    for i, s in enumerate(specs):
        for j, d in enumerate(specs[::-1]):
            p = layout_path(mesh, s, d, shape)
            assert total[i, j] == p.cost_s and fwd[i, j] == p.forward_cost_s
    assert np.all(np.diag(automap.resharding_cost_matrix(mesh, specs, specs, shape)) == 0)


def test_cache_is_shared_and_keyed_by_dtype_and_mesh():
    automap.clear_layout_cache()
    mesh = DeviceMesh((2, 2))
    layout_path(mesh, "S0R", "RS1", [8, 8])
    assert automap.layout_cache_stats() == (0, 1)
    layout_path(DeviceMesh((2, 2)), ShardingSpec.parse("S0R"), "RS1", [8, 8])
    assert automap.layout_cache_stats() == (1, 1)
    layout_path(mesh, "S0R", "RS1", [8, 8], dtype_bytes=2)  # other dtype: new search
    layout_path(DeviceMesh((2, 2), alpha_s=1.0), "S0R", "RS1", [8, 8])  # other links
    assert automap.layout_cache_stats() == (1, 3)


def test_invalid_endpoints_raise_typed_errors():
    mesh = DeviceMesh((2, 2))
    with pytest.raises(InvalidSpecError, match="dim 0 of size 6 cannot be split into 4"):
        layout_path(mesh, "S01R", "RR", [6, 4])
    with pytest.raises(InvalidSpecError, match="mesh axis 2"):
        layout_path(mesh, "S2R", "RR", [8, 8])
    with pytest.raises(InvalidSpecError):
        automap.resharding_cost_matrix(mesh, ["RR"], ["S0S0"], [8, 8])
    with pytest.raises(ValueError, match="method"):
        layout_path(mesh, "RR", "RR", [8, 8], method="greedy")
