"""Gradient-norm clipping over a parallel module's shards.

``torch.nn.utils.clip_grad_norm_`` over ``module.parameters()`` sees only this
rank's shards: each rank computes its own norm (a new-user sweep measured
0.448 and 0.425 on two ranks where the serial model's was 0.570) and scales by
its own factor, so replicated parameters drift apart and training differs
from the serial model's. Here each rank sums its shards' contributions, each
shard divided by the number of ranks holding an identical copy of it (the
mesh's size over the shard count; in a pipeline, a weight several stages tie
counts once, in its first stage), and one all-reduce over every rank of the
plan makes the whole model's norm, the same on every rank."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from automap.errors import InvalidArgumentError
from automap.sharding.spec import ShardingSpec


def shard_share(spec: str, mesh) -> float:
    """The share of a tensor's norm contributions this rank's shard carries:
    1 over the ranks holding an identical copy of it."""
    return ShardingSpec.parse(spec).shard_count(mesh) / mesh.size


def global_grad_norm(parts: Iterable[tuple[torch.Tensor, float]], norm_type: float,
                     group, device: torch.device) -> torch.Tensor:
    """The norm of every gradient of the model: ``parts`` are this rank's
    (gradient, share) pairs; ``group`` holds every rank of the plan (None: this
    rank alone)."""
    parts = list(parts)
    if norm_type == math.inf:
        local = torch.zeros((), dtype=torch.float64, device=device)
        for grad, _ in parts:
            local = torch.maximum(local, grad.detach().abs().max().to(torch.float64))
        if group is not None:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local
    local = torch.zeros((), dtype=torch.float64, device=device)
    for grad, share in parts:
        norm = torch.linalg.vector_norm(grad.detach().to(torch.float64), norm_type)
        local = local + norm ** norm_type * share
    if group is not None:
        dist.all_reduce(local, group=group)
    return local ** (1.0 / norm_type)


def clip_(grads: list[torch.Tensor], total: torch.Tensor, max_norm: float,
          error_if_nonfinite: bool) -> torch.Tensor:
    """Scale ``grads`` in place by ``max_norm / total`` where that is below 1,
    as ``torch.nn.utils.clip_grad_norm_`` does; returns ``total``."""
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of the gradients is {float(total)}: non-finite, "
                           "so clip_grad_norm_ cannot clip them (error_if_nonfinite=True)")
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coefficient.to(grad.dtype))
    return total


def check_norm_arguments(max_norm: float, norm_type: float) -> float:
    """``norm_type`` as a float; ``InvalidArgumentError`` for a bad norm or bound."""
    try:
        norm = float(norm_type)
        bound = float(max_norm)
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"clip_grad_norm_ takes numbers: max_norm={max_norm!r}, norm_type={norm_type!r}"
        ) from None
    if not (norm > 0) or math.isnan(bound) or bound < 0:
        raise InvalidArgumentError(
            f"clip_grad_norm_ needs max_norm >= 0 and norm_type > 0 (or inf); got "
            f"max_norm={max_norm!r}, norm_type={norm_type!r}")
    return norm
