"""Functions the generated module calls besides the autograd collectives: they
appear by name in ``module.code``. Each takes plain constants (slices, vocab
ranges) computed for this rank when the module was generated."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from automap.sharding.collectives import (
    all_reduce_,
    all_reduce_sum,
    identity_all_reduce_grad,
    is_simulated,
)
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


def _local_denominator(target: torch.Tensor, weight: torch.Tensor | None,
                       ignore_index: int) -> torch.Tensor:
    """This rank's count (or class-weight sum) of the targets not ignored."""
    valid = target != ignore_index
    # A count stays an integer and a weight sum in the weights' dtype: float32
    # rounded a float64 model's weighted loss (3.7e-8 relative off the serial
    # one) and would count targets past 2**24 inexactly.
    if weight is None:
        local = valid.sum()
    else:
        local = (weight[target.masked_fill(~valid, 0)] * valid).sum()
    return local.detach().clone()


def loss_denominator(
    target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int,
    group: AxisGroup | None
) -> torch.Tensor:
    """What a mean-reduced (cross-entropy / NLL) loss divides by, over the whole
    batch: the count (or class-weight sum) of the targets not ignored, summed over
    the ranks that split the batch. Each rank's sum-reduced loss divided by it is
    a partial sum of the serial mean."""
    local = _local_denominator(target, weight, ignore_index)
    return local if group is None or group.size == 1 else all_reduce_(local, group)


class _MeanOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, total, denominator, group):
        # float64 holds a count exactly to 2**53 and a float32 sum without rounding.
        both = torch.stack([total.detach().to(torch.float64), denominator.to(torch.float64)])
        all_reduce_(both, group)
        ctx.denominator = both[1].to(total.dtype)
        return (both[0] / both[1]).to(total.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.denominator, None, None


def mean_over_group(total: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                    ignore_index: int, group: AxisGroup) -> torch.Tensor:
    """A mean-reduced loss over a batch split over ``group`` from this rank's
    sum-reduced one (``total``): the sums and the counts (or weight sums) of the
    targets not ignored all-reduced together, in one collective, where
    ``all_reduce_sum(total / loss_denominator(...))`` waits for two in the
    forward. The gradient of ``total`` is the serial mean's: one over the
    global count."""
    if torch.compiler.is_compiling() or group.size == 1:
        return all_reduce_sum(total / loss_denominator(target, weight, ignore_index, group),
                              group)
    return _MeanOverGroup.apply(total, _local_denominator(target, weight, ignore_index), group)


# Class-parallel normalisation (Megatron-LM's vocab-parallel loss): the class dim
# of the logits is split over ``group``; a max and a sum over the shards make the
# log-sum-exp whole on every member.


def _class_parallel_peak(x: torch.Tensor, dims: list[int], group: AxisGroup) -> torch.Tensor:
    """The largest value over ``dims`` of a tensor split along them, all shards
    together (it only keeps exp in range; rows of -inf give 0, not nan)."""
    peak = x.amax(dims, keepdim=True)
    if group.size > 1 and not group.simulated:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group.group)
    return peak.masked_fill(torch.isinf(peak), 0.0)


def class_parallel_logsumexp(x: torch.Tensor, dims: list[int], keepdim: bool,
                             group: AxisGroup) -> torch.Tensor:
    """logsumexp over ``dims`` of a tensor split along them: the shards' max
    (all-reduced, no gradient: it only keeps exp in range) and the shards' sums
    of exp (all-reduced; its backward is the identity, since the result is whole
    on every member and so is its gradient)."""
    peak = _class_parallel_peak(x.detach(), dims, group)
    total = all_reduce_sum(torch.exp(x - peak).sum(dims, keepdim=True), group)
    out = torch.log(total) + peak
    return out if keepdim else out.squeeze(dims)


def class_parallel_log_softmax(x: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
    """log_softmax along a split dim: x minus the whole log-sum-exp, whose
    gradient (summed over this shard's classes) is partial over the group."""
    lse = class_parallel_logsumexp(x, [dim], True, group)
    return x - identity_all_reduce_grad(lse, group)


def class_parallel_softmax(x: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
    return torch.exp(class_parallel_log_softmax(x, dim, group))


def class_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                                 class_start: int, group: AxisGroup) -> torch.Tensor:
    """Per-target cross-entropy (0 where ignored) with the class dim (1, or 0
    for one unbatched row) split: log-sum-exp over the shards minus the target's
    logit, picked on the shard that holds it and summed over the group."""
    loss = _ClassParallelCrossEntropy.apply(logits, target, ignore_index, class_start, group)
    return loss.masked_fill(target == ignore_index, 0.0)


class _ClassParallelCrossEntropy(torch.autograd.Function):
    """The loss keeps the shard's softmax for its backward, one tensor of the
    logits' local size, as the serial op keeps its log-probabilities
    (Megatron's vocab-parallel cross-entropy). Composed of autograd ops, it
    kept two: exp's output for the log-sum-exp and the logits for the pick's
    gradient (the tests' GPT-2 with dropout on (2,2), class split: modelled
    4.4 % under its simulated step, 2.0 % after). The result and the picked
    logit are whole on every member, so their gradient is too, and the
    backward needs no collective."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, class_start, group):
        dim = 1 if logits.dim() > 1 else 0
        peak = _class_parallel_peak(logits, [dim], group)
        probs = (logits - peak).exp_()  # one logits-sized tensor, also while it is made
        total = all_reduce_sum(probs.sum(dim, keepdim=True), group)
        probs.div_(total)
        local = target - class_start
        inside = (local >= 0) & (local < logits.shape[dim]) & (target != ignore_index)
        index = local.clamp(0, logits.shape[dim] - 1).unsqueeze(dim)
        picked = logits.gather(dim, index).squeeze(dim) * inside
        ctx.dim = dim
        ctx.save_for_backward(probs, index, inside)
        return (torch.log(total) + peak).squeeze(dim) - all_reduce_sum(picked, group)

    @staticmethod
    def backward(ctx, grad):
        probs, index, inside = ctx.saved_tensors
        grad_logits = probs * grad.unsqueeze(ctx.dim)
        grad_logits.scatter_add_(ctx.dim, index, -(grad * inside).unsqueeze(ctx.dim))
        return grad_logits, None, None, None, None


def expert_parallel_grouped_mm(op, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                               first_expert: int) -> torch.Tensor:
    """A grouped matmul over this shard's experts ``first_expert ..`` (rows of x
    sorted by expert, ``offs`` the global row ends per expert): their rows
    computed, zeros elsewhere, so the shards' outputs sum to the whole result."""
    last = first_expert + weight.shape[0]
    if is_simulated(offs):  # generate/simulate.py: rows spread evenly
        start, end = (x.shape[0] * e // offs.shape[0] for e in (first_expert, last))
    else:
        start = int(offs[first_expert - 1]) if first_expert > 0 else 0
        end = int(offs[last - 1])
    rows = op(x[start:end], weight, offs[first_expert:last] - start)
    return F.pad(rows, (0, 0, start, x.shape[0] - end))


# Random ops: every rank draws the whole tensor from the default generator, as
# the serial model does, and keeps its shard. Replicated and sharded parts then
# consume the generator alike and draw the serial model's numbers.


def _own_block(whole: torch.Tensor, bounds: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """This shard's block of ``whole`` in a storage of its own: a view would
    keep the whole tensor alive as long as the block (a dropout saves it for
    the backward: GPT-2 small on (2,2,2) kept 24 MiB of whole masks per
    dropout, 576 MiB per rank, where its 3 MiB blocks were planned)."""
    block = whole[tuple(slice(a, b) for a, b in bounds)]
    if block.numel() == whole.numel():
        return block
    return block.clone(memory_format=torch.contiguous_format)


def sharded_dropout(op, x: torch.Tensor, p: float, train: bool, global_shape: list[int],
                    bounds: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """``op`` (dropout or dropout_) on this shard of a tensor of ``global_shape``:
    the scaled mask drawn whole (dropout of ones), this shard's block applied."""
    if not train or p == 0 or math.prod(global_shape) == 0:
        return x
    whole = torch.ones(global_shape, dtype=x.dtype, device=x.device)
    block = _own_block(torch.ops.aten.dropout_.default(whole, p, train), bounds)
    return x.mul_(block) if op is torch.ops.aten.dropout_.default else x * block


def sharded_random_like(op, x: torch.Tensor, global_shape: list[int],
                        bounds: tuple[tuple[int, int], ...], *args, **kwargs) -> torch.Tensor:
    """rand_like/randn_like/bernoulli(p) of this shard: drawn whole, block kept."""
    whole = op(torch.empty(global_shape, dtype=x.dtype, device=x.device), *args, **kwargs)
    return _own_block(whole, bounds)


def with_shard_rng(shard: int, op, *args, **kwargs):
    """``op`` drawing random numbers that only this shard uses (attention's own
    dropout, which cannot be drawn whole): one seed from the default generator
    (the same on every rank, which all advance alike), plus the shard index, so
    that replicas of a shard draw alike and other shards independently."""
    if any(is_simulated(a) for a in args if isinstance(a, torch.Tensor)):
        return op(*args, **kwargs)  # simulated: no numbers drawn
    seed = int(torch.randint(0, 2**62, (1,)).item())
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed + shard)
        return op(*args, **kwargs)
