"""Argument checks of the planning entry points (``automap.plan``,
``plan_traced``, ``autoparallelize``): each bad value is an
``InvalidArgumentError`` naming the argument, the value and what is allowed,
raised before any tracing or solving. ``check_costs`` refuses link and FLOP
figures whose prices leave the range the ILP solver works in."""

from __future__ import annotations

import math
import numbers

import numpy as np
from torch import nn

from automap.errors import InvalidArgumentError, InvalidPipelineError
from automap.generate.pipeline_order import interleaved_rounds
from automap.planner.microbatch import MAX_MICROBATCHES_PER_STAGE, microbatch_counts
from automap.planner.pipeline_mesh import stage_counts
from automap.planner.pipeline_record import SCHEDULES
from automap.trace.optimizer_names import OPTIMIZER_NAMES

#: Largest memory budget (4 EiB): the checkpointing DP counts bytes in 64 bits.
MAX_BUDGET_BYTES = 2.0**62
#: Device FLOP/s a plan may assume: a kiloFLOP/s to a zettaFLOP/s.
MIN_FLOPS_PER_S, MAX_FLOPS_PER_S = 1e3, 1e21
#: Longest time one strategy of one node may take: beyond it (11.6 days for one
#: op of one step) the figures are wrong, and the ILP's costs (microseconds)
#: would leave the range where HiGHS's tolerances mean anything.
MAX_NODE_S = 1e6


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_budget(value, name: str = "memory_budget_bytes") -> float | None:
    """None (no limit) or bytes per device: finite, > 0 and at most 2^62."""
    if value is None:
        return None
    if not _number(value) or not math.isfinite(value) or not 0 < value <= MAX_BUDGET_BYTES:
        raise InvalidArgumentError(
            f"{name} must be None (no limit) or a number of bytes > 0 and at most 2^62, got "
            f"{value!r}")
    return float(value)


def check_flops(value) -> float | None:
    """None (the default) or a device's sustained FLOP/s."""
    if value is None:
        return None
    if not _number(value) or not (math.isfinite(value)
                                  and MIN_FLOPS_PER_S <= value <= MAX_FLOPS_PER_S):
        raise InvalidArgumentError(
            f"flops_per_s must be a device's sustained FLOP/s, from {MIN_FLOPS_PER_S:g} to "
            f"{MAX_FLOPS_PER_S:g}, got {value!r}")
    return float(value)


def check_time_limit(value) -> float:
    if not _number(value) or not math.isfinite(value) or value <= 0:
        raise InvalidArgumentError(f"time_limit_s must be a finite number of seconds > 0, got "
                                   f"{value!r}")
    return float(value)


def check_optimizer(value) -> str | None:
    """An optimizer name the planner knows the state of, or None (no optimizer state)."""
    if value is None or (isinstance(value, str) and value in OPTIMIZER_NAMES):
        return value
    raise InvalidArgumentError(f"optimizer must be one of {list(OPTIMIZER_NAMES)} or None (no "
                               f"optimizer state), got {value!r}")


def check_loss_fn(value) -> None:
    """None (the default loss of the model's output) or a callable of the output."""
    if value is not None and not callable(value):
        raise InvalidArgumentError(f"loss_fn must be None (the model's output as the loss) or "
                                   f"a callable mapping the model's output to the loss, got "
                                   f"{type(value).__name__}")


def check_trainable(model) -> None:
    """A model with at least one parameter that requires a gradient: a plan is of
    a training step (the simulated step and the profile run its backward)."""
    if isinstance(model, nn.Module) and not any(p.requires_grad for p in model.parameters()):
        raise InvalidArgumentError(
            f"{type(model).__name__} has no parameter that requires a gradient: automap "
            "plans training steps, and this model has nothing to train")


def check_choice(value, name: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise InvalidArgumentError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def check_costs(table, mesh, flops_per_s: float) -> None:
    """Refuse a strategy table whose slowest node takes more than ``MAX_NODE_S``
    (or whose prices are not finite): the link or FLOP figures are out of range."""
    worst, where = 0.0, None
    for name, node in table.nodes.items():
        times = np.asarray(node.time_s, dtype=np.float64)
        if times.size == 0:
            continue
        top = float(np.max(times)) if np.all(np.isfinite(times)) else math.inf
        if top > worst:
            worst, where = top, name
    if worst > MAX_NODE_S:
        raise InvalidArgumentError(
            f"node {where} would take {worst:.3g} s per step (more than {MAX_NODE_S:g} s) at "
            f"flops_per_s={flops_per_s:g} and the mesh's links (alpha_s={list(mesh.alpha_s)}, "
            f"bandwidth_bytes_per_s={list(mesh.bandwidth_bytes_per_s)}); check these figures")


def check_pipeline(pipeline, microbatches, schedule, batch: int | None, mesh) -> list[int]:
    """The stage counts to try (``[1]``: intra-op only) for ``pipeline`` ("off",
    "auto" or a number of stages) on ``mesh``; an ``InvalidPipelineError`` for a
    schedule that is unknown or not supported, microbatches that are neither
    ``"auto"`` nor a positive divisor of the example batch ``batch`` (dim 0 of
    every input tensor; None: the inputs have none), or a stage count that does
    not cut the mesh into equal submeshes (``automap.planner.pipeline_mesh``).
    With ``microbatches="auto"`` a stage count is tried when the batch has a
    count of microbatches for it (``microbatch.microbatch_counts``)."""
    if not isinstance(schedule, str) or schedule not in SCHEDULES:
        raise InvalidPipelineError(f"schedule must be one of {list(SCHEDULES)}, got "
                                   f"{schedule!r}")
    auto = microbatches == "auto"
    if not auto and (not _is_int(microbatches) or microbatches < 1):
        raise InvalidPipelineError(f"microbatches must be 'auto' or an integer >= 1, got "
                                   f"{microbatches!r}")
    if (auto or microbatches > 1) and batch is None:
        raise InvalidPipelineError(
            f"microbatches={microbatches!r} needs example inputs whose tensors share a batch "
            "dimension (dim 0) to split")
    if not auto and batch is not None and batch % microbatches:
        raise InvalidPipelineError(f"microbatches={microbatches} does not divide the example "
                                   f"batch of {batch}")

    def runs(n: int) -> bool:
        if auto:
            return bool(microbatch_counts(batch, n, schedule))
        return _schedule_runs(schedule, microbatches, n)

    allowed = stage_counts(mesh)
    if pipeline == "off":
        return [1]
    if pipeline == "auto":
        return [n for n in allowed if n == 1 or runs(n)]
    if not _is_int(pipeline) or pipeline < 1:
        raise InvalidPipelineError(f"pipeline must be 'off', 'auto' or a number of stages >= 1, "
                                   f"got {pipeline!r}")
    if pipeline > mesh.size:
        raise InvalidPipelineError(f"pipeline={pipeline} stages need at least {pipeline} "
                                   f"devices; the mesh {mesh.shape} has {mesh.size}")
    if pipeline not in allowed:
        raise InvalidPipelineError(
            f"pipeline={pipeline} stages do not cut the mesh {mesh.shape} into equal submeshes "
            f"along its leading axes; stage counts that do: {allowed}")
    if pipeline > 1 and auto and not runs(pipeline):
        raise InvalidPipelineError(
            f"microbatches='auto' finds no count of microbatches for {pipeline} stages and "
            f"schedule {schedule!r} in the example batch of {batch} (it needs a divisor of the "
            f"batch from {pipeline} to {MAX_MICROBATCHES_PER_STAGE * pipeline})")
    if pipeline > 1 and not runs(pipeline) and schedule == "1f1b":
        raise InvalidPipelineError(
            f"schedule '1f1b' needs at least as many microbatches as stages: "
            f"microbatches={microbatches} for pipeline={pipeline} (torch's Schedule1F1B "
            f"refuses it); pass microbatches >= {pipeline} or schedule='gpipe'")
    if pipeline > 1 and not runs(pipeline):
        rounds = max(1, microbatches // pipeline)
        raise InvalidPipelineError(
            f"schedule 'interleaved' cannot run {microbatches} microbatches on {pipeline} "
            f"stages: torch's ScheduleInterleaved1F1B splits them into max(1, M // n) = "
            f"{rounds} rounds, which must divide M; use a multiple of {pipeline} or fewer "
            f"microbatches than stages")
    return [int(pipeline)]


def _schedule_runs(schedule: str, microbatches: int, stages: int) -> bool:
    """Whether torch's schedule takes ``microbatches`` over ``stages`` ranks
    (1F1B: at least one per stage; interleaved 1F1B: its rounds must divide
    them)."""
    if schedule == "1f1b":
        return microbatches >= stages
    return schedule != "interleaved" or interleaved_rounds(microbatches, stages) is not None


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
