"""The Cluster: JSON round trip, hand-written descriptions, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from automap import DeviceMesh, InvalidMeshError
from automap.cluster.cluster import Cluster, Device
from automap.cluster.topology import GroupLink

PAPER_BOX_BY_HAND = {
    "version": 1,
    "devices": 8,
    "device": {"kind": "cuda", "name": "A100", "sustained_flops_per_s": 1.5e14,
               "memory_bytes": 80 * 2**30},
    "tiers": [
        {"group_size": 2, "alpha_s": 5e-6, "bandwidth_bytes_per_s": 2e11},
        {"group_size": 4, "alpha_s": 1e-5, "bandwidth_bytes_per_s": 2e10},
        {"group_size": 8, "alpha_s": 2e-5, "bandwidth_bytes_per_s": 1e10},
    ],
}


def write(tmp_path, data) -> str:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(path)


def measured_like_cluster() -> Cluster:
    """What the detector returns: devices on two hosts, a noisy matrix,
    a group measurement and free-form metadata."""
    rng = np.random.default_rng(1)
    n = 4
    bandwidth = np.where(np.arange(n)[:, None] // 2 == np.arange(n) // 2, 5e10, 1e10)
    bandwidth = bandwidth * rng.uniform(0.95, 1.05, (n, n))
    bandwidth = np.minimum(bandwidth, bandwidth.T)
    alpha = np.full((n, n), 2e-5) * rng.uniform(0.9, 1.1, (n, n))
    alpha = np.maximum(alpha, alpha.T)
    devices = [Device(rank=r, host=f"node{r // 2}", local_rank=r % 2, kind="cuda",
                      name="H100", sustained_flops_per_s=4e14 + r, memory_bytes=80 * 2**30)
               for r in range(n)]
    link = GroupLink(((0, 2), (1, 3)), 4e-5, 8e9)
    return Cluster(devices, alpha, bandwidth, group_links=[link], rel_tol=0.3,
                   measurement={"backend": "nccl", "wall_s": 1.5, "sizes_bytes": [8, 1 << 20]})


def test_json_round_trip_is_exact(tmp_path):
    cluster = measured_like_cluster()
    path = tmp_path / "c.json"
    cluster.to_json(path)
    loaded = Cluster.from_json(path)
    assert loaded.devices == cluster.devices
    assert np.array_equal(loaded.alpha_s, cluster.alpha_s)
    assert np.array_equal(loaded.bandwidth_bytes_per_s, cluster.bandwidth_bytes_per_s)
    assert loaded.group_links == cluster.group_links
    assert loaded.rel_tol == 0.3 and loaded.measurement == cluster.measurement
    assert loaded.meshes() == cluster.meshes()
    assert loaded.to_dict() == cluster.to_dict()
    data = json.loads(path.read_text())
    assert data["format"] == "automap.cluster.cluster" and data["version"] == 1
    assert data["hosts"] == ["node0", "node1"]
    assert [t["groups"] for t in data["tiers"]] == [[[0, 1], [2, 3]], [[0, 1, 2, 3]]]
    # One line per matrix row, not per number.
    assert len(path.read_text().splitlines()) < 100


def test_measured_group_link_overrides_the_axis_it_matches():
    cluster = measured_like_cluster()
    by_shape = {c.mesh.shape: c for c in cluster.candidates()}
    mesh = by_shape[(2, 2)].mesh
    assert by_shape[(2, 2)].measured_axes == (True, False)
    assert mesh.bandwidth_bytes_per_s[0] == 8e9 and mesh.alpha_s[0] == 4e-5
    assert sorted(map(sorted, mesh.axis_groups(0))) == [[0, 2], [1, 3]]
    assert by_shape[(4,)].measured_axes == (False,)


def test_device_properties():
    cluster = measured_like_cluster()
    assert cluster.num_devices == 4 and cluster.hosts == ("node0", "node1")
    assert cluster.sustained_flops_per_s == 4e14  # the slowest device paces the step
    assert cluster.memory_bytes == 80 * 2**30
    unknown = Cluster(2, [[0, 1e-5], [1e-5, 0]], [[0, 1e9], [1e9, 0]])
    assert unknown.sustained_flops_per_s is None and unknown.memory_bytes is None
    # Its meshes price collectives as the devices' backend runs them.
    assert cluster.backend == "nccl" and unknown.backend == "gloo"
    assert {m.backend for m in unknown.meshes()} == {"gloo"}


def test_shared_slowdown_round_trips_and_old_files_load_as_one(tmp_path):
    """``automap detect`` stores the ranks' shared slowdown per device; a plan
    made from the file prices with it (the largest), and a file written
    before it was stored loads with None, which plans as 1."""
    from automap.cluster.device import resolve_device_profile

    cluster = measured_like_cluster()
    devices = [Device(**{**vars(d), "op_overhead_s": 5e-6, "memory_bandwidth_bytes_per_s": 1e12,
                         "shared_slowdown": 2.0 + d.rank / 4}) for d in cluster.devices]
    shared = Cluster(devices, cluster.alpha_s, cluster.bandwidth_bytes_per_s)
    path = tmp_path / "shared.json"
    shared.to_json(path)
    loaded = Cluster.from_json(path)
    assert [d.shared_slowdown for d in loaded.devices] == [2.0, 2.25, 2.5, 2.75]
    assert loaded.device_profile["shared_slowdown"] == 2.75
    assert "2.75x faster alone" in loaded.summary()
    profile = resolve_device_profile(known=loaded.device_profile)
    assert profile.shared_slowdown == 2.75
    # A file from before: no "shared_slowdown" key anywhere.
    data = json.loads(path.read_text())
    for device in data["devices"]:
        del device["shared_slowdown"]
    old = Cluster.from_dict(data)
    assert all(d.shared_slowdown is None for d in old.devices)
    assert old.device_profile["shared_slowdown"] is None
    assert resolve_device_profile(known=old.device_profile).shared_slowdown == 1.0
    # The argument still overrides the file.
    assert resolve_device_profile(known=loaded.device_profile,
                                  shared_slowdown=1.5).shared_slowdown == 1.5


def test_hand_written_paper_box(tmp_path):
    cluster = Cluster.from_json(write(tmp_path, PAPER_BOX_BY_HAND))
    assert cluster.sustained_flops_per_s == 1.5e14 and cluster.memory_bytes == 80 * 2**30
    assert [d.kind for d in cluster.devices] == ["cuda"] * 8
    best = cluster.meshes()[0]
    assert best == DeviceMesh(
        (2, 2, 2), alpha_s=(2e-5, 1e-5, 5e-6), bandwidth_bytes_per_s=(1e10, 2e10, 2e11),
        backend="nccl")
    assert len(cluster.meshes(limit=2)) == 2
    assert [m.ndim for m in cluster.meshes(max_axes=2)] == [2, 2, 1]
    summary = cluster.summary()
    assert "200.000 GB/s" in summary and "mesh (2, 2, 2)" in summary
    assert "measured" not in summary


def test_hand_written_groups_and_links(tmp_path):
    # NVLink between i and i+4 (not neighbours), one slower tier for the rest.
    by_groups = {
        "version": 1,
        "devices": [{"rank": r, "host": "box"} for r in range(8)],
        "tiers": [
            {"groups": [[0, 4], [1, 5], [2, 6], [3, 7]], "alpha_s": 5e-6,
             "bandwidth_bytes_per_s": 2e11},
            {"groups": [list(range(8))], "alpha_s": 1e-5, "bandwidth_bytes_per_s": 2e10},
        ],
    }
    best = Cluster.from_json(write(tmp_path, by_groups)).meshes()[0]
    assert best.shape == (4, 2) and best.bandwidth_bytes_per_s == (2e10, 2e11)
    assert sorted(map(sorted, best.axis_groups(1))) == [[0, 4], [1, 5], [2, 6], [3, 7]]

    by_links = {"version": 1, "devices": 2,
                "links": {"alpha_s": [[0, 1e-5], [1e-5, 0]],
                          "bandwidth_bytes_per_s": [[0, 3e9], [3e9, 0]]}}
    cluster = Cluster.from_json(write(tmp_path, by_links))
    # Devices of no stated kind are CPUs: their collectives are priced as on gloo.
    assert cluster.meshes() == [DeviceMesh(2, alpha_s=1e-5, bandwidth_bytes_per_s=3e9,
                                           backend="gloo")]


def test_asymmetric_matrix_takes_the_slower_direction():
    cluster = Cluster(2, [[0, 1e-5], [3e-5, 0]], [[0, 4e9], [2e9, 0]])
    assert cluster.bandwidth_bytes_per_s[0, 1] == cluster.bandwidth_bytes_per_s[1, 0] == 2e9
    assert cluster.alpha_s[0, 1] == cluster.alpha_s[1, 0] == 3e-5


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.pop("version"), '"version"'),
        (lambda d: d.update(version=2), "version 2"),
        (lambda d: d.update(format="something.else"), "not a cluster description"),
        (lambda d: d.pop("tiers"), '"links" or "tiers"'),
        (lambda d: d["tiers"].pop(), "the last tier must hold every device"),
        (lambda d: d["tiers"][0].update(group_size=3), "does not divide"),
        (lambda d: d["tiers"][0].pop("group_size"), "malformed"),
        (lambda d: d["tiers"][0].pop("group_size") and d["tiers"][0].update(
            groups=[[0, 1], [1, 2]]), "disjoint"),
        (lambda d: d["tiers"][1].update(bandwidth_bytes_per_s=-1.0), "bandwidth"),
        (lambda d: d["device"].update(colour="blue"), "malformed"),
        (lambda d: d.update(devices="eight"), '"devices"'),
        (lambda d: d.update(tier_rel_tol=0), "tier_rel_tol"),
        (lambda d: d.update(group_links=[{"groups": [[0, 1]], "alpha_s": 0,
                                          "bandwidth_bytes_per_s": 1e9}]), "partition"),
    ],
)
def test_invalid_descriptions(tmp_path, change, message):
    data = json.loads(json.dumps(PAPER_BOX_BY_HAND))
    change(data)
    with pytest.raises(InvalidMeshError, match=message):
        Cluster.from_json(write(tmp_path, data))


def test_invalid_files_and_matrices(tmp_path):
    with pytest.raises(InvalidMeshError, match="not valid JSON"):
        Cluster.from_json(write(tmp_path, "{version: 1"))
    with pytest.raises(InvalidMeshError, match="JSON object"):
        Cluster.from_json(write(tmp_path, [1, 2]))
    with pytest.raises(FileNotFoundError):
        Cluster.from_json(tmp_path / "missing.json")
    with pytest.raises(InvalidMeshError, match="3 devices"):
        Cluster(3, np.zeros((2, 2)), np.ones((2, 2)))
    with pytest.raises(InvalidMeshError, match="N x N"):
        Cluster(2, np.zeros((2, 3)), np.ones((2, 3)))
    with pytest.raises(InvalidMeshError, match="finite"):
        Cluster(2, [[0, 1e-5], [1e-5, 0]], [[0, np.inf], [np.inf, 0]])
    with pytest.raises(InvalidMeshError, match="latency"):
        Cluster(2, [[0, -1.0], [-1.0, 0]], [[0, 1e9], [1e9, 0]])
    with pytest.raises(InvalidMeshError, match="by rank"):
        Cluster([Device(rank=1), Device(rank=0)], np.zeros((2, 2)), np.ones((2, 2)))
