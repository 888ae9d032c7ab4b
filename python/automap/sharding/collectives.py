"""Collectives as autograd functions, each with its dual as backward
(Megatron/MAP style):

    all_gather_dim    <-> split_dim (keep own shard)
    split_dim         <-> all_gather_dim
    all_to_all_dims   <-> all_to_all_dims (reversed)
    all_reduce_sum    <-> identity
    identity_fwd      <-> all_reduce_sum (of the gradient)
    reduce_scatter_dim <-> all_gather_dim
    gather_shard      <-> reduce_scatter_dim (of a partial gradient: FSDP/ZeRO)

A tensor replicated along an axis has the same gradient on every replica, so
the dual of a gather is a local split. Shards are ordered by shard index
along the group's axes (``AxisGroup.index``), whatever torch's member order.

Over several mesh axes each collective runs the algorithm the planner priced
(``DeviceMesh.collective_plan``, asked through ``AxisGroup.algorithm``): one
call on the group's process group, or one call per step on the per-axis
groups (e.g. reduce-scatter along the fast axis, all-reduce the share along
the slow one, all-gather back). Both give the flat call's values, up to the
order of floating-point sums.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import time
from collections.abc import Generator

import torch
import torch.distributed as dist

from automap.sharding.process_groups import AxisGroup

#: Bucket size of the data-parallel gradient all-reduce (``generate.grad_sync``
#: fills buckets of it; ``planner.step_time`` predicts them).
DEFAULT_BUCKET_BYTES = 25 * 2**20


Steps = Generator[object, None, torch.Tensor]
"""A collective as a generator: it launches each step asynchronously, yields the
step's work handle and resumes once the caller has waited for it; its return
value is the result (``_finish`` drives one to the end)."""


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


def _finish(steps: Steps) -> torch.Tensor:
    with tagged("communication"):
        try:
            work = next(steps)
            while True:
                work.wait()
                work = steps.send(None)
        except StopIteration as done:
            return done.value


class _Done:
    """The work of a simulated collective: already finished."""

    def wait(self) -> None:
        return None


class _GlooWork:
    """A gloo work whose tensors are released when ``wait`` returns. Gloo's
    worker thread holds the work's tensors a moment past its completion and,
    when it drops them last, frees them only once it gets the GIL: memory then
    lingers for an unpredictable while (in 20-30 % of all-gathers of 1 MiB
    here). ``wait`` lets the thread run until it has let go of every tensor
    (bounded), so tensors die where the program drops them, as the simulated
    step and the memory model assume."""

    #: How long one wait lets the worker thread take to let go (seconds): first
    #: bare GIL hand-overs, then short sleeps, which also let a busy machine
    #: schedule the thread.
    MAX_WAIT_S = 0.2

    def __init__(self, work, tensors, counts) -> None:
        self.work = work
        self.tensors = list(zip(tensors, counts))

    @staticmethod
    def counts(tensors) -> list[tuple[int, int]]:
        """References to each tensor and to its storage (gloo may hold views)."""
        return [(t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata))
                for t in tensors]

    def wait(self) -> None:
        self.work.wait()
        tensors = [t for t, _ in self.tensors]
        self.work = None  # ours; the worker thread may still hold the work
        deadline, tries = time.perf_counter() + self.MAX_WAIT_S, 0
        while time.perf_counter() < deadline:
            # Released when every tensor is back to its counts before the launch.
            # Nothing weaker will do: the references gloo holds go in several
            # steps (the completed future's value, a temporary around it, the
            # work's tensor lists), an all-gather's input before its output.
            if all(u <= u0 and s <= s0
                   for (u, s), (_, (u0, s0)) in zip(self.counts(tensors), self.tensors)):
                break
            tries += 1
            time.sleep(0 if tries < 100 else 1e-4)
        self.tensors = []


def _launch(call, g: AxisGroup, *tensors, staged: torch.Tensor | None = None):
    """Start ``call(*tensors, group=..., async_op=True)`` on ``g``; in a simulated
    step, only allocate what the backend would besides the result: gloo stages
    ``all_gather_into_tensor`` through a copy of the output (``staged``;
    measured with the allocator's events); NCCL works in place."""
    if not g.simulated:
        if dist.get_backend(g.group) != "gloo":
            return call(*tensors, group=g.group, async_op=True)
        counts = _GlooWork.counts(tensors)
        return _GlooWork(call(*tensors, group=g.group, async_op=True), tensors, counts)
    if staged is not None and g.group.backend == "gloo":
        torch.empty_like(staged)
    return _Done()


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


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


# One collective call on one process group (a flat ring over its ranks). ---------------

def _flat_gather(x: torch.Tensor, dim: int, g: AxisGroup) -> Steps:
    given, x = x, x.contiguous()
    shape = tuple(x.shape)
    out = x.new_empty((g.size * shape[0],) + shape[1:])
    yield _launch(dist.all_gather_into_tensor, g, out, x, staged=out)
    if not _shares_storage(x, given):
        free_temporary(x)
    del x, given
    # Each copy on the way frees what it copied (a simulated step, by reference).
    stacked = out.view((g.size,) + shape)
    if g.shard_of_group_rank is not None:
        stacked = stacked[list(g.group_rank_of_shard)]
        free_temporary(out)
        out = stacked
    result = _merge_leading(stacked, dim)
    del stacked
    if not _shares_storage(out, result):
        free_temporary(out)
    return result


def _flat_all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, g: AxisGroup) -> Steps:
    send = _stack_chunks(x, dst_dim, g.size, g.shard_of_group_rank)
    recv = torch.empty_like(send)
    yield _launch(dist.all_to_all_single, g, recv, send)
    # The send buffer goes before the received blocks are copied into place
    # (merged along a dim other than the first): the step holds two buffers of
    # the result's size, as the memory model counts, not three (a simulated
    # step frees them as their references go).
    free_temporary(send)
    del send
    if g.shard_of_group_rank is not None:
        ordered = recv[list(g.group_rank_of_shard)]
        free_temporary(recv)
        recv = ordered
        del ordered
    result = _merge_leading(recv, src_dim)
    if not _shares_storage(recv, result):
        free_temporary(recv)
    return result


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    # The storage objects' identity, not their data pointers (FakeTensors in a
    # simulated step have none: reading one warns, and will raise).
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


def _flat_all_reduce(x: torch.Tensor, g: AxisGroup) -> Steps:
    """Sums ``x`` (contiguous) in place."""
    yield _launch(dist.all_reduce, g, x)
    return x


def _flat_reduce_scatter(x: torch.Tensor, dim: int, g: AxisGroup) -> Steps:
    send = _stack_chunks(x, dim, g.size, g.shard_of_group_rank)
    if _backend(g) == "gloo":
        # gloo's reduce_scatter_tensor all-reduces a clone of its input, which
        # lives on until some later collective (the measured peak varied by that
        # clone from step to step). All-reducing our stacked copy in place moves
        # the same bytes, and every buffer dies where the program drops it.
        yield _launch(dist.all_reduce, g, send)
        mine = g.index if g.group_rank_of_shard is None else g.group_rank_of_shard[g.index]
        out = send[mine].clone()
        free_temporary(send)
        return out
    out = send.new_empty(send.shape[1:])
    yield _launch(dist.reduce_scatter_tensor, g, out, send.view((-1,) + tuple(send.shape[2:])))
    return out


def free_temporary(t: torch.Tensor) -> None:
    """Free the bytes of ``t``, a buffer of the program's own that a finished
    collective used and that nothing reads again, now, whoever still holds a
    reference: gloo's worker thread can hold one past ``_GlooWork``'s bounded
    wait on a busy machine (seen: a reduce-scatter's 512 KB stacked input kept
    to the end of the step on one rank of four; an all-to-all's 256 KB send
    buffer in benches/trust.py's ResNet), where the simulated step and the
    memory model free it here. A simulated step's tensors (which it frees by
    reference count at the same point) are left alone."""
    if is_simulated(t):
        return
    t.untyped_storage().resize_(0)


def is_simulated(t: torch.Tensor) -> bool:
    """A tensor of a simulated step (``generate/simulate.py``): fake or meta, no values."""
    from torch._subclasses.fake_tensor import is_fake

    return t.is_meta or is_fake(t)


def _backend(g: AxisGroup) -> str:
    return g.group.backend if g.simulated else dist.get_backend(g.group)


# A collective over a group by the algorithm its price assumed: one flat call, or
# one call per step on the steps' groups. A dim split over the group's axes is
# viewed as one sub-dim per axis (in the group's order, the first most
# significant) before the local rest; each step gathers, scatters or exchanges
# the sub-dim of its axis, so every shard lands where the flat call puts it.

def _sub_dims(g: AxisGroup) -> list[int]:
    shape = g.owner.mesh.shape
    return [shape[a] for a in g.axes]


def _memory_order(x: torch.Tensor) -> list[int] | None:
    """``x``'s dims from the outermost in memory to the innermost (by stride),
    None where that is their own order."""
    if x.dim() < 2 or x.is_contiguous():
        return None
    order = sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))
    return None if order == list(range(x.dim())) else order


def _keeping_layout(run, x: torch.Tensor, *dims: int) -> Steps:
    """``run(x, *dims)``, its result laid out in memory in the order of ``x``'s
    dims: the collective runs on ``x`` viewed in its memory order (the same
    bytes moved) and its result is viewed back. A transposed input keeps
    its layout through the conversion, as it would without one: attention's
    output stays (batch, sequence, head, feature) in memory where its inputs
    are, so the transpose and reshape merging its heads are views, as in the
    serial model; from contiguous (batch, head, ...) inputs that reshape copied,
    0.25 MiB per layer and microbatch the memory model did not count (trust
    GPT-2, 2 pipeline stages on (4,))."""
    order = _memory_order(x)
    if order is None:
        return (yield from run(x, *dims))
    y = yield from run(x.permute(order), *(order.index(d) for d in dims))
    return y.permute([order.index(d) for d in range(x.dim())])


def _gather(x: torch.Tensor, dim: int, g: AxisGroup) -> Steps:
    if g.size == 1:
        return x
    return (yield from _keeping_layout(lambda y, d: _gather_in_order(y, d, g), x, dim))


def _gather_in_order(x: torch.Tensor, dim: int, g: AxisGroup) -> Steps:
    plan = g.algorithm("all_gather", _nbytes(x) * g.size)
    if plan.flat:
        return (yield from _flat_gather(x, dim, g))
    k = len(g.axes)
    y = x.unflatten(dim, (1,) * k + (-1,))
    for step in plan.steps:
        y = yield from _flat_gather(y, dim + g.axes.index(step.axes[0]), g.along(step.axes))
    return y.flatten(dim, dim + k)


def _reduce_scatter(x: torch.Tensor, dim: int, g: AxisGroup) -> Steps:
    if g.size == 1:
        return x
    return (yield from _keeping_layout(lambda y, d: _reduce_scatter_in_order(y, d, g), x, dim))


def _reduce_scatter_in_order(x: torch.Tensor, dim: int, g: AxisGroup) -> Steps:
    plan = g.algorithm("reduce_scatter", _nbytes(x))
    if plan.flat:
        return (yield from _flat_reduce_scatter(x, dim, g))
    k = len(g.axes)
    y = x.unflatten(dim, _sub_dims(g) + [-1])
    for step in plan.steps:
        y = yield from _flat_reduce_scatter(y, dim + g.axes.index(step.axes[0]),
                                            g.along(step.axes))
    return y.flatten(dim, dim + k)


def _all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, g: AxisGroup) -> Steps:
    if g.size == 1:
        return x
    return (yield from _keeping_layout(lambda y, s, d: _all_to_all_in_order(y, s, d, g), x,
                                       src_dim, dst_dim))


def _all_to_all_in_order(x: torch.Tensor, src_dim: int, dst_dim: int, g: AxisGroup) -> Steps:
    plan = g.algorithm("all_to_all", _nbytes(x))
    if plan.flat:
        return (yield from _flat_all_to_all(x, src_dim, dst_dim, g))
    k = len(g.axes)
    # Unflatten (and later flatten) the later dim first: the earlier keeps its index.
    whole = (1,) * k + (-1,)
    split = _sub_dims(g) + [-1]
    if src_dim > dst_dim:
        y = x.unflatten(src_dim, whole).unflatten(dst_dim, split)
        src0, dst0 = src_dim + k, dst_dim
    else:
        y = x.unflatten(dst_dim, split).unflatten(src_dim, whole)
        src0, dst0 = src_dim, dst_dim + k
    for step in plan.steps:
        j = g.axes.index(step.axes[0])
        y = yield from _flat_all_to_all(y, src0 + j, dst0 + j, g.along(step.axes))
    first, last = sorted((src0, dst0))
    return y.flatten(last, last + k).flatten(first, first + k)


def _all_reduce_into(x: torch.Tensor, g: AxisGroup) -> Steps:
    """Sums ``x`` (contiguous) over the group in place. Per axis: the flattened
    buffer (padded to a multiple of the scattered axes' sizes) is scattered,
    its share summed along the other axes, and gathered back."""
    if g.size == 1:
        return x
    plan = g.algorithm("all_reduce", _nbytes(x))
    if plan.flat:
        return (yield from _flat_all_reduce(x, g))
    shape = g.owner.mesh.shape
    scattered = [step.axes[0] for step in plan.steps if step.kind == "reduce_scatter"]
    flat = x.view(-1)
    pad = -flat.numel() % math.prod(shape[a] for a in scattered)
    y = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat
    y = y.view([shape[a] for a in scattered] + [-1])
    for step in plan.steps:
        group = g.along(step.axes)
        if step.kind == "reduce_scatter":
            y = yield from _flat_reduce_scatter(y, scattered.index(step.axes[0]), group)
        elif step.kind == "all_gather":
            y = yield from _flat_gather(y, scattered.index(step.axes[0]), group)
        else:
            y = yield from _flat_all_reduce(y.contiguous(), group)
    flat.copy_(y.reshape(-1)[:flat.numel()])
    return x


def _all_reduce(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    if g.size == 1:
        return x
    return _finish(_all_reduce_into(x.contiguous().clone(), g))


def _split(x: torch.Tensor, dim: int, g: AxisGroup) -> torch.Tensor:
    if g.size == 1:
        return x
    with tagged("communication"):
        # A copy, also where the shard is contiguous: as a view it would keep
        # its whole input alive as long as it lives (a reader that saves it,
        # a gradient waiting for its node), where the memory model counts the
        # shard only (``solve.memory.conversion_bytes``).
        return x.chunk(g.size, dim)[g.index].clone(memory_format=torch.contiguous_format)


def all_reduce_(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Sum ``x`` (contiguous, outside autograd) over the group in place."""
    if torch.compiler.is_compiling():
        return x.copy_(torch.ops.automap.all_reduce_sum(x, group.compile_key))
    return _finish(_all_reduce_into(x, group))


class PendingAllReduce:
    """An in-place all-reduce of ``x`` (contiguous) over ``group`` by its planned
    algorithm, one asynchronous step at a time: ``advance()`` waits for the
    running step and launches the next unless it is the last, ``wait()`` runs it
    to the end. Each step is a collective, so every rank of the group must call
    these at the same points of its program."""

    def __init__(self, x: torch.Tensor, group: AxisGroup) -> None:
        self.result = x
        self._left = 0 if group.size == 1 else len(
            group.algorithm("all_reduce", _nbytes(x)).steps)
        self._steps = _all_reduce_into(x, group)
        self._work = None
        self._resume(None)

    def _resume(self, value) -> None:
        try:
            self._work = self._steps.send(value)
        except StopIteration:
            self._work = None

    def _step(self) -> None:
        self._work.wait()
        self._left -= 1
        self._resume(None)

    def advance(self) -> None:
        if self._work is not None and self._left > 1:
            self._step()

    def wait(self) -> torch.Tensor:
        while self._work is not None:
            self._step()
        return self.result


class _AllGatherDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, g):
        ctx.dim, ctx.g = dim, g
        return _finish(_gather(x, dim, g))

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
        return _finish(_gather(grad, ctx.dim, ctx.g)), None, None


class _AllToAllDims(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src_dim, dst_dim, g):
        ctx.src_dim, ctx.dst_dim, ctx.g = src_dim, dst_dim, g
        return _finish(_all_to_all(x, src_dim, dst_dim, g))

    @staticmethod
    def backward(ctx, grad):
        return _finish(_all_to_all(grad, ctx.dst_dim, ctx.src_dim, ctx.g)), None, None, None


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
        return _finish(_reduce_scatter(x, dim, g))

    @staticmethod
    def backward(ctx, grad):
        return _finish(_gather(grad, ctx.dim, ctx.g)), None, None


class _GatherShard(_AllGatherDim):
    """An all-gather whose backward reduce-scatters the gradient into the shard."""

    @staticmethod
    def backward(ctx, grad):
        return _finish(_reduce_scatter(grad.contiguous(), ctx.dim, ctx.g)), None, None


def gather_shard(x: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
    """A parameter stored sharded along ``dim`` over the group (FSDP/ZeRO-3),
    gathered for its use; the use's gradient, partial over the same group (the
    batch is split there), is reduce-scattered straight into the shard: half the
    traffic of all-reducing it and then keeping the own shard."""
    if torch.compiler.is_compiling():
        return torch.ops.automap.gather_shard(x, dim, group.compile_key)
    return _GatherShard.apply(x, dim, group)


def all_gather_dim(x: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
    """Concatenate the shards of ``x`` along ``dim`` (backward: keep own shard)."""
    if torch.compiler.is_compiling():
        return torch.ops.automap.all_gather_dim(x, dim, group.compile_key)
    return _AllGatherDim.apply(x, dim, group)


def split_dim(x: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
    """Keep this rank's shard of ``x`` along ``dim`` (backward: all-gather)."""
    if torch.compiler.is_compiling():
        return torch.ops.automap.split_dim(x, dim, group.compile_key)
    return _SplitDim.apply(x, dim, group)


def all_to_all_dims(x: torch.Tensor, src_dim: int, dst_dim: int, group: AxisGroup):
    """Gather ``src_dim`` and split ``dst_dim`` in one all-to-all (backward: the reverse)."""
    if torch.compiler.is_compiling():
        return torch.ops.automap.all_to_all_dims(x, src_dim, dst_dim, group.compile_key)
    return _AllToAllDims.apply(x, src_dim, dst_dim, group)


def all_reduce_sum(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Sum partial values over the group (backward: identity)."""
    if torch.compiler.is_compiling():
        return torch.ops.automap.all_reduce_sum(x, group.compile_key)
    return _AllReduceSum.apply(x, group)


def identity_all_reduce_grad(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Identity whose backward sums the gradient over the group."""
    if torch.compiler.is_compiling():
        return torch.ops.automap.identity_all_reduce_grad(x, group.compile_key)
    return _IdentityAllReduceGrad.apply(x, group)


def reduce_scatter_dim(x: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
    """Sum partial values and keep this rank's shard along ``dim`` (backward: all-gather)."""
    if torch.compiler.is_compiling():
        return torch.ops.automap.reduce_scatter_dim(x, dim, group.compile_key)
    return _ReduceScatterDim.apply(x, dim, group)


# Under torch.compile. ------------------------------------------------------------------
# The collectives above are autograd Functions whose eager bodies set a ContextVar
# (``tagged``) and drive generators of gloo works: Dynamo breaks the graph at each.
# While compiling, each public function calls a custom op instead (one per
# collective, registered below): opaque to Dynamo, AOTAutograd and Inductor, with a
# fake implementation for shapes and the same dual as its backward; at run time the
# op runs the same eager code (the planned algorithm, ``_GlooWork``'s release of
# memory), so values are the eager ones. A custom op may not return a view of its
# input: a result that shares the input's storage (a split along dim 0, a group of
# one) is copied. Ops refer to their group by ``AxisGroup.compile_key``.

def _group(key: str) -> AxisGroup:
    from automap.sharding.process_groups import group_of_compile_key

    return group_of_compile_key(key)


def _fresh(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y`` contiguous (the fake implementations' strides) and not sharing ``x``'s storage."""
    y = y.contiguous()
    same = y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    return y.clone() if same and x.numel() > 0 else y


def _resized(x: torch.Tensor, dim: int, times: int = 1, parts: int = 1) -> torch.Tensor:
    """An empty ``x`` whose ``dim`` is ``times`` longer, then cut in ``parts``."""
    shape = list(x.shape)
    shape[dim] = shape[dim] * times // parts
    return x.new_empty(shape)


@torch.library.custom_op("automap::all_gather_dim", mutates_args=())
def _op_all_gather_dim(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    return _fresh(_finish(_gather(x, dim, _group(group))), x)


@torch.library.custom_op("automap::gather_shard", mutates_args=())
def _op_gather_shard(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    return _fresh(_finish(_gather(x, dim, _group(group))), x)


@torch.library.custom_op("automap::split_dim", mutates_args=())
def _op_split_dim(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    return _fresh(_split(x, dim, _group(group)), x)


@torch.library.custom_op("automap::all_to_all_dims", mutates_args=())
def _op_all_to_all_dims(x: torch.Tensor, src_dim: int, dst_dim: int, group: str
                        ) -> torch.Tensor:
    return _fresh(_finish(_all_to_all(x, src_dim, dst_dim, _group(group))), x)


@torch.library.custom_op("automap::all_reduce_sum", mutates_args=())
def _op_all_reduce_sum(x: torch.Tensor, group: str) -> torch.Tensor:
    return _fresh(_all_reduce(x, _group(group)), x)


@torch.library.custom_op("automap::identity_all_reduce_grad", mutates_args=())
def _op_identity_all_reduce_grad(x: torch.Tensor, group: str) -> torch.Tensor:
    return x.clone()


@torch.library.custom_op("automap::reduce_scatter_dim", mutates_args=())
def _op_reduce_scatter_dim(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    return _fresh(_finish(_reduce_scatter(x, dim, _group(group))), x)


@_op_all_gather_dim.register_fake
def _(x, dim, group):
    return _resized(x, dim, times=_group(group).size)


@_op_gather_shard.register_fake
def _(x, dim, group):
    return _resized(x, dim, times=_group(group).size)


@_op_split_dim.register_fake
def _(x, dim, group):
    return _resized(x, dim, parts=_group(group).size)


@_op_all_to_all_dims.register_fake
def _(x, src_dim, dst_dim, group):
    size = _group(group).size
    return _resized(_resized(x, src_dim, times=size), dst_dim, parts=size)


@_op_all_reduce_sum.register_fake
def _(x, group):
    return torch.empty_like(x)


@_op_identity_all_reduce_grad.register_fake
def _(x, group):
    return torch.empty_like(x)


@_op_reduce_scatter_dim.register_fake
def _(x, dim, group):
    return _resized(x, dim, parts=_group(group).size)


def _keep_args(ctx, inputs, output) -> None:
    ctx.args = inputs[1:]


def _gather_back(ctx, grad):
    dim, group = ctx.args
    return torch.ops.automap.all_gather_dim(grad, dim, group), None, None


def _reduce_scatter_back(ctx, grad):
    dim, group = ctx.args
    return torch.ops.automap.reduce_scatter_dim(grad.contiguous(), dim, group), None, None


def _split_back(ctx, grad):
    dim, group = ctx.args
    return torch.ops.automap.split_dim(grad, dim, group), None, None


def _all_to_all_back(ctx, grad):
    src_dim, dst_dim, group = ctx.args
    return torch.ops.automap.all_to_all_dims(grad, dst_dim, src_dim, group), None, None, None


def _all_reduce_sum_back(ctx, grad):
    return grad, None


def _identity_back(ctx, grad):
    return torch.ops.automap.all_reduce_sum(grad, ctx.args[0]), None


for _op, _backward in ((_op_all_gather_dim, _split_back), (_op_split_dim, _gather_back),
                       (_op_gather_shard, _reduce_scatter_back),
                       (_op_all_to_all_dims, _all_to_all_back),
                       (_op_all_reduce_sum, _all_reduce_sum_back),
                       (_op_identity_all_reduce_grad, _identity_back),
                       (_op_reduce_scatter_dim, _gather_back)):
    _op.register_autograd(_backward, setup_context=_keep_args)
