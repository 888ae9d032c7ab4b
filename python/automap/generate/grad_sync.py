"""Data-parallel gradient synchronisation: parameters replicated along mesh axes
that split the batch get partial gradients, summed over those axes.

The graph pass leaves a parameter's backward all-reduce to this class when every
use of the parameter reduces its gradient over the same axes with no layout
conversion in between (the plain data-parallel case): the gradient then equals
the all-reduce of the accumulated ``.grad``. Gradients are packed into buckets
(TAP/DDP style), each all-reduced asynchronously as soon as all its gradients
are accumulated during the backward, by the algorithm the mesh's link model
chooses (over several axes possibly in per-axis steps, see
``automap.sharding.collectives``); the end of the backward waits for them, so
``loss.backward()`` returns synchronised gradients and any optimizer works
unchanged. Gradient accumulation over several backward calls stays exact: a
gradient that existed before the backward is subtracted out of the sum again.
Under mixed precision a bucket is reduced in the setting's ``reduce_dtype`` (its
flat copy is cast, and the sum cast back into each ``.grad``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from automap.sharding.collectives import (
    DEFAULT_BUCKET_BYTES,
    PendingAllReduce,
    free_temporary,
    tagged,
)
from automap.sharding.process_groups import AxisGroup


@dataclass
class _Bucket:
    group: AxisGroup
    params: list[nn.Parameter]
    ready: set = field(default_factory=set)
    work: PendingAllReduce | None = None
    flat: torch.Tensor | None = None


class GradientSync:
    """Bucketed asynchronous all-reduce of the gradients of ``params`` (in the
    order their gradients are expected, roughly the reverse of the forward)."""

    def __init__(self, params: list[tuple[nn.Parameter, AxisGroup]],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 reduce_dtype: torch.dtype | None = None) -> None:
        self.reduce_dtype = reduce_dtype  # None: each gradient's own dtype
        self.buckets: list[_Bucket] = []
        open_by_group: dict[tuple, _Bucket] = {}
        self._bucket_of: dict[int, _Bucket] = {}
        for param, group in params:
            # One dtype per bucket: a complex gradient cat with real ones would
            # make every one complex (and the real ones warn when copied back).
            key = (group.axes, param.dtype)
            bucket = open_by_group.get(key)
            nbytes = param.numel() * param.element_size()
            if bucket is None or sum(p.numel() * p.element_size()
                                     for p in bucket.params) + nbytes > bucket_bytes:
                bucket = _Bucket(group, [])
                self.buckets.append(bucket)
                open_by_group[key] = bucket
            bucket.params.append(param)
            self._bucket_of[id(param)] = bucket
        self._previous: dict[int, torch.Tensor] = {}
        self._in_backward = False
        self._deferred = False
        self.handles = []
        for param, _ in params:
            self.handles.append(param.register_hook(self._before_accumulate(param)))
            self.handles.append(param.register_post_accumulate_grad_hook(self._accumulated))

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Several backward calls of one step (a pipeline's microbatches): within,
        gradients accumulate unsynchronised; leaving without an error, every
        bucket is all-reduced once (gradients present before entering are kept
        once, not summed over the group)."""
        previous = {id(p): p.grad.detach().clone() for b in self.buckets for p in b.params
                    if p.grad is not None}
        self._deferred = True
        try:
            yield
        finally:
            self._deferred = False
        for bucket in self.buckets:
            self._launch(bucket)
        self._previous = previous
        self.finish()

    def _before_accumulate(self, param: nn.Parameter):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            if self._deferred:
                return grad
            if not self._in_backward:
                self._in_backward = True
                torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            if param.grad is not None and id(param) not in self._previous:
                self._previous[id(param)] = param.grad.detach().clone()
            return grad

        return hook

    def _accumulated(self, param: nn.Parameter) -> None:
        if self._deferred:
            return
        bucket = self._bucket_of[id(param)]
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        grads = [p.grad for p in bucket.params if p.grad is not None]
        if not grads or bucket.group.size == 1:
            return
        # An all-reduce over several axes may run in steps (reduce-scatter, all-reduce,
        # all-gather): each launch moves the earlier buckets one step on, at the same
        # point of the backward on every rank, so every group sees the same order.
        for other in self.buckets:
            if other.work is not None:
                other.work.advance()
        with tagged("gradient_buckets"):
            bucket.flat = torch.cat([g.reshape(-1) for g in grads])
            if self.reduce_dtype is not None and bucket.flat.is_floating_point() and \
                    bucket.flat.dtype != self.reduce_dtype:
                bucket.flat = bucket.flat.to(self.reduce_dtype)
            bucket.work = PendingAllReduce(bucket.flat, bucket.group)

    def finish(self) -> None:
        """Wait for every bucket and write the sums back (end of the backward)."""
        for bucket in self.buckets:
            if bucket.work is None and bucket.flat is None:
                self._launch(bucket)  # some gradient never came: sync what there is
            if bucket.work is not None:
                bucket.work.wait()
                # One split and one multi-tensor copy: a third of the dispatches of
                # a slice, view and copy per gradient (a simulated step's fake
                # dispatches cost 0.3-1 ms each).
                synced = [p for p in bucket.params if p.grad is not None]
                sums = bucket.flat.split([p.grad.numel() for p in synced])
                torch._foreach_copy_([p.grad for p in synced],
                                     [s.view_as(p.grad) for s, p in zip(sums, synced, strict=True)])
                for p in synced:
                    previous = self._previous.get(id(p))
                    if previous is not None:  # it was summed size times: keep it once
                        p.grad.sub_(previous, alpha=bucket.group.size - 1)
            bucket.ready.clear()
            if bucket.flat is not None:
                free_temporary(bucket.flat)
            bucket.work = bucket.flat = None
        self._previous.clear()
        self._in_backward = False
