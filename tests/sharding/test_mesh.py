"""Device mesh: rank/coordinate mapping, axis groups, collective costs and algorithms, errors."""

from __future__ import annotations

import pytest

from automap import DeviceMesh, InvalidMeshError


def test_rank_coordinate_mapping_any_order_any_size():
    mesh = DeviceMesh((3, 2), ranks=[4, 2, 0, 5, 3, 1], axis_names=("dp", "tp"))
    assert mesh.coordinate(4) == (0, 0)
    assert mesh.coordinate(1) == (2, 1)
    for r in mesh.ranks:
        assert mesh.rank_at(mesh.coordinate(r)) == r
    assert mesh.axis_groups("tp") == [[4, 2], [0, 5], [3, 1]]
    assert mesh.axis_groups("dp") == [[4, 0, 3], [2, 5, 1]]
    assert mesh.axis_groups(["dp", "tp"]) == [[4, 2, 0, 5, 3, 1]]
    assert mesh.axis_groups(["tp", "dp"]) == [[4, 0, 3, 2, 5, 1]]


def test_ring_formulas_per_axis_and_group():
    mesh = DeviceMesh((4, 2), alpha_s=[1e-6, 1e-5], bandwidth_bytes_per_s=[1e11, 1e10])
    b = 1e8
    assert mesh.all_reduce_cost_s(b, 0) == pytest.approx(2 * 3 / 4 * b / 1e11 + 1e-6)
    assert mesh.all_gather_cost_s(b, 1) == pytest.approx(1 / 2 * b / 1e10 + 1e-5)
    assert mesh.reduce_scatter_cost_s(b, 0) == pytest.approx(3 / 4 * b / 1e11 + 1e-6)
    assert mesh.all_to_all_cost_s(b, 1) == pytest.approx(1 / 2 * b / 1e10 + 1e-5)
    assert mesh.broadcast_cost_s(b, 0) == pytest.approx(b / 1e11 + 1e-6)
    assert DeviceMesh((1, 4)).all_reduce_cost_s(b, 0) == 0.0


def test_collectives_over_several_axes_cost_the_algorithm_that_runs():
    # Axis 0 fast (4 devices), axis 1 slow (2 devices).
    mesh = DeviceMesh((4, 2), alpha_s=[1e-6, 1e-5], bandwidth_bytes_per_s=[1e11, 1e10])
    b = 1e8
    plan = mesh.collective_plan("all_reduce", b, (1, 0))
    # Reduce-scatter inside the fast axis, all-reduce the quarter across the slow
    # one, all-gather back: 4.0 ms, where one ring at the slow pace takes 17.5 ms.
    assert not plan.flat
    assert [(s.kind, s.axes, s.nbytes) for s in plan.steps] == [
        ("reduce_scatter", [0], b), ("all_reduce", [1], b / 4), ("all_gather", [0], b)]
    inner = 3 / 4 * b / 1e11 + 1e-6
    assert plan.cost_s == pytest.approx(2 * inner + 2 * 1 / 2 * (b / 4) / 1e10 + 1e-5)
    assert plan.cost_s == pytest.approx(sum(s.cost_s for s in plan.steps))
    assert mesh.all_reduce_cost_s(b, (0, 1)) == plan.cost_s
    assert plan.cost_s < 2 * 7 / 8 * b / 1e10 + 1e-5
    gather = mesh.collective_plan("all_gather", b, (0, 1))
    assert [(s.kind, s.axes, s.nbytes) for s in gather.steps] == [
        ("all_gather", [1], b / 4), ("all_gather", [0], b)]
    # A few bytes: latency decides, and one ring pays one latency.
    small = mesh.collective_plan("all_reduce", 64, (0, 1))
    assert small.flat and [s.axes for s in small.steps] == [[0, 1]]
    assert small.cost_s == pytest.approx(2 * 7 / 8 * 64 / 1e10 + 1e-5)
    # Equal links: the ring moves the same bytes as any chain, with one latency.
    uniform = DeviceMesh((4, 2))
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast"):
        assert uniform.collective_plan(kind, b, (0, 1)).flat
    assert DeviceMesh((1, 4)).collective_plan("all_reduce", b, (0,)).steps == []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(shape=(2, 2), ranks=[0, 1, 2]), "holds 4 devices but 3 ranks"),
        (dict(shape=(2, 2), ranks=[0, 1, 1, 2]), "appears twice"),
        (dict(shape=(2, 0)), "size 0"),
        (dict(shape=()), "at least one axis"),
        (dict(shape=(2,), alpha_s=[1e-6, 1e-6]), "alpha_s has 2 entries"),
        (dict(shape=(2,), bandwidth_bytes_per_s=0), "must be finite and > 0"),
        (dict(shape=(2, 2), axis_names=("a", "a")), "name each"),
        (dict(shape=(2,), backend=""), "backend must be"),
        (dict(shape=(2,), backend=3), "backend must be"),
    ],
)
def test_bad_meshes_raise_typed_errors(kwargs, match):
    with pytest.raises(InvalidMeshError, match=match):
        DeviceMesh(**kwargs)


def test_bad_queries_raise_typed_errors():
    mesh = DeviceMesh((2, 2))
    with pytest.raises(InvalidMeshError, match="not in the mesh"):
        mesh.coordinate(9)
    with pytest.raises(InvalidMeshError, match="out of range"):
        mesh.all_reduce_cost_s(1.0, 2)
    with pytest.raises(InvalidMeshError, match="named twice"):
        mesh.axis_groups([0, 0])
    with pytest.raises(InvalidMeshError, match="named twice"):
        mesh.collective_plan("all_reduce", 1.0, [1, 1])
    with pytest.raises(ValueError, match="unknown collective"):
        mesh.collective_cost_s("gather_all", 1.0)


def test_round_trip_and_equality():
    mesh = DeviceMesh((2, 3), ranks=[5, 4, 3, 2, 1, 0], alpha_s=2e-6)
    again = DeviceMesh.from_dict(mesh.to_dict())
    assert again == mesh and hash(again) == hash(mesh)
    assert "ranks=[5, 4, 3, 2, 1, 0]" in repr(mesh)


def test_gloo_prices_a_reduce_scatter_as_the_all_reduce_it_runs():
    """gloo has no reduce-scatter: the program all-reduces the stacked input
    (``collectives._flat_reduce_scatter``), so a mesh on gloo prices it so, step
    by step, everywhere the planner asks (strategies, FSDP gathers, traffic)."""
    links = dict(alpha_s=[2e-5, 5e-6], bandwidth_bytes_per_s=[2.5e10, 2e11])
    native, gloo = DeviceMesh((2, 4), **links), DeviceMesh((2, 4), **links, backend="gloo")
    nbytes = 8e6
    for axes in ((0,), (1,)):
        assert gloo.reduce_scatter_cost_s(nbytes, axes) == native.all_reduce_cost_s(nbytes, axes)
        assert native.reduce_scatter_cost_s(nbytes, axes) < gloo.reduce_scatter_cost_s(nbytes,
                                                                                       axes)
    for kind in ("all_gather", "all_to_all", "broadcast"):  # what gloo runs natively
        assert gloo.collective_cost_s(kind, nbytes, (0, 1)) == native.collective_cost_s(
            kind, nbytes, (0, 1))
    # Per-axis steps: the same steps, each scatter priced as an all-reduce of its bytes.
    plan = gloo.collective_plan("reduce_scatter", nbytes, (0, 1))
    assert [(s.kind, s.axes, s.nbytes) for s in plan.steps] == [
        (s.kind, s.axes, s.nbytes)
        for s in native.collective_plan("reduce_scatter", nbytes, (0, 1)).steps]
    assert plan.cost_s == pytest.approx(sum(
        native.all_reduce_cost_s(s.nbytes, s.axes) for s in plan.steps), rel=1e-12)
    # An all-reduce scattered along the fast axis pays the scatter twice there:
    # never cheaper than before, and a flat ring where that tips the choice.
    for n in (1e3, 1e6, 1e9):
        assert gloo.all_reduce_cost_s(n, (0, 1)) >= native.all_reduce_cost_s(n, (0, 1))
    assert gloo.with_backend(None) == native and native.with_backend("gloo") == gloo
    assert gloo != native and DeviceMesh.from_dict(gloo.to_dict()) == gloo
    assert "backend" not in native.to_dict() and "backend='gloo'" in repr(gloo)
    nccl = native.with_backend("nccl")
    assert nccl.reduce_scatter_cost_s(nbytes, 0) == native.reduce_scatter_cost_s(nbytes, 0)
