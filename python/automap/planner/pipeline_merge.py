"""One plan whose stages run intra-op plans of their own (issue 18): each
stage's nodes take their strategies from the submesh plan chosen for that
stage, and every edge's conversion is planned again between the specs its
ends now have.

Every stage runs on an equal submesh, so a spec means the same on each; the
runtime sends a value across a cut in its producer's spec, and the conversion
into the consumer's spec runs in the consumer's stage
(``generate/pipeline_split.py``), as for any edge of one plan. A parameter or
input takes the spec of the plan of the stage that reads it first (a weight
read by two stages, GPT-2's tied embedding, is converted where the other
stage's plan reads it otherwise)."""

from __future__ import annotations

import dataclasses

from automap.planner.plan import EdgePlan, Plan
from automap.sharding.layout import layout_path


def stage_of_nodes(plan: Plan, computed: list[str], firsts: list[str]) -> dict[str, int]:
    """Node name -> stage: computed nodes (graph order, ``computed``) by the
    stage whose first node (``firsts``, in order) they follow; every other node
    of ``plan`` by the stage of its first consumer (the last stage if none)."""
    starts = {name: k for k, name in enumerate(firsts)}
    stage_of, k = {}, 0
    for name in computed:
        k = starts.get(name, k)
        stage_of[name] = k
    last = len(firsts) - 1
    for edge in plan.edges:
        if edge.producer not in stage_of and edge.consumer in stage_of:
            stage_of.setdefault(edge.producer, last)
            stage_of[edge.producer] = min(stage_of[edge.producer], stage_of[edge.consumer])
    for name in plan.nodes:
        stage_of.setdefault(name, last)
    return stage_of


def merged_plan(per_stage: list[Plan], stage_of: dict[str, int]) -> Plan:
    """The plan whose node ``name`` is ``per_stage[stage_of[name]]``'s (the
    plans made for one traced graph on one submesh), edges planned again;
    everything else (mesh, prices, record) from ``per_stage[0]``, to be
    replaced by the caller."""
    base = per_stage[0]
    if len({id(p) for p in per_stage}) == 1:
        return base
    nodes = {name: per_stage[stage_of[name]].nodes[name] for name in base.nodes}
    edges = []
    for e in base.edges:
        src = nodes[e.producer].outputs[e.output_index]
        dst = nodes[e.consumer].inputs[e.input_index]
        if (src, dst) == (e.src, e.dst):
            edges.append(e)
            continue
        path = layout_path(base.mesh, src, dst, tuple(e.shape), e.dtype_bytes)
        edges.append(EdgePlan(e.producer, e.output_index, e.consumer, e.input_index, src, dst,
                              list(e.shape), e.dtype_bytes, [repr(s) for s in path.steps],
                              path.cost_s))
    return dataclasses.replace(base, nodes=nodes, edges=edges)
