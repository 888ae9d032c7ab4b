"""Sharded data parallelism (FSDP / ZeRO-3) as a layout choice of a parameter.

A parameter stored split over mesh axes that also split the batch (its
placeholder's spec names them) and read whole by its consumer is gathered in
the forward; the consumer's gradient for it is partial over those axes. The
generator then runs one fused op per gather step (``gather_shard``: forward
all-gather, backward reduce-scatter straight into the shard) instead of the
conversion (whose backward keeps the own shard) plus the consumer's all-reduce
of the whole gradient: the same forward, and in the backward a reduce-scatter
where an all-reduce and a split ran (half the bytes on a ring). Gradient axes
the path does not gather are all-reduced on the shard.

This module says when the rule applies (``fused_gather``) and what it saves
(``fused_backward_delta_s``, which the step-time prediction adds to the
conversion's backward, and ``planner/traffic.py`` counts as it runs).

The ILP keeps the conservative price (the conversion plus the consumer's
all-reduce of the whole gradient, one all-gather more than runs): its linear
proxy counts data parallelism's bucketed all-reduces in full although they
overlap the backward, while these collectives run inline. Priced exactly,
sharding won the proxy where it lost the overlapped step: a GPT-2 block on
(1,4) with slow links, no budget, planned 13 % slower (15.7 ms against data
parallelism's 13.9 ms predicted)."""

from __future__ import annotations

import numpy as np

from automap.sharding.layout import layout_path


def fused_gather(mesh, src: str, dst: str, shape, dtype_bytes: int, grad_axes):
    """The layout path of a parameter edge ``src -> dst`` when the generator
    fuses it with the consumer's gradient reduction over ``grad_axes``: every
    step an all-gather and at least one over an axis of ``grad_axes``; else None."""
    if src == dst or not grad_axes:
        return None
    path = layout_path(mesh, src, dst, list(shape), dtype_bytes)
    if not path.steps or any(step.kind != "all_gather" for step in path.steps):
        return None
    if not any(step.axis in grad_axes for step in path.steps):
        return None
    return path


def fused_backward_delta_s(mesh, src: str, dst: str, shape, dtype_bytes: int,
                           grad_axes) -> float:
    """Backward seconds the fused form saves (negative) or adds against the
    priced conversion (``path.backward_cost_s``) plus the consumer's all-reduce
    of the whole gradient over ``grad_axes`` (its strategy's price); 0 where
    the rule does not apply."""
    path = fused_gather(mesh, src, dst, shape, dtype_bytes, grad_axes)
    if path is None:
        return 0.0
    full = float(np.prod(shape)) * dtype_bytes
    fused = 0.0
    gathered = set()
    for step in path.steps:
        if step.axis in grad_axes:
            gathered.add(step.axis)
            fused += mesh.reduce_scatter_cost_s(full / step.after.shard_count(mesh),
                                                (step.axis,))
        else:
            fused += step.backward_cost_s
    rest = tuple(a for a in grad_axes if a not in gathered)
    if rest:
        fused += mesh.all_reduce_cost_s(full / path.src.shard_count(mesh), rest)
    replaced = path.backward_cost_s + mesh.all_reduce_cost_s(
        full / path.dst.shard_count(mesh), tuple(grad_axes))
    return fused - replaced


def parameter_grad_axes(table, producer: str, consumer: str, k: int, strategies):
    """Per consumer strategy in ``strategies``, the mesh axes its gradient for
    input ``k`` (read from parameter ``producer``) is reduced over; None where
    ``producer`` is no trainable parameter or the consumer reduces nothing."""
    node, source = table.nodes[consumer], table.nodes[producer]
    if source.kind != "parameter" or not source.grad_bytes.any() and source.tied_to is None \
            or node.reductions is None:
        return None
    out = []
    for i in strategies:
        grads = node.reductions[i][2]
        out.append(tuple(grads[k]) if k < len(grads) else ())
    return out if any(out) else None
