"""The one-line API: ``autoparallelize`` plans (or loads a plan) and returns this
rank's parallel module; ``apply`` turns an existing plan into one. Both run
inside an initialised torch.distributed process group, one process per device."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from automap.cluster.device import FIELDS
from automap.coordination import DEFAULT_SETUP_TIMEOUT_S, SetupChannel
from automap.errors import (
    DistributedError,
    InvalidArgumentError,
    InvalidMeshError,
    InvalidPipelineError,
)
from automap.planner.plan import Plan
from automap.sharding.mesh import DeviceMesh
from automap.trace.example_inputs import describe_inputs, stand_in_inputs

if TYPE_CHECKING:
    from automap.cluster.cluster import Cluster
    from automap.cluster.device import DeviceProfile
    from automap.generate.module import ParallelModule
    from automap.generate.pipeline import PipelineModule
    from automap.trace.mixed_precision import MixedPrecision
    from automap.trace.tracing import TracedGraph

#: What a loss function maps the model's output to: the scalar loss.
LossFn = Callable[[Any], torch.Tensor]


def autoparallelize(
    model: nn.Module,
    example_inputs: Any,
    mesh: DeviceMesh | Sequence[int] | Cluster | str | os.PathLike | None = None,
    memory_budget_bytes: float | None = None,
    plan: Plan | None = None,
    *,
    loss_fn: LossFn | None = None,
    optimizer: str | None = "adamw",
    local_inputs: bool = False,
    device: str | torch.device | None = None,
    seed: int = 0,
    setup_timeout_s: float = DEFAULT_SETUP_TIMEOUT_S,
    mixed_precision: MixedPrecision | str | None = None,
    pipeline: str | int = "off",
    microbatches: int | str = 1,
    schedule: str = "1f1b",
    **plan_options: Any,
) -> ParallelModule | PipelineModule:
    """Plan ``model`` on ``mesh`` (default: 1-D over the whole world; a
    ``Cluster`` or cluster JSON path tries its best meshes of the world's size) within
    ``memory_budget_bytes`` per device (default: the GPU's memory; unlimited on
    CPU), or check and use ``plan``, and return this rank's ``ParallelModule``.

    The module is called like ``model`` on ``example_inputs``-shaped inputs and
    returns the loss (``loss_fn(model(...))``, default ``automap.trace.tracing.
    default_loss``), replicated. Rank ``mesh.ranks[0]`` solves the plan and sends
    it to the others. ``optimizer``: the optimizer whose state the plan makes room
    for (``"sgd"``, ``"sgd_momentum"``, ``"adam"``, ``"adamw"``, or None for none).
    ``plan_options`` go to ``automap.plan`` (e.g. ``flops_per_s``,
    ``checkpointing``: within a budget the plan may checkpoint activations, which the
    module then recomputes in nested ``torch.utils.checkpoint`` regions). The device's
    speeds not given there nor measured in the cluster are measured by every rank at
    once, as they will compute in training; so are the links of a mesh given as a
    shape or left to the default (a ``DeviceMesh`` keeps the links it was given).

    ``mixed_precision`` (None, ``"bf16"``, ``"fp16"`` or ``automap.MixedPrecision``):
    the module computes as the model does under ``torch.autocast`` in that dtype,
    with float32 master parameters and optimizer state, and all-reduces data-parallel
    gradients in ``reduce_dtype`` (float32 unless given); the planner prices the
    low-precision activations and FLOP rate. A ``plan`` made with another setting is
    refused (``StalePlanError``). With fp16, scale the loss with
    ``automap.GradScaler`` (a ``torch.amp.GradScaler`` whose inf check agrees
    across ranks).

    ``pipeline`` (``"off"``, ``"auto"`` or a number of stages), ``microbatches`` (a
    count, or ``"auto"``: the search chooses it) and ``schedule`` (``"1f1b"``,
    ``"gpipe"``, ``"interleaved"``) go to ``automap.plan``. A plan with
    stages gives a ``automap.generate.pipeline.PipelineModule``: called on the whole
    batch, it runs the schedule's forward and backward over the microbatches and
    returns the batch's loss (every rank alike); the gradients are then in
    ``.grad``, and ``loss.backward()`` only checks that it is called on the loss
    itself (``PipelineError`` otherwise). Its ``parameters()`` are this rank's
    shards of its stage.

    Every rank calls it. An error on any rank (while checking, planning on the
    leader, or generating) is raised on every rank as the same ``AutomapError``;
    each setup step waits at most ``setup_timeout_s`` for the other ranks
    (planning on the leader included), then raises ``DistributedError`` naming
    what did not answer.
    """
    from automap.cluster.workspace import library_workspace_bytes
    from automap.planner.checks import (
        check_budget,
        check_loss_fn,
        check_optimizer,
        check_trainable,
    )
    from automap.planner.library_workspaces import within_library_workspaces
    from automap.planner.search import candidate_meshes, plan_best
    from automap.trace.profiling import profile_traced

    world = _world_size()
    channel = SetupChannel.of_world(setup_timeout_s)
    channel.check_in("starting automap.autoparallelize")

    def prepare() -> tuple[list[DeviceMesh], dict | None, torch.device, float | None,
                           TracedGraph]:
        budget = check_budget(memory_budget_bytes)
        check_optimizer(optimizer)
        check_trainable(model)
        check_loss_fn(loss_fn)
        _check_plan_options(plan_options)
        if plan is not None and not isinstance(plan, Plan):
            raise InvalidArgumentError(f"plan must be None or an automap.Plan, got "
                                       f"{type(plan).__name__}")
        chosen = plan.mesh if plan is not None else mesh
        chosen = _mesh_for_world(None) if chosen is None else chosen
        meshes, known = candidate_meshes(chosen, size=world)
        for candidate in meshes:
            _mesh_for_world(candidate)  # each must match the world before anyone plans
        dev = _device(device)
        if budget is None and dev.type == "cuda":
            budget = torch.cuda.get_device_properties(dev).total_memory
        return meshes, known, dev, budget, _trace(model, example_inputs, loss_fn,
                                                  mixed_precision)

    meshes, known, dev, budget, traced = channel.each_rank(
        "checking the arguments and tracing", prepare)
    if plan is None:
        speeds = channel.each_rank(
            "measuring this device's speeds",
            lambda: _device_speeds(plan_options, known, dev, traced))
        if mesh is None or isinstance(mesh, (tuple, list)):
            # A shape says nothing of the links: measure them as training will meet them.
            meshes = channel.each_rank("measuring the links", lambda: _measured(meshes))
        # Collectives are priced as this process group's backend runs them.
        meshes = [m.with_backend(dist.get_backend()) for m in meshes]

        def solve() -> dict:
            found = within_library_workspaces(
                lambda left: plan_best(traced, profile_traced(traced, optimizer), meshes, left,
                                       optimizer=optimizer, device=speeds, **plan_options),
                budget, library_workspace_bytes(dev.type, known, dev))
            found.inputs = describe_inputs(example_inputs)
            return found.to_dict()

        def solve_pipeline() -> dict:
            from automap.planner.search import plan as plan_model

            found = plan_model(model, example_inputs, meshes[0], budget, loss_fn=loss_fn,
                               optimizer=optimizer, mixed_precision=mixed_precision,
                               pipeline=pipeline, microbatches=microbatches,
                               schedule=schedule, **{n: getattr(speeds, n) for n in FIELDS},
                               shared_slowdown=speeds.shared_slowdown, **plan_options)
            found.inputs = describe_inputs(example_inputs)
            return found.to_dict()

        leader = meshes[0].ranks[0]
        plan = Plan.from_dict(channel.from_leader(
            f"planning on rank {leader}", leader,
            solve if pipeline == "off" else solve_pipeline))
    if plan.pipeline is not None:
        return _generate_pipeline(channel, plan, model, dev, local_inputs, seed,
                                  example_inputs, loss_fn, mixed_precision)
    return _generate(channel, traced, plan, model, dev, local_inputs, seed)


@torch.enable_grad()  # it traces the training step (also inside an eval loop)
def apply(plan: Plan, model: nn.Module, example_inputs: Any = None, *,
          loss_fn: LossFn | None = None, local_inputs: bool = False,
          device: str | torch.device | None = None, seed: int = 0,
          setup_timeout_s: float = DEFAULT_SETUP_TIMEOUT_S,
          mixed_precision: MixedPrecision | str | None = "plan"
          ) -> ParallelModule | PipelineModule:
    """This rank's ``ParallelModule`` of ``model`` under ``plan`` (made by
    ``automap.plan`` for the same model, inputs and loss). Without
    ``example_inputs``, stand-ins of the shapes and dtypes the plan recorded are
    traced. Raises ``StalePlanError`` when the model or input shapes changed
    since planning, ``InvalidPlanError`` when the plan does not fit the graph;
    errors and timeouts reach every rank as in ``autoparallelize``.
    ``mixed_precision``: by default the plan's (``plan.mixed_precision``); another
    setting is refused with a ``StalePlanError``."""
    _world_size()
    channel = SetupChannel.of_world(setup_timeout_s)
    channel.check_in("starting automap.apply")

    def prepare() -> tuple[torch.device, Any, Any, TracedGraph | None]:
        if not isinstance(plan, Plan):
            raise InvalidArgumentError(f"plan must be an automap.Plan (e.g. "
                                       f"automap.Plan.from_json(path)), got {type(plan).__name__}")
        plan.check_generable()
        _mesh_for_world(_whole_mesh(plan))
        inputs = example_inputs
        if inputs is None:
            inputs = stand_in_inputs(plan.inputs, _model_device(model))
        setting = plan.mixed_precision if isinstance(mixed_precision, str) and \
            mixed_precision == "plan" else mixed_precision
        # A pipelined plan is for one microbatch: traced when generating.
        traced = _trace(model, inputs, loss_fn, setting) if plan.pipeline is None else None
        return _device(device), inputs, setting, traced

    dev, inputs, setting, traced = channel.each_rank("checking the plan and tracing", prepare)
    if plan.pipeline is not None:
        return _generate_pipeline(channel, plan, model, dev, local_inputs, seed, inputs,
                                  loss_fn, setting)
    return _generate(channel, traced, plan, model, dev, local_inputs, seed)


def _check_plan_options(plan_options: dict) -> None:
    """``autoparallelize``'s extra keywords are ``automap.plan``'s options (those
    it does not take itself; not ``reduce_depth``, whose plans are estimates that
    are not generated): anything else is refused on every rank before tracing."""
    from automap.planner.search import plan as plan_model

    known = (set(inspect.signature(plan_model).parameters)
             - set(inspect.signature(autoparallelize).parameters) - {"reduce_depth"})
    unknown = sorted(set(plan_options) - known)
    if unknown:
        raise InvalidArgumentError(
            f"autoparallelize got unknown option(s) {unknown}; its other keywords go to "
            f"automap.plan: {sorted(known)}")


def _device_speeds(plan_options: dict, known: dict | None, device: torch.device,
                   traced: TracedGraph) -> DeviceProfile:
    """The ``DeviceProfile`` to plan with (collective): the speeds in
    ``plan_options`` (taken out of them), else the cluster's, else measured
    on every rank at once (the first time in this process group)."""
    from automap.cluster.device import FIELDS, measure_concurrently, resolve_device_profile
    from automap.planner.search import parameter_dtype

    given = {name: plan_options.pop(name, None) for name in FIELDS}
    shared = plan_options.pop("shared_slowdown", None)
    known = dict(known or {})
    if any(given[n] is None and known.get(n) is None for n in FIELDS):
        measured = measure_concurrently(device, parameter_dtype(traced), cached=True)
        known = {n: known.get(n) or getattr(measured, n) for n in FIELDS}
        known["shared_slowdown"] = measured.shared_slowdown
    return resolve_device_profile(**given, shared_slowdown=shared, known=known)


def _measured(meshes: list[DeviceMesh]) -> list[DeviceMesh]:
    """``meshes`` with their links measured on the process group, once per
    process group and mesh shape (collective): the latency after a step's
    share of compute on every rank, as a training step's collectives meet it
    (``measure_mesh(load_flops=)``)."""
    from automap.cluster.detect import TRAINING_LOAD_FLOPS, measure_mesh

    key = (id(dist.group.WORLD), dist.get_world_size())
    cache = _MEASURED_LINKS.setdefault(key, {})
    out = []
    for m in meshes:
        if (m.shape, m.ranks) not in cache:
            cache[(m.shape, m.ranks)] = measure_mesh(m, load_flops=TRAINING_LOAD_FLOPS)
        out.append(cache[(m.shape, m.ranks)])
    return out


#: Measured meshes per process group, so that a second autoparallelize does not measure again.
_MEASURED_LINKS: dict = {}


def _model_device(model: nn.Module) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def _trace(model: nn.Module, example_inputs: Any, loss_fn: LossFn | None,
           mixed_precision: MixedPrecision | str | None = None) -> TracedGraph:
    from automap.trace.tracing import default_loss, trace

    return trace(model, example_inputs, loss_fn=loss_fn or default_loss,
                 mixed_precision=mixed_precision)


def _whole_mesh(plan: Plan) -> DeviceMesh:
    """The mesh a plan runs on: its own, or the whole mesh its pipeline spans."""
    return plan.mesh if plan.pipeline is None else DeviceMesh.from_dict(plan.pipeline.mesh)


def _generate(channel: SetupChannel, traced: TracedGraph, plan: Plan, model: nn.Module,
              device: torch.device, local_inputs: bool, seed: int) -> ParallelModule:
    from automap.generate.program import generate

    mesh = plan.mesh
    channel.each_rank("checking the plan against the graph",
                      lambda: plan.check_matches(traced, _mesh_for_world(mesh)))
    # Every rank is here and alive: the groups' creation does not wait on a lost rank.
    channel.check_in("creating the mesh's process groups")
    groups = mesh.process_groups()
    return channel.each_rank("generating the parallel module", lambda: generate(
        traced, plan, model, groups, device=device, local_inputs=local_inputs, seed=seed))


def _generate_pipeline(channel: SetupChannel, plan: Plan, model: nn.Module,
                       device: torch.device, local_inputs: bool, seed: int,
                       example_inputs: Any, loss_fn: LossFn | None,
                       mixed_precision: MixedPrecision | str | None) -> PipelineModule:
    """This rank's stage of a pipelined plan, whose nodes are for one microbatch:
    the model is traced on the first microbatch of ``example_inputs``."""
    from automap.generate.pipeline import generate_pipeline

    microbatches = plan.pipeline.microbatches if plan.pipeline is not None else 1

    def prepare() -> TracedGraph:
        if local_inputs:
            raise InvalidPipelineError("local_inputs=True is not supported with a pipeline: "
                                       "the first stage takes the whole batch")
        micro = first_microbatch(example_inputs, microbatches)
        traced = _trace(model, micro, loss_fn, mixed_precision)
        plan.check_matches(traced, plan.mesh)
        _mesh_for_world(_whole_mesh(plan))
        return traced

    traced = channel.each_rank("tracing one microbatch and checking the plan", prepare)
    channel.check_in("creating the pipeline's process groups")
    return channel.each_rank("generating the pipeline stage", lambda: generate_pipeline(
        traced, plan, model, device=device, seed=seed))


def first_microbatch(example_inputs: Any, microbatches: int) -> Any:
    """The first of ``microbatches`` equal parts of ``example_inputs`` (every tensor
    split along dim 0), in the same form (tensor, tuple or dict)."""
    import torch.utils._pytree as pytree

    def part(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] % microbatches:
            raise InvalidPipelineError(
                f"{microbatches} microbatches must divide every input's dim 0 (the batch); "
                f"an input has shape {list(t.shape)}")
        return t[:t.shape[0] // microbatches]

    return pytree.tree_map_only(torch.Tensor, part, example_inputs)


def _world_size() -> int:
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedError(
            "automap.autoparallelize and automap.apply run inside an initialised "
            "torch.distributed process group, one process per device, and none is: launch "
            "with torchrun --nproc-per-node N and call torch.distributed.init_process_group() "
            "first (automap.plan works without one)")
    return dist.get_world_size()


def _mesh_for_world(mesh: DeviceMesh | Sequence[int] | None) -> DeviceMesh:
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


def _device(device: str | torch.device | None) -> torch.device:
    if device is not None:
        try:
            return torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            raise InvalidArgumentError(f"device must be a torch device such as 'cpu' or "
                                       f"'cuda:0', got {device!r}") from None
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
