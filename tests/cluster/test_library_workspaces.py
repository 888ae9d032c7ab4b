"""The math libraries' workspaces (the first GPU run: every budgeted CUDA plan
measured 65-66 MiB over its budget, cuBLAS's and cuBLASLt's workspaces on an
H200): modelled from torch's defaults and their environment overrides, taken
from a cluster file, set aside from a CUDA plan's budget and reported in its
peak, breakdown and timeline; an error's least budget includes them."""

from __future__ import annotations

import pytest
import torch

from automap import InfeasibleBudgetError
from automap.cluster.cluster import Cluster
from automap.cluster.workspace import (
    capability_of_names,
    library_workspace_bytes,
    measure_library_workspace_bytes,
    modelled_library_workspace_bytes,
)
from automap.planner.search import plan
from model_zoo import mlp

MIB = 2**20


def test_modelled_from_torchs_defaults_per_matmul_thread():
    # Hopper: 32 MiB of cuBLAS and 1 MiB of cuBLASLt for the forward's thread
    # and autograd's: the 66 MiB the H200 run measured above its plans' peaks.
    assert modelled_library_workspace_bytes((9, 0), {}) == 2 * (32 + 1) * MIB
    # Elsewhere ":4096:2:16:8", 8 MiB + 128 KiB.
    assert modelled_library_workspace_bytes((8, 0), {}) == 2 * (8 * MIB + 128 * 1024 + MIB)


def test_modelled_with_the_environments_overrides():
    small = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}  # the deterministic setting
    assert modelled_library_workspace_bytes((9, 0), small) == 2 * (128 + 128) * 1024
    lt = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "CUBLASLT_WORKSPACE_SIZE": "4096"}
    assert modelled_library_workspace_bytes((8, 6), lt) == 2 * (32 + 4) * MIB
    unified = {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}
    assert modelled_library_workspace_bytes((9, 0), unified) == 2 * 32 * MIB
    unparsed = {"CUBLAS_WORKSPACE_CONFIG": "large", "CUBLASLT_WORKSPACE_SIZE": "big"}
    assert modelled_library_workspace_bytes((9, 0), unparsed) == 2 * 33 * MIB


def test_hopper_is_told_by_the_devices_names():
    assert capability_of_names(["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"]) == (9, 0)
    assert capability_of_names(["NVIDIA GH200 480GB"]) == (9, 0)
    assert capability_of_names(["NVIDIA A100-SXM4-80GB"]) is None
    assert capability_of_names(["NVIDIA H100", "NVIDIA A100"]) is None  # the default then
    assert capability_of_names(["", "NVIDIA H100"]) is None
    assert capability_of_names([]) is None


def test_cpus_hold_none_and_a_cluster_files_figure_wins():
    assert library_workspace_bytes("cpu") == 0
    assert measure_library_workspace_bytes("cpu") == 0
    assert library_workspace_bytes("cuda", {"library_workspace_bytes": 12345.0}) == 12345


def test_a_cluster_files_gpus_without_the_figure_are_modelled():
    # Not this process's GPU, where it has one: the file's devices may be others.
    assert library_workspace_bytes("cuda", {}) == modelled_library_workspace_bytes()
    assert library_workspace_bytes("cuda", {"compute_capability": (9, 0)}) == 66 * MIB


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU here is measured, not modelled")
def test_a_gpu_planned_from_a_cpu_is_modelled():
    assert library_workspace_bytes("cuda") == modelled_library_workspace_bytes()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_measured_on_this_gpu_as_a_step_leaves_them():
    measured = measure_library_workspace_bytes("cuda")
    assert measured > 0
    # What a training step's matmuls leave allocated beyond their tensors.
    torch._C._cuda_clearCublasWorkspaces()
    before = torch.cuda.memory_allocated()
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256)).cuda()
    held = torch.cuda.memory_allocated() - before
    model(torch.randn(32, 256, device="cuda")).sum().backward()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    assert torch.cuda.memory_allocated() - before - held - grads <= measured


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_estimate_on_a_gpu_adds_them(tmp_path, capsys):
    from automap.cli import main

    factory = tmp_path / "factory.py"
    factory.write_text("import torch\n"
                       "def build():\n"
                       "    return torch.nn.Linear(64, 8), (torch.randn(4, 64),)\n")
    assert main(["estimate", f"{factory}:build", "--device", "cuda"]) == 0
    printed = capsys.readouterr().out
    assert "cuBLAS/cuBLASLt workspaces" in printed and "peak with them" in printed


def _gpu_cluster(workspace_bytes: float | None) -> Cluster:
    device = {"kind": "cuda", "name": "A100", "sustained_flops_per_s": 1e14,
              "memory_bandwidth_bytes_per_s": 1.5e12, "op_overhead_s": 5e-6}
    if workspace_bytes is not None:
        device["library_workspace_bytes"] = workspace_bytes
    return Cluster.from_dict({"version": 1, "devices": 2, "device": device,
                              "tiers": [{"group_size": 2, "alpha_s": 5e-6,
                                         "bandwidth_bytes_per_s": 2e11}]})


def test_a_cuda_plan_sets_them_aside_and_reports_them():
    model, inputs, loss = mlp()
    workspace = 3 * MIB
    plain = plan(model, inputs, _gpu_cluster(0), loss_fn=loss)
    budget = plain.predicted_peak_memory_bytes + workspace
    held = plan(model, inputs, _gpu_cluster(workspace), budget, loss_fn=loss)
    assert held.memory_budget_bytes == budget
    assert held.predicted_peak_memory_bytes <= budget
    assert held.memory_breakdown["library_workspaces"] == workspace
    assert held.cost_constants["library_workspace_bytes"] == workspace
    assert "library_workspaces" in held.explain()
    timeline = held.memory_timeline
    column = timeline["categories"].index("library_workspaces")
    assert all(s["bytes"][column] == workspace for s in timeline["samples"])
    assert max(sum(s["bytes"]) for s in timeline["samples"]) == held.predicted_peak_memory_bytes
    # The same plan as at the budget less them, the same peak plus them.
    less = plan(model, inputs, _gpu_cluster(0), budget - workspace, loss_fn=loss)
    assert held.predicted_step_s == pytest.approx(less.predicted_step_s)
    assert held.predicted_peak_memory_bytes == less.predicted_peak_memory_bytes + workspace
    assert type(held).from_dict(held.to_dict()).memory_breakdown == held.memory_breakdown


def test_the_least_budget_an_error_names_includes_them():
    model, inputs, loss = mlp()
    workspace = 5 * MIB
    with pytest.raises(InfeasibleBudgetError) as without:
        plan(model, inputs, _gpu_cluster(0), 1024.0, loss_fn=loss)
    with pytest.raises(InfeasibleBudgetError, match="cuBLAS") as held:
        plan(model, inputs, _gpu_cluster(workspace), 1024.0, loss_fn=loss)
    least = without.value.smallest_feasible_budget_bytes
    assert held.value.smallest_feasible_budget_bytes == least + workspace
    assert f"{least + workspace:.4g} bytes" in str(held.value)
    # A budget under the workspaces alone is refused with the same least.
    with pytest.raises(InfeasibleBudgetError) as under:
        plan(model, inputs, _gpu_cluster(workspace), workspace / 2, loss_fn=loss)
    assert under.value.smallest_feasible_budget_bytes == least + workspace
    found = plan(model, inputs, _gpu_cluster(workspace), least + workspace, loss_fn=loss)
    assert found.predicted_peak_memory_bytes <= least + workspace
