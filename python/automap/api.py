"""The one-line API: ``autoparallelize`` plans (or loads a plan) and returns this
rank's parallel module; ``apply`` turns an existing plan into one. Both run
inside an initialised torch.distributed process group, one process per device."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from automap.errors import InvalidMeshError
from automap.planner.plan import Plan
from automap.sharding.mesh import DeviceMesh
from automap.trace.example_inputs import describe_inputs, stand_in_inputs


def autoparallelize(
    model: nn.Module,
    example_inputs: Any,
    mesh: DeviceMesh | tuple | None = None,
    memory_budget_bytes: float | None = None,
    plan: Plan | None = None,
    *,
    loss_fn=None,
    optimizer: str = "adamw",
    local_inputs: bool = False,
    device: str | torch.device | None = None,
    seed: int = 0,
    **plan_options,
):
    """Plan ``model`` on ``mesh`` (default: 1-D over the whole world; a
    ``Cluster`` or cluster JSON path tries its best meshes of the world's size) within
    ``memory_budget_bytes`` per device (default: the GPU's memory; unlimited on
    CPU), or check and use ``plan``, and return this rank's ``ParallelModule``.

    The module is called like ``model`` on ``example_inputs``-shaped inputs and
    returns the loss (``loss_fn(model(...))``, default ``automap.trace.tracing.
    default_loss``), replicated. Rank ``mesh.ranks[0]`` solves the plan and sends
    it to the others. ``plan_options`` go to ``automap.plan`` (e.g. ``flops_per_s``,
    ``checkpointing``: within a budget the plan may checkpoint activations, which the
    module then recomputes in nested ``torch.utils.checkpoint`` regions). The device's
    speeds not given there nor measured in the cluster are measured by every rank at
    once, as they will compute in training.
    """
    from automap.planner.search import candidate_meshes, plan_best
    from automap.trace.profiling import profile_traced

    if plan is not None:
        mesh = plan.mesh
    elif mesh is None:
        mesh = _mesh_for_world(None)
    world = _world_size()
    meshes, known = candidate_meshes(mesh, size=world)
    device = _device(device)
    if memory_budget_bytes is None and device.type == "cuda":
        memory_budget_bytes = torch.cuda.get_device_properties(device).total_memory

    traced = _trace(model, example_inputs, loss_fn)
    if plan is None:
        speeds = _device_speeds(plan_options, known, device, traced)
        for candidate in meshes:
            _mesh_for_world(candidate)  # each must match the world before anyone plans
        leader = meshes[0].ranks[0]
        payload = [None]
        if dist.get_rank() == leader:
            found = plan_best(traced, profile_traced(traced, optimizer), meshes,
                              memory_budget_bytes, optimizer=optimizer, device=speeds,
                              **plan_options)
            found.inputs = describe_inputs(example_inputs)
            payload = [found.to_dict()]
        dist.broadcast_object_list(payload, src=leader)
        plan = Plan.from_dict(payload[0])
    return _generate(traced, plan, model, _mesh_for_world(plan.mesh), device, local_inputs, seed)


def apply(plan: Plan, model: nn.Module, example_inputs: Any = None, *, loss_fn=None,
          local_inputs: bool = False, device: str | torch.device | None = None, seed: int = 0):
    """This rank's ``ParallelModule`` of ``model`` under ``plan`` (made by
    ``automap.plan`` for the same model, inputs and loss). Without
    ``example_inputs``, stand-ins of the shapes and dtypes the plan recorded are
    traced. Raises ``StalePlanError`` when the model or input shapes changed
    since planning."""
    mesh = _mesh_for_world(plan.mesh)
    if example_inputs is None:
        example_inputs = stand_in_inputs(plan.inputs, _model_device(model))
    traced = _trace(model, example_inputs, loss_fn)
    return _generate(traced, plan, model, mesh, _device(device), local_inputs, seed)


def _device_speeds(plan_options: dict, known, device: torch.device, traced):
    """The ``DeviceProfile`` to plan with (collective): the speeds in
    ``plan_options`` (taken out of them), else the cluster's, else measured
    on every rank at once (the first time in this process group)."""
    from automap.cluster.device import FIELDS, measure_concurrently, resolve_device_profile
    from automap.planner.search import parameter_dtype

    given = {name: plan_options.pop(name, None) for name in FIELDS}
    known = dict(known or {})
    if any(given[n] is None and known.get(n) is None for n in FIELDS):
        measured = measure_concurrently(device, parameter_dtype(traced), cached=True)
        known = {n: known.get(n) or getattr(measured, n) for n in FIELDS}
    return resolve_device_profile(**given, known=known)


def _model_device(model: nn.Module) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def _trace(model, example_inputs, loss_fn):
    from automap.trace.tracing import default_loss, trace

    return trace(model, example_inputs, loss_fn=loss_fn or default_loss)


def _generate(traced, plan: Plan, model, mesh: DeviceMesh, device, local_inputs, seed):
    from automap.generate.program import generate

    plan.check_matches(traced, mesh)
    return generate(traced, plan, model, mesh.process_groups(), device=device,
                    local_inputs=local_inputs, seed=seed)


def _world_size() -> int:
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidMeshError(
            "automap.autoparallelize needs an initialised process group: launch with "
            "torchrun --nproc-per-node N and call torch.distributed.init_process_group() first "
            "(automap.plan works without one)")
    return dist.get_world_size()


def _mesh_for_world(mesh) -> DeviceMesh:
    world = _world_size()
    if mesh is None:
        return DeviceMesh((world,))
    if not isinstance(mesh, DeviceMesh):
        mesh = DeviceMesh(mesh)
    if mesh.size != world:
        raise InvalidMeshError(
            f"the mesh {mesh.shape} has {mesh.size} devices but the process group has {world} "
            f"processes; launch {mesh.size} processes (torchrun --nproc-per-node {mesh.size}) "
            f"or pass a mesh of {world} devices, e.g. mesh=automap.DeviceMesh(({world},))")
    return mesh


def _device(device) -> torch.device:
    if device is not None:
        return torch.device(device)
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
