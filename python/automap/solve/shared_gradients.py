"""Gradient reductions shared by the readers of one tensor.

When several nodes read one tensor as it was produced or stored (no layout
conversion on their edges) and each leaves that input's gradient partial over
the same mesh axes (q, k and v projections of one replicated hidden state,
split over the tensor-parallel axis; a tied embedding read by the lookup and
the LM head with the batch split), the generated program sums the partial
gradients locally and all-reduces the sum once (Megatron's ``f`` operator):
``generate/build.py`` wraps the tensor once for all of them. Each strategy's
``backward_comm_s`` prices its own all-reduce, so a plan's time counts
``readers - 1`` all-reduces too many; the ILP (``solve/ilp.py``) and the step
time (``planner/step_time.py``) take them back with this module's groups.

A parameter's group runs as one wrap too; where every read of the parameter
is in one group, the wrap's all-reduce goes to the data-parallel buckets
(``generate/grad_sync.py``), which the step time prices on their own
(``step_time.shared_gradient_savings`` leaves those groups out)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from automap.solve.strategies import ShardCounts, StrategyTable

#: Node kinds whose readers' gradient reductions are never shared (no gradient).
UNSHARED_KINDS = frozenset({"buffer"})


@dataclass(frozen=True)
class SharedGradient:
    """One all-reduce that serves several readers of ``producer``'s output."""

    producer: str
    output_index: int
    spec: str  # the tensor's spec, as produced and as read
    axes: tuple[int, ...]
    readers: tuple[tuple[str, int], ...]  # (consumer, input index), in graph order
    local_bytes: float  # the all-reduced buffer on one device

    @property
    def saved_reductions(self) -> int:
        """All-reduces the readers' strategies price beyond the one that runs."""
        return len(self.readers) - 1


@dataclass(frozen=True)
class Reading:
    """One edge as a plan runs it: who reads what, in which spec, and the
    mesh axes its gradient is reduced over there."""

    producer: str
    output_index: int
    consumer: str
    input_index: int
    src: str
    dst: str
    grad_axes: tuple[int, ...]
    nbytes: float  # the whole tensor
    from_buffer: bool  # a buffer's (no gradient to share)


def shared_gradients(readings: Iterable[Reading], shard_count) -> list[SharedGradient]:
    """The groups of readings whose gradient reductions run as one (see the
    module docstring); ``shard_count(spec)`` is the number of shards of a spec."""
    groups: dict[tuple, list[Reading]] = {}
    for r in readings:
        if r.from_buffer or not r.grad_axes or r.src != r.dst:
            continue
        groups.setdefault((r.producer, r.output_index, r.grad_axes), []).append(r)
    out = []
    for (producer, o, axes), members in groups.items():
        if len(members) < 2:
            continue
        spec = members[0].src
        out.append(SharedGradient(producer, o, spec, axes,
                                  tuple((m.consumer, m.input_index) for m in members),
                                  members[0].nbytes / shard_count(spec)))
    return out


def table_readings(table: StrategyTable, choice: dict[str, int]) -> list[Reading]:
    """The readings of ``table``'s edges under ``choice`` (strategy index per node)."""
    out = []
    for producer, o, consumer, k in table.edges():
        p, c = table.nodes[producer], table.nodes[consumer]
        grads = c.reductions[choice[consumer]][2] if c.reductions is not None else []
        out.append(Reading(producer, o, consumer, k, p.out_specs[choice[producer]][o],
                           c.in_specs[choice[consumer]][k],
                           tuple(grads[k]) if k < len(grads) else (),
                           float(p.outputs[o].nbytes), p.kind in UNSHARED_KINDS))
    return out


def table_shared_gradients(table: StrategyTable, choice: dict[str, int]
                           ) -> list[SharedGradient]:
    return shared_gradients(table_readings(table, choice), ShardCounts(table.mesh))


def plan_readings(plan) -> list[Reading]:
    """The readings of a ``Plan``'s edges (its nodes' chosen specs and reductions)."""
    out = []
    for e in plan.edges:
        grads = plan.nodes[e.consumer].grad_reduce_axes
        out.append(Reading(e.producer, e.output_index, e.consumer, e.input_index, e.src, e.dst,
                           tuple(grads[e.input_index]) if e.input_index < len(grads) else (),
                           float(math.prod(e.shape) * e.dtype_bytes),
                           plan.nodes[e.producer].kind in UNSHARED_KINDS))
    return out
