"""A lower bound on a pipeline's step before its submesh plan is made, so
that the stage search (``pipeline_search``) can search the (stages,
microbatches) pairs in the order of their bounds and skip those whose bound
is already no better than the fastest pipeline found: the search then
returns the plan the exhaustive one does, having made fewer submesh plans
(each a trace of its own microbatch and one to three ILPs).

The bound: a node's compute as the strategy table prices it
(``solve/strategies.py``: the roofline ``max(flops / rate, bytes /
bandwidth)`` of its local work plus its kernels' overheads) on a rank of a
submesh of ``S`` devices running one of ``M`` microbatches is at least its
compute on ONE device running the whole batch, divided by ``M * S``: a
microbatch has at least ``1 / M`` of the batch's FLOPs and bytes (they grow
with the batch, plus a part that does not: the weights'), and a rank at least
``1 / S`` of those; the overheads are paid in full. So the chunks' times of
one microbatch add up to at least ``W / (M S)`` (``W``: the one-device compute
of the whole batch over the chain's nodes, each block repeat counted), their
largest to at least their mean, and the schedule's latency
(``pipeline_partition.schedule_step_s``, non-decreasing in both) to at least
its value there; sends, collectives, recomputation, the tail and the tied
weights' sync only add to it."""

from __future__ import annotations

import numpy as np

from automap.planner.pipeline_mesh import StageMeshes
from automap.planner.pipeline_partition import schedule_step_s
from automap.sharding.mesh import DeviceMesh
from automap.solve.blocks import detect_blocks
from automap.solve.depth import instance_repeats
from automap.solve.memory import timeline
from automap.solve.strategies import build_strategy_table


def batch_work_s(traced, profile, device, optimizer: str | None, stacks=()) -> float:
    """``W``: the compute of ``traced`` (the whole batch) on one device as the
    strategy table prices it, over the computed nodes, a depth-reduced plan's
    last block counted for every block it stands for (``stacks``)."""
    table = build_strategy_table(traced, profile, DeviceMesh((1,)), device=device,
                                 optimizer=optimizer)
    repeats = instance_repeats(detect_blocks(traced), list(stacks)) if stacks else {}
    return sum(repeats.get(name, 1) * float(np.min(table.nodes[name].compute_s))
               for name in timeline(table).order)


def step_lower_bound_s(work_s: float, stages: StageMeshes, microbatches: int,
                       virtual: int = 1, shared_slowdown: float = 1.0) -> float:
    """The least step of ``stages`` running ``microbatches`` microbatches with
    up to ``virtual`` chunks per rank (the latency falls with more chunks), on
    a batch whose one-device compute is ``work_s`` (``batch_work_s``)."""
    n = stages.count
    total = work_s / (microbatches * stages.submesh.size)
    return schedule_step_s(total, total / (n * virtual), microbatches, virtual,
                           shared_slowdown, n)
