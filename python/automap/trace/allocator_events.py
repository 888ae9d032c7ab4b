"""The CPU (or CUDA) allocator's running total, read from the PyTorch profiler's
memory events (``profile_memory=True``).

Every allocation event carries the allocator's own running total, kept
whatever thread allocates or frees; the profiler loses the events of frees on
some threads (gloo's workers drop tensors a collective held), so summing the
events' sizes overcounts and the running total is what to read."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def allocation_events(kineto_results: Any, device: str = "cpu") -> list[Any]:
    """The allocation and free events on ``device``, in time order, from a
    profiler's ``kineto_results`` (``torch.profiler.profile(...).profiler.kineto_results``
    or ``torch.autograd.profiler.profile(...).kineto_results``)."""
    return sorted((n for n in _walk(kineto_results.experimental_event_tree())
                   if str(n.typed[0]).endswith("Allocation")
                   and n.typed[1].device.type == device),
                  key=lambda n: n.start_time_ns)


def total_before(events: list[Any]) -> int:
    """The allocator's total just before the first of ``events``."""
    first = events[0].typed[1]
    return first.total_allocated - first.alloc_size


def allocation_peak_bytes(kineto_results: Any, device: str = "cpu") -> int:
    """The most bytes the allocator held during the profiled region beyond what it
    held when the region began (0 without events)."""
    events = allocation_events(kineto_results, device)
    if not events:
        return 0
    return max(e.typed[1].total_allocated for e in events) - total_before(events)


def _walk(nodes: list) -> Iterator[Any]:
    for node in nodes:
        yield node
        yield from _walk(node.children)
