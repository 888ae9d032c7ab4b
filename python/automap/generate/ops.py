"""Functions the generated module calls besides the autograd collectives: they
appear by name in ``module.code``. Each takes plain constants (slices, vocab
ranges) computed for this rank when the module was generated."""

from __future__ import annotations

import torch

from automap.sharding.collectives import all_reduce_
from automap.sharding.process_groups import AxisGroup


def take_shard(x: torch.Tensor, bounds: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """This rank's block of a tensor every rank holds whole (a global input, a
    tensor made from nothing): no communication, and no gradient flows to the
    whole tensor (inputs and sources have none)."""
    return x[tuple(slice(a, b) for a, b in bounds)].contiguous()


def vocab_parallel_embedding(
    weight: torch.Tensor, ids: torch.Tensor, vocab_start: int, vocab_end: int, padding_idx: int
) -> torch.Tensor:
    """Embedding with the rows ``[vocab_start, vocab_end)`` of the table: ids
    outside the range give zeros, so the shards' outputs sum to the full lookup
    (Megatron's vocab-parallel embedding; the caller all-reduces)."""
    outside = (ids < vocab_start) | (ids >= vocab_end)
    local_ids = (ids - vocab_start).masked_fill(outside, 0)
    local_padding = padding_idx - vocab_start if vocab_start <= padding_idx < vocab_end else -1
    out = torch.ops.aten.embedding.default(weight, local_ids, local_padding)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def loss_denominator(
    target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int, group: AxisGroup
) -> torch.Tensor:
    """What a mean-reduced (cross-entropy / NLL) loss divides by, over the whole
    batch: the count (or class-weight sum) of the targets not ignored, summed over
    the ranks that split the batch. Each rank's sum-reduced loss divided by it is
    a partial sum of the serial mean."""
    valid = target != ignore_index
    if weight is None:
        local = valid.sum().to(torch.float32)
    else:
        local = (weight[target.masked_fill(~valid, 0)] * valid).sum().to(torch.float32)
    local = local.detach().clone()
    return all_reduce_(local, group)
