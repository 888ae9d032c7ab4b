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
STATE_KINDS = ("parameter", "buffer", "constant")


def deferrable(parts: list[tuple[set, object]]) -> list[bool]:
    """Per part of the graph computed from state alone, given as (the parameters
    it reads, the group every read from outside it reduces its gradient over,
    None where not one), whether its parameters are bucketed: parts linked by
    a shared parameter stand or fall together, and need one group. The
    generator (``generate/build.defer_parameter_gradient_sync``) and the
    planner's bucket model decide by this one rule."""
    holders: dict = {}
    for i, (params, _) in enumerate(parts):
        for p in params:
            holders.setdefault(p, []).append(i)
    ok = [False] * len(parts)
    seen: set[int] = set()
    for start in range(len(parts)):
        if start in seen:
            continue
        linked, todo = [], [start]
        seen.add(start)
        while todo:
            i = todo.pop()
            linked.append(i)
            for p in parts[i][0]:
                for j in holders[p]:
                    if j not in seen:
                        seen.add(j)
                        todo.append(j)
        groups = {parts[i][1] for i in linked}
        fine = len(groups) == 1 and None not in groups
        for i in linked:
            ok[i] = fine
    return ok


def _state_only_parts(table, choice) -> tuple[dict[str, str], set[str]]:
    """The parts of the graph computed from stored state alone, as
    ``generate/build._state_only_components`` finds them in the generated graph:
    state reads, and nodes whose every input is such a part read as stored
    with no gradient reduction of its own (a conversion or a reduction puts a
    collective in between, which is not state). Returns node -> its part's
    root, and the roots of parts with a member whose output is partial (its
    reader in the program is an all-reduce: such a part is not deferred)."""
    root: dict[str, str] = {}

    def find(name: str) -> str:
        while root[name] != name:
            root[name] = root[root[name]]
            name = root[name]
        return name

    partial = set()
    for name, node in table.nodes.items():
        if node.kind in STATE_KINDS:
            root[name] = name
            continue
        if node.kind in ("input", "output"):
            continue
        c = choice[name]
        reductions = node.reductions[c] if node.reductions is not None else ((), None, [])
        grads = reductions[2]
        if any(producer not in root or k < len(grads) and grads[k]
               or table.nodes[producer].out_specs[choice[producer]][o] != node.in_specs[c][k]
               for k, (producer, o) in enumerate(node.inputs)):
            continue
        root[name] = name
        for producer, _ in node.inputs:
            root[find(producer)] = name
        if reductions[0]:
            partial.add(name)
    parts = {name: find(name) for name in root}
    return parts, {parts[name] for name in partial}


def deferred_gradients(table, choice) -> dict[str, tuple[tuple[int, ...], float]]:
    """Parameter placeholder -> (mesh axes, bucket bytes) of the gradients the
    generated program all-reduces in buckets (``defer_parameter_gradient_sync``
    in ``generate/build.py``): every read from outside the parameter's part of
    the graph computed from state alone (the parameter itself, its cast, a
    position embedding's lookup) is as stored and reduces its gradient over
    the same axes. The bytes are the local shard's in the table's
    ``gradient_reduce_bytes`` per element (mixed precision's ``reduce_dtype``),
    else in the parameter's dtype. Tied placeholders count as their canonical one."""
    return {param: (axes, nbytes) for param, (axes, nbytes, _) in
            deferred_with_readers(table, choice).items()}


def deferred_with_readers(table, choice) -> dict[str, tuple[tuple[int, ...], float, list]]:
    """``deferred_gradients`` plus, per parameter, the edges (producer, output,
    consumer, input) into its part from outside whose gradient all-reduces the
    buckets take over. Parts that share a (canonical) parameter are deferred
    together or not at all, as in the program."""
    parts, partial = _state_only_parts(table, choice)
    outside: dict[str, list] = {}  # part root -> edges read from outside it
    for producer, o, consumer, k in table.edges():
        # An integer or boolean tensor (a mask built from positions) carries no gradient.
        if producer in parts and parts.get(consumer) != parts[producer] \
                and table.nodes[producer].outputs[o].is_float:
            outside.setdefault(parts[producer], []).append((producer, o, consumer, k))
    params: dict[str, set[str]] = {}  # part root -> the canonical parameters in it
    for name, part in parts.items():
        node = table.nodes[name]
        if node.kind == "parameter":
            params.setdefault(part, set()).add(node.tied_to or name)
    axes_of: dict[str, tuple | None] = {}
    for part, edges in outside.items():
        if part not in params:
            continue
        axes = set()
        for producer, o, consumer, k in edges:
            node, c = table.nodes[consumer], choice[consumer]
            grads = node.reductions[c][2] if node.reductions is not None else []
            reduce = tuple(grads[k]) if k < len(grads) else ()
            src = table.nodes[producer].out_specs[choice[producer]][o]
            axes.add(reduce if reduce and src == node.in_specs[c][k] else None)
        axes_of[part] = axes.pop() if len(axes) == 1 and part not in partial else None
    roots = list(axes_of)
    ok = deferrable([(params[part], axes_of[part]) for part in roots])
    shard_count = ShardCounts(table.mesh)
    out = {}
    for part, deferred in zip(roots, ok):
        if not deferred:
            continue
        axes = axes_of[part]
        for param in params[part]:
            node = table.nodes[param]
            if not node.grad_bytes.any():  # frozen: no gradient to reduce
                continue
            info = node.outputs[0]
            nbytes = info.nbytes / shard_count(node.out_specs[choice[param]][0])
            if table.gradient_reduce_bytes is not None:
                nbytes *= table.gradient_reduce_bytes / info.dtype_bytes
            if param in out:
                out[param][2].extend(outside[part])
            else:
                out[param] = (axes, nbytes, list(outside[part]))
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
