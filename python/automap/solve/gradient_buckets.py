"""The data-parallel gradient buckets of a choice of strategies: which
parameters' gradients the generated program all-reduces in buckets
(``generate/grad_sync.py``, ``defer_parameter_gradient_sync`` in
``generate/build.py``), over which mesh axes, and how they are packed
(``DEFAULT_BUCKET_BYTES``, one open bucket per set of axes, in the reverse order
of first use). The step time prices their all-reduces
(``planner/step_time.py``); the memory model places each bucket's flat copy where
its last gradient is ready (``solve/memory.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from automap.sharding.collectives import DEFAULT_BUCKET_BYTES
from automap.solve.strategies import ShardCounts

CAST_OP = "_to_copy"  # op_family of a cast


def _reads_through_casts(table, choice, readers, producer: str, o: int, consumer: str, k: int):
    """The reads of a parameter edge, looking through a cast it feeds as stored
    (mixed precision's, ``generate/build._through_casts``): the cast's own reads
    of its output instead, each (producer, output, consumer, input);
    ``readers``: producer -> its out-edges."""
    cast = table.nodes[consumer]
    src = table.nodes[producer].out_specs[choice[producer]][o]
    if cast.op != CAST_OP or len(cast.inputs) != 1 or src != cast.in_specs[choice[consumer]][k]:
        return [(producer, o, consumer, k)]
    return readers.get(consumer) or [(producer, o, consumer, k)]


def deferred_gradients(table, choice) -> dict[str, tuple[tuple[int, ...], float]]:
    """Parameter placeholder -> (mesh axes, bucket bytes) of the gradients the
    generated program all-reduces in buckets (``defer_parameter_gradient_sync``
    in ``generate/build.py``): every use reads the parameter as stored (or a
    cast of it, itself read as produced) and reduces its gradient over the
    same axes. The bytes are the local shard's in the table's
    ``gradient_reduce_bytes`` per element (mixed precision's ``reduce_dtype``),
    else in the parameter's dtype. Tied placeholders count as their canonical one."""
    return {param: (axes, nbytes) for param, (axes, nbytes, _) in
            deferred_with_readers(table, choice).items()}


def deferred_with_readers(table, choice) -> dict[str, tuple[tuple[int, ...], float, list[str]]]:
    """``deferred_gradients`` plus, per parameter, the producers (the parameter,
    its casts) whose readers' gradient all-reduces the buckets take over."""
    readers: dict[str, list] = {}
    for edge in table.edges():
        readers.setdefault(edge[0], []).append(edge)
    uses: dict[str, list] = {}
    for producer, o, consumer, k in table.edges():
        node = table.nodes[producer]
        if node.kind == "parameter":
            uses.setdefault(node.tied_to or producer, []).extend(
                _reads_through_casts(table, choice, readers, producer, o, consumer, k))
    shard_count = ShardCounts(table.mesh)
    out = {}
    for param, edges in uses.items():
        axes = set()
        for producer, o, consumer, k in edges:
            src = table.nodes[producer].out_specs[choice[producer]][o]
            node = table.nodes[consumer]
            c = choice[consumer]
            grads = node.reductions[c][2] if node.reductions is not None else []
            reduce = tuple(grads[k]) if k < len(grads) else ()
            axes.add(reduce if src == node.in_specs[c][k] else None)
        if len(axes) != 1 or None in axes or () in axes:
            continue
        info = table.nodes[param].outputs[0]
        nbytes = info.nbytes / shard_count(table.nodes[param].out_specs[choice[param]][0])
        if table.gradient_reduce_bytes is not None:
            nbytes *= table.gradient_reduce_bytes / info.dtype_bytes
        out[param] = (axes.pop(), nbytes, sorted({e[0] for e in edges}))
    return out


@dataclass
class Bucket:
    axes: tuple[int, ...]
    params: list[str]  # parameter placeholders, in the order they join
    nbytes: float = 0.0


def gradient_buckets(table, choice, node_weight=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                     deferred: dict | None = None) -> tuple[list[Bucket], dict[str, str]]:
    """The buckets ``GradientSync`` fills for the deferred gradients (reverse
    order of first use, one open bucket per set of axes; ``deferred``:
    ``deferred_gradients`` where the caller has it), and each deferred
    parameter's first consumer (its gradient is ready when the backward has
    passed it)."""
    node_weight = node_weight or {}
    if deferred is None:
        deferred = deferred_gradients(table, choice)
    first_use: dict[str, str] = {}
    for producer, _, consumer, _ in table.edges():
        param = table.nodes[producer].tied_to or producer
        if param in deferred and param not in first_use:
            first_use[param] = consumer
    position = {name: i for i, name in enumerate(table.nodes)}
    buckets: list[Bucket] = []
    open_by_axes: dict[tuple, Bucket] = {}
    for param in sorted(first_use, key=lambda p: position[first_use[p]])[::-1]:
        axes, nbytes = deferred[param]
        nbytes *= node_weight.get(param, 1.0)
        bucket = open_by_axes.get(axes)
        if bucket is None or bucket.nbytes + nbytes > bucket_bytes:
            bucket = open_by_axes[axes] = Bucket(axes, [])
            buckets.append(bucket)
        bucket.params.append(param)
        bucket.nbytes += nbytes
    return buckets, first_use
