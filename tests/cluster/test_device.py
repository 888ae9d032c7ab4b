"""The device profile (issue 14, acceptance 4): measured on this CPU, cached
per process, typed errors for bad speeds, and the order in which a plan takes
its speeds (given, the cluster's, measured here; never a GPU's on a CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from automap import DeviceMesh, InvalidCostModelError
from automap.cluster import device as device_module
from automap.cluster.cluster import Cluster, Device
from automap.cluster.device import (
    GPU_FALLBACK,
    DeviceProfile,
    local_device_profile,
    measure_device_profile,
    resolve_device_profile,
)
from automap.planner.search import plan
from model_zoo import mlp


def test_measured_on_this_cpu_and_cached():
    measured = measure_device_profile("cpu")
    assert measured.flops_per_s > 1e8 and measured.memory_bandwidth_bytes_per_s > 1e8
    assert 0 < measured.op_overhead_s < 1e-2
    first = local_device_profile("cpu")
    assert local_device_profile("cpu") is first  # measured once per process


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, "fast", None, True])
def test_bad_speeds_are_typed_errors_naming_the_argument(value):
    with pytest.raises(InvalidCostModelError, match="memory_bandwidth_bytes_per_s"):
        DeviceProfile(1e12, value, 1e-6)
    if value is not None:  # None means "not given" to plan
        model, inputs, loss = mlp()
        with pytest.raises(InvalidCostModelError, match="op_overhead_s"):
            plan(model, inputs, DeviceMesh((2,)), loss_fn=loss, op_overhead_s=value)


def test_given_then_the_clusters_then_measured_here(monkeypatch):
    here = DeviceProfile(2e10, 3e10, 4e-6)
    monkeypatch.setitem(device_module._measured,
                        ("cpu", torch.float32, torch.get_num_threads()), here)
    known = {"flops_per_s": 5e10, "memory_bandwidth_bytes_per_s": None, "op_overhead_s": 7e-6}
    resolved = resolve_device_profile(flops_per_s=1e11, known=known, kind="cpu")
    assert resolved == DeviceProfile(1e11, 3e10, 7e-6)
    # CUDA devices planned from a process without a GPU: never the CPU's speeds.
    if not torch.cuda.is_available():
        gpu = resolve_device_profile(known={"flops_per_s": 3e14}, kind="cuda")
        assert gpu == DeviceProfile(3e14, GPU_FALLBACK["memory_bandwidth_bytes_per_s"],
                                    GPU_FALLBACK["op_overhead_s"])
    # plan() on a CPU with no speeds given: this process's measured profile
    # (where a GPU is visible, the GPU's).
    if not torch.cuda.is_available():
        model, inputs, loss = mlp()
        p = plan(model, inputs, DeviceMesh((2,)), loss_fn=loss)
        assert {k: p.cost_constants[k] for k in here.to_dict()} == here.to_dict()


def test_cluster_profile_is_the_slowest_device():
    devices = [Device(rank=r, sustained_flops_per_s=1e12 + r,
                      memory_bandwidth_bytes_per_s=1e11 - r, op_overhead_s=1e-6 * (r + 1))
               for r in range(4)]
    cluster = Cluster(devices, *_links(4))
    assert cluster.device_profile == {"flops_per_s": 1e12,
                                      "memory_bandwidth_bytes_per_s": 1e11 - 3,
                                      "op_overhead_s": 4e-6,
                                      "shared_slowdown": None,  # not measured: plans take 1
                                      "library_workspace_bytes": None}
    again = Cluster.from_dict(cluster.to_dict())
    assert again.devices == cluster.devices


def _links(n: int):
    alpha = [[0.0 if i == j else 1e-5 for j in range(n)] for i in range(n)]
    bandwidth = [[0.0 if i == j else 1e10 for j in range(n)] for i in range(n)]
    return alpha, bandwidth


def test_a_mesh_is_planned_with_the_speeds_of_its_backends_devices(monkeypatch):
    """Without speeds, a gloo mesh is planned with this CPU's and an NCCL one
    with a GPU's (this one's, or ``GPU_FALLBACK`` where none is visible): an
    NCCL mesh planned on a CPU took the CPU's figures, a gloo mesh planned
    where a GPU is visible the GPU's."""
    cpu = DeviceProfile(2e10, 3e10, 4e-6)
    monkeypatch.setitem(device_module._measured,
                        ("cpu", torch.float32, torch.get_num_threads()), cpu)
    model, inputs, loss = mlp()
    on_cpus = plan(model, inputs, DeviceMesh((2,), backend="gloo"), loss_fn=loss)
    assert {k: on_cpus.cost_constants[k] for k in cpu.to_dict()} == cpu.to_dict()
    if not torch.cuda.is_available():
        on_gpus = plan(model, inputs, DeviceMesh((2,), backend="nccl"), loss_fn=loss)
        assert {k: on_gpus.cost_constants[k] for k in GPU_FALLBACK} == GPU_FALLBACK
