"""Collectives as autograd functions, each with its dual as backward
(Megatron/MAP style):

    all_gather_dim    <-> split_dim (keep own shard)
    split_dim         <-> all_gather_dim
    all_to_all_dims   <-> all_to_all_dims (reversed)
    all_reduce_sum    <-> identity
    identity_fwd      <-> all_reduce_sum (of the gradient)
    reduce_scatter_dim <-> all_gather_dim

A tensor replicated along an axis has the same gradient on every replica, so
the dual of a gather is a local split. Shards are ordered by shard index
along the group's axes (``AxisGroup.index``), whatever torch's member order.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch
import torch.distributed as dist

from automap.sharding.process_groups import AxisGroup

#: What the tensors allocated now are for ("communication" inside a collective), for
#: the memory breakdown of a simulated step (``automap.generate.simulate``).
buffer_tag: contextvars.ContextVar[str | None] = contextvars.ContextVar("automap_buffer_tag",
                                                                        default=None)


@contextlib.contextmanager
def tagged(tag: str):
    """Tensors allocated inside are counted as ``tag`` by a simulated step."""
    token = buffer_tag.set(tag)
    try:
        yield
    finally:
        buffer_tag.reset(token)


def _communication(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with tagged("communication"):
            return fn(*args, **kwargs)

    return wrapper


def _staged_by_gloo(g: AxisGroup, like: torch.Tensor) -> None:
    """What a simulated collective allocates besides its result: gloo stages
    ``all_gather_into_tensor`` through a copy of the output and
    ``reduce_scatter_tensor`` through a copy of the input (measured with the
    profiler's memory events); NCCL works in place."""
    if g.group.backend == "gloo":
        torch.empty_like(like)


def _merge_leading(stacked: torch.Tensor, dim: int) -> torch.Tensor:
    """(n, *shape) -> shape with dim ``dim`` n times longer, block j = stacked[j]."""
    n = stacked.shape[0]
    shape = list(stacked.shape[1:])
    shape[dim] *= n
    return stacked.movedim(0, dim).reshape(shape)


def _stack_chunks(x: torch.Tensor, dim: int, n: int, order) -> torch.Tensor:
    """Split ``x`` along ``dim`` into n chunks, stacked in group-rank order."""
    chunks = x.chunk(n, dim)
    if order is not None:
        chunks = [chunks[shard] for shard in order]
    return torch.stack(chunks).contiguous()


@_communication
def _gather(x: torch.Tensor, dim: int, g: AxisGroup) -> torch.Tensor:
    if g.size == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((g.size * x.shape[0],) + tuple(x.shape[1:]))
    if not g.simulated:
        dist.all_gather_into_tensor(out, x, group=g.group)
    else:
        _staged_by_gloo(g, out)
    stacked = out.view((g.size,) + tuple(x.shape))
    if g.shard_of_group_rank is not None:
        stacked = stacked[list(g.group_rank_of_shard)]
    return _merge_leading(stacked, dim)


@_communication
def _split(x: torch.Tensor, dim: int, g: AxisGroup) -> torch.Tensor:
    if g.size == 1:
        return x
    return x.chunk(g.size, dim)[g.index].contiguous()


@_communication
def _all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, g: AxisGroup) -> torch.Tensor:
    if g.size == 1:
        return x
    send = _stack_chunks(x, dst_dim, g.size, g.shard_of_group_rank)
    recv = torch.empty_like(send)
    if not g.simulated:
        dist.all_to_all_single(recv, send, group=g.group)
    if g.shard_of_group_rank is not None:
        recv = recv[list(g.group_rank_of_shard)]
    return _merge_leading(recv, src_dim)


@_communication
def _all_reduce(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    if g.size == 1:
        return x
    out = x.contiguous().clone()
    if not g.simulated:
        dist.all_reduce(out, group=g.group)
    return out


@_communication
def _reduce_scatter(x: torch.Tensor, dim: int, g: AxisGroup) -> torch.Tensor:
    if g.size == 1:
        return x
    send = _stack_chunks(x, dim, g.size, g.shard_of_group_rank)
    out = send.new_empty(send.shape[1:])
    if not g.simulated:
        dist.reduce_scatter_tensor(out, send.view((-1,) + tuple(send.shape[2:])), group=g.group)
    else:
        _staged_by_gloo(g, send)
    return out


class _AllGatherDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, g):
        ctx.dim, ctx.g = dim, g
        return _gather(x, dim, g)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.g), None, None


class _SplitDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, g):
        ctx.dim, ctx.g = dim, g
        return _split(x, dim, g)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.g), None, None


class _AllToAllDims(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src_dim, dst_dim, g):
        ctx.src_dim, ctx.dst_dim, ctx.g = src_dim, dst_dim, g
        return _all_to_all(x, src_dim, dst_dim, g)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.dst_dim, ctx.src_dim, ctx.g), None, None, None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        return _all_reduce(x, g)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _IdentityAllReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.g), None


class _ReduceScatterDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, g):
        ctx.dim, ctx.g = dim, g
        return _reduce_scatter(x, dim, g)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.g), None, None


def all_gather_dim(x: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
    """Concatenate the shards of ``x`` along ``dim`` (backward: keep own shard)."""
    return _AllGatherDim.apply(x, dim, group)


def split_dim(x: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
    """Keep this rank's shard of ``x`` along ``dim`` (backward: all-gather)."""
    return _SplitDim.apply(x, dim, group)


def all_to_all_dims(x: torch.Tensor, src_dim: int, dst_dim: int, group: AxisGroup):
    """Gather ``src_dim`` and split ``dst_dim`` in one all-to-all (backward: the reverse)."""
    return _AllToAllDims.apply(x, src_dim, dst_dim, group)


def all_reduce_sum(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Sum partial values over the group (backward: identity)."""
    return _AllReduceSum.apply(x, group)


def identity_all_reduce_grad(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Identity whose backward sums the gradient over the group."""
    return _IdentityAllReduceGrad.apply(x, group)


def reduce_scatter_dim(x: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
    """Sum partial values and keep this rank's shard along ``dim`` (backward: all-gather)."""
    return _ReduceScatterDim.apply(x, dim, group)
