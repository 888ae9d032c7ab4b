"""The bytes each mesh axis carries in one training step of a plan: every
collective the plan runs (the nodes' partial-sum reductions and gradient
all-reduces, forward and backward, and every layout conversion's steps), each
by the algorithm that runs it (``DeviceMesh.collective_plan``: one flat ring,
or per-axis steps).

A step's bytes are what each device sends in it under the ring formulas
(``(n-1)/n`` of the buffer for an all-gather, reduce-scatter or all-to-all,
twice that for an all-reduce (and for a reduce-scatter on a backend that runs
it as one, gloo), the buffer for a broadcast; a sharded parameter's
gather carries its gradient's reduce-scatter back, ``automap.solve.fsdp``); a flat ring over
several axes crosses the links of each, so its bytes count on every one of
them. Depth-reduced plans count each traced block once."""

from __future__ import annotations

import math

from automap.planner.plan import Plan
from automap.sharding.layout import layout_path
from automap.sharding.spec import ShardingSpec
from automap.solve.fsdp import fused_gather
from automap.solve.gradient_buckets import CAST_OP
from automap.solve.shared_gradients import plan_readings, shared_gradients

_RING_SHARE = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0, "all_reduce": 2.0}


def _sent_bytes(kind: str, nbytes: float, n: int, as_all_reduce: bool = False) -> float:
    if n <= 1:
        return 0.0
    if kind == "broadcast":
        return nbytes
    if kind == "reduce_scatter" and as_all_reduce:
        kind = "all_reduce"
    return _RING_SHARE[kind] * (n - 1) / n * nbytes


def collective_bytes_per_axis(plan: Plan) -> list[float]:
    """Per mesh axis, the bytes one device sends over that axis's links in one
    training step of ``plan`` (see the module docstring)."""
    mesh = plan.mesh
    per_axis = [0.0] * mesh.ndim

    def carry(kind: str, nbytes: float, axes) -> None:
        for step in mesh.collective_plan(kind, nbytes, axes).steps:
            sent = _sent_bytes(step.kind, step.nbytes, math.prod(mesh.shape[a] for a in step.axes),
                               mesh.reduce_scatter_as_all_reduce)
            for a in step.axes:
                per_axis[a] += sent

    def local(full_bytes: float, spec: str) -> float:
        return full_bytes / ShardingSpec.parse(spec).shard_count(mesh)

    # Every tensor a node reads or writes is on an edge, with its global size.
    read = {(e.consumer, e.input_index): math.prod(e.shape) * e.dtype_bytes for e in plan.edges}
    written = {(e.producer, e.output_index): math.prod(e.shape) * e.dtype_bytes
               for e in plan.edges}
    # Readers after the first of a shared gradient all-reduce run none of their own.
    shares = shared_gradients(plan_readings(plan), lambda spec: ShardingSpec.parse(spec)
                              .shard_count(mesh))
    sharing = {reader for group in shares for reader in group.readers[1:]}
    # Parameter reads the generator gathers by gather_shard (automap.solve.fsdp):
    # (consumer, input) -> the gradient axes, and the gather's steps.
    fused, fused_paths = {}, {}
    for e in plan.edges:
        if plan.nodes[e.producer].kind != "parameter":
            continue
        grads = plan.nodes[e.consumer].grad_reduce_axes
        axes = grads[e.input_index] if e.input_index < len(grads) else []
        path = fused_gather(mesh, e.src, e.dst, e.shape, e.dtype_bytes, axes)
        if path is not None:
            fused[(e.consumer, e.input_index)] = tuple(axes)
            fused_paths[(e.consumer, e.input_index)] = path.steps
    bucket_scale = _bucketed_cast_reads(plan)
    for node in plan.nodes.values():
        partial = node.partial_axes
        for o, spec in enumerate(node.outputs):
            if not partial or (node.name, o) not in written:
                continue
            if node.scatter_dim is None:
                carry("all_reduce", local(written[(node.name, o)], spec), partial)
            else:
                # Reduce-scattered (its spec has the partial axes): the input was whole along them.
                before = local(written[(node.name, o)], spec) * math.prod(
                    mesh.shape[a] for a in partial)
                carry("reduce_scatter", before, partial)
                carry("all_gather", before, partial)  # its dual, in the backward
        for i, axes in enumerate(node.grad_reduce_axes):
            if axes and (node.name, i) in read and (node.name, i) not in sharing \
                    and (node.name, i) not in fused:
                carry("all_reduce", local(read[(node.name, i)], node.inputs[i])
                      * bucket_scale.get((node.name, i), 1.0), axes)
    for e in plan.edges:
        if not e.steps:
            continue
        total = math.prod(e.shape) * e.dtype_bytes
        grad_axes = fused.get((e.consumer, e.input_index), ())
        if grad_axes:  # the gathered axes' gradient reduce-scattered, the rest all-reduced
            rest = [a for a in grad_axes if a not in {step.axis for step in
                                                      fused_paths[(e.consumer, e.input_index)]}]
            if rest:
                carry("all_reduce", local(total, e.src), rest)
        for step in layout_path(mesh, e.src, e.dst, e.shape, e.dtype_bytes).steps:
            n = mesh.shape[step.axis]
            before = total / step.before.shard_count(mesh)
            if step.kind == "all_gather" and step.axis in grad_axes:  # and its reduce-scatter
                per_axis[step.axis] += (_sent_bytes("all_gather", before * n, n) + _sent_bytes(
                    "reduce_scatter", before * n, n, mesh.reduce_scatter_as_all_reduce))
            elif step.kind == "all_gather":  # forward gather (the backward split is local)
                per_axis[step.axis] += _sent_bytes("all_gather", before * n, n)
            elif step.kind == "shard":  # backward gather of the gradient
                per_axis[step.axis] += _sent_bytes("all_gather", before, n)
            else:  # forward and backward exchange
                per_axis[step.axis] += 2 * _sent_bytes("all_to_all", before, n)
    return per_axis



def _bucketed_cast_reads(plan: Plan) -> dict[tuple[str, int], float]:
    """(consumer, input) -> bytes scale of the gradient reads the generator
    buckets through mixed precision's cast of a parameter (every reader of the
    cast reads it as produced and reduces over the same axes, the cast reads
    the parameter as stored): the bucket all-reduces the parameter's gradient
    in ``reduce_dtype``, not the cast's output gradient."""
    if plan.mixed_precision is None:
        return {}
    reduce_bytes = plan.mixed_precision.reduce_dtype.itemsize
    into = {(e.consumer, e.input_index): e for e in plan.edges}
    readers: dict[str, list] = {}
    for e in plan.edges:
        readers.setdefault(e.producer, []).append(e)
    out = {}
    for name, node in plan.nodes.items():
        feed = into.get((name, 0))
        if node.op != CAST_OP or feed is None or feed.src != feed.dst \
                or plan.nodes[feed.producer].kind != "parameter":
            continue
        reads = readers.get(name, [])
        axes = {tuple(plan.nodes[e.consumer].grad_reduce_axes[e.input_index])
                if e.src == e.dst and e.input_index < len(plan.nodes[e.consumer].grad_reduce_axes)
                else None for e in reads}
        if len(axes) != 1 or None in axes or () in axes:
            continue
        for e in reads:
            out[(e.consumer, e.input_index)] = reduce_bytes / e.dtype_bytes
    return out
