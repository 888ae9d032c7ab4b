"""The scratch memory a CPU kernel allocates inside one op, measured by running it.

oneDNN's convolutions reorder their operands into blocked layouts and keep
per-thread partial weight gradients; which buffers it allocates depends on the
channel counts, kernel, stride, groups, output mask, the ISA and the thread
count (a [16, 4, 32, 32] input's backward, 3x3, 16 outputs: 1.50 MiB here; a
layout-derived rule said 1.75 MiB). So the scratch of one op on one set of
argument shapes is measured once per process: the op runs on real zero
tensors of those shapes and strides under the profiler's memory events, and
its scratch is the allocator's peak above where it began, less the op's
outputs (what a FakeTensor sees)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from automap.trace.allocator_events import allocation_peak_bytes

#: Ops whose real operands and outputs would exceed this are not run; their
#: scratch is the caller's estimate (a planning process should not allocate
#: what a rank's step does at full size).
MEASURE_LIMIT_BYTES = 256 * 2**20

_measured: dict[tuple, int] = {}
_limits: list[int] = []  # of the ``measuring_within`` blocks open


@contextlib.contextmanager
def measuring_within(limit_bytes: int) -> Iterator[None]:
    """Within, ops whose real operands and outputs exceed ``limit_bytes`` are
    not run but estimated (the strategy table asks every strategy's local
    shapes: hundreds of signatures on a 3-D mesh, each run costing its
    convolution's time)."""
    _limits.append(limit_bytes)
    try:
        yield
    finally:
        _limits.pop()


def measured_scratch(func: Any, args: tuple, out: Any,
                     estimate: Callable[[tuple, Any], int]) -> int:
    """Bytes ``func`` allocates on the CPU beyond its outputs ``out`` while it
    runs on operands shaped as ``args`` (FakeTensors or real): measured once per
    distinct signature and thread count; ``estimate(args, out)`` where it is not
    measured (operands over ``MEASURE_LIMIT_BYTES``, or a profiler already
    running, which cannot be nested)."""
    tensors = [a for a in pytree.tree_leaves((args, out)) if isinstance(a, torch.Tensor)]
    if (sum(t.numel() * t.element_size() for t in tensors) > min([MEASURE_LIMIT_BYTES, *_limits])
            or torch._C._autograd._profiler_enabled()):
        return estimate(args, out)
    key = (func, torch.get_num_threads(), torch.backends.mkldnn.enabled,
           tuple(_signature(a) for a in args))
    if key not in _measured:
        with _disable_current_modes(), torch.no_grad():
            _measured[key] = _run(func, args)
    return _measured[key]


def _signature(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return ("tensor", tuple(arg.shape), tuple(arg.stride()), arg.dtype)
    if isinstance(arg, (list, tuple)):
        return tuple(_signature(a) for a in arg)
    return arg


def _real(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return torch.empty_strided(arg.shape, arg.stride(), dtype=arg.dtype).zero_()
    return arg


@contextlib.contextmanager
def _kineto_quiet() -> Iterator[None]:
    """The process's stderr (the file descriptor) sent to /dev/null: torch's
    profiler library logs each start and stop there from C++ ("USDT: ...
    profiler_start", since torch 2.15, and a failed GPU count without a GPU),
    two lines for every op signature a plan measures. Python's ``sys.stderr``
    object is flushed first; nothing of ours prints while the op runs."""
    fd = 2  # the C++ library's, whatever Python's sys.stderr is now
    sys.stderr.flush()
    try:
        saved = os.dup(fd)
    except OSError:  # no stderr at all
        yield
        return
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, fd)
        finally:
            os.close(null)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def _run(func: Any, args: tuple) -> int:
    # No warm-up run: oneDNN keeps its primitives outside PyTorch's allocator
    # (over 7 convolutions, forward and backward, a first run measured as the
    # third).
    real = pytree.tree_map(_real, args)
    with _kineto_quiet(), torch.autograd.profiler.profile(profile_memory=True) as prof:
        out = func(*real)
    outputs = sum(t.untyped_storage().nbytes() for t in pytree.tree_leaves(out)
                  if isinstance(t, torch.Tensor))
    return max(0, allocation_peak_bytes(prof.kineto_results) - outputs)
