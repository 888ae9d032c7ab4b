"""Cutting one rank's generated program into pipeline stages (issue 18).

The program is generated whole (``build.generate_graph``, for one microbatch on
the stage's submesh), then cut: every generated node carries the traced node it
was emitted for (``meta["automap_origin"]``), so it belongs to the stage whose
node range holds that traced node. Conversions and gradient wraps a consumer
reads are emitted for the consumer, so they run in the consumer's stage, and a
value crossing a boundary is sent in its producer's spec (a spec means the same
on every stage's equal submesh; stages running different intra-op plans,
``planner/pipeline_merge.py``, convert it in the consumer's stage).

Free nodes are attribute reads (state shards, process groups) and the
conversions of state that depend on nothing else (a parameter read in another
spec than it is stored in): every stage that needs one gets its own copy, so a
weight read by two stages (GPT-2's tied embedding and LM head) is held by both.
User inputs belong to stage 0 (the schedule feeds them there); a value defined
in stage ``j`` and read in stage ``k > j + 1`` is forwarded through every stage
between (targets reach the loss in the last stage this way)."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from automap.errors import AutomapError, InvalidPlanError
from automap.generate.build import GeneratedGraph
from automap.generate.checkpoint import ORIGIN
from automap.generate.state import StateShard

#: The stage of a free node (copied into every stage that reads it).
FREE = -1


@dataclass
class StageCut:
    """Where every generated node of a rank's program runs."""

    graph: fx.Graph
    stage_count: int
    stage_of: dict[fx.Node, int]  # FREE for attribute reads and state conversions
    #: Per boundary ``k`` (between stage ``k - 1`` and ``k``; 1..n-1): the values
    #: sent across it, in graph order.
    boundaries: dict[int, list[fx.Node]] = field(default_factory=dict)
    #: Per stage: the attribute names (state shards, groups) its part reads.
    attrs_read: list[set[str]] = field(default_factory=list)


def traced_stage_of(traced, stages) -> dict[str, int]:
    """Traced node name -> stage index, from each stage's ``first_node`` ..
    ``last_node`` (computed nodes: the graph's op calls, in graph order; attribute
    reads belong to no stage). The ranges must be contiguous, in order and cover
    every node; a depth-reduced plan's stages (``first_repeat``), which stand
    for blocks the graph does not have, are refused."""
    computed = [n.name for n in traced.graph.nodes if n.op == "call_function"]
    position = {name: i for i, name in enumerate(computed)}
    out: dict[str, int] = {}
    expected_first = 0
    for k, stage in enumerate(stages):
        if getattr(stage, "first_repeat", 0) or getattr(stage, "last_repeat", 0):
            raise InvalidPlanError(f"pipeline stage {k} starts or ends inside a repeated block "
                                   "of a depth-reduced plan, which is for estimates only; "
                                   "plan without reduce_depth to run it")
        for end in (stage.first_node, stage.last_node):
            if end not in position:
                raise InvalidPlanError(f"pipeline stage {k} names node {end!r}, which is not "
                                       "a computed node of the traced graph")
        lo, hi = position[stage.first_node], position[stage.last_node]
        if lo != expected_first or hi < lo:
            raise InvalidPlanError(
                f"pipeline stage {k} covers {stage.first_node}..{stage.last_node} (nodes "
                f"{lo}..{hi}); stages must cover the graph's computed nodes in order without "
                f"gaps (expected it to start at node {expected_first})")
        for name in computed[lo:hi + 1]:
            out[name] = k
        expected_first = hi + 1
    if expected_first != len(computed):
        raise InvalidPlanError(f"the pipeline stages end at node {expected_first - 1} but the "
                               f"graph has {len(computed)} computed nodes")
    return out


def cut(out: GeneratedGraph, traced, stages) -> StageCut:
    """Assign every node of the generated graph ``out`` to a stage (or FREE)."""
    n = len(stages)
    by_origin = traced_stage_of(traced, stages)
    stage_of: dict[fx.Node, int] = {}
    for node in out.graph.nodes:
        inputs = [stage_of[a] for a in node.all_input_nodes]
        latest = max([s for s in inputs if s != FREE], default=FREE)
        origin = node.meta.get(ORIGIN)
        if node.op == "get_attr":
            s = FREE
        elif node.op == "placeholder":
            s = 0
        elif node.op == "output":
            s = n - 1
        elif node.target is operator.getitem and inputs and inputs[0] != FREE \
                and not isinstance(node.args[0].meta.get("val", None), torch.Tensor):
            s = inputs[0]  # an item of a multi-output op runs where the op ran
        elif origin in by_origin:
            s = by_origin[origin]
        elif latest == FREE and traced.state_of(str(origin)) is not None:
            s = FREE  # a state shard read in another spec: each reader converts it
        else:
            s = n - 1 if latest == FREE else latest  # graph outputs, buffer writes
        if s != FREE and latest > s:
            raise AutomapError(
                f"pipeline cut: {node.name} (for traced node {origin}) runs in stage {s} but "
                f"reads a value of stage {latest}; stage boundaries must follow graph order")
        stage_of[node] = s
    result = StageCut(out.graph, n, stage_of)
    last_use: dict[fx.Node, int] = {}
    needed: list[set[fx.Node]] = [set() for _ in range(n)]  # free nodes per stage
    for node in reversed(out.graph.nodes):
        s = stage_of[node]
        for a in node.all_input_nodes:
            if s == FREE:
                continue
            if stage_of[a] == FREE:
                needed[s].add(a)
            else:
                last_use[a] = max(last_use.get(a, s), s)
        if s == FREE:
            readers = [k for k in range(n) if node in needed[k]]
            for a in node.all_input_nodes:
                for k in readers:
                    needed[k].add(a)
    for k in range(1, n):
        result.boundaries[k] = [v for v in out.graph.nodes
                                if stage_of[v] != FREE and stage_of[v] < k
                                and last_use.get(v, -1) >= k]
    result.attrs_read = [{a.target for a in needed[k] if a.op == "get_attr"} for k in range(n)]
    return result


def stage_graph(out: GeneratedGraph, stage_cut: StageCut, k: int) -> GeneratedGraph:
    """Stage ``k``'s part of ``out`` as a graph of its own: placeholders for the
    values it receives (stage 0: the user inputs, in order), its nodes and the
    free nodes they read, and an output of the values it sends on (the last
    stage: the loss alone)."""
    n, stage_of = stage_cut.stage_count, stage_cut.stage_of
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    received = [v for v in out.graph.nodes if v.op == "placeholder"] if k == 0 \
        else stage_cut.boundaries[k]
    for v in received:
        env[v] = graph.placeholder(v.name)
        env[v].meta = dict(v.meta)
    wanted = _free_nodes_of(stage_cut, k)
    output_node = None
    for node in out.graph.nodes:
        s = stage_of[node]
        if node.op == "output":
            output_node = node
            continue
        if node in env or not (s == k or (s == FREE and node in wanted)):
            continue
        env[node] = graph.node_copy(node, lambda a: env[a])
    if k == n - 1:
        (results,) = output_node.args
        if len(results) != 1:
            raise AutomapError(f"a pipelined graph must return the loss alone; this one "
                               f"returns {len(results)} values")
        graph.output(env[results[0]])
    else:
        graph.output(tuple(env[v] for v in stage_cut.boundaries[k + 1]))
    graph.lint()
    read = {node.target for node in graph.nodes if node.op == "get_attr"}
    shards = {name: shard for name, shard in out.shards.items() if name in read}
    attrs = {name: obj for name, obj in out.attrs.items() if name in read}
    return GeneratedGraph(graph, attrs, shards)


def _free_nodes_of(stage_cut: StageCut, k: int) -> set[fx.Node]:
    """The free nodes stage ``k`` reads, directly or through other free nodes."""
    stage_of = stage_cut.stage_of
    wanted: set[fx.Node] = set()
    stack = [a for node, s in stage_of.items() if s == k for a in node.all_input_nodes
             if stage_of[a] == FREE]
    while stack:
        node = stack.pop()
        if node not in wanted:
            wanted.add(node)
            stack.extend(a for a in node.all_input_nodes if stage_of[a] == FREE)
    return wanted


def shared_parameters(stage_cut: StageCut, shards: dict[str, StateShard]
                      ) -> dict[str, tuple[int, ...]]:
    """Parameters that several stages hold (tied weights read in two stages):
    name -> the stages, ascending."""
    out = {}
    for name, shard in shards.items():
        if shard.kind != "parameter":
            continue
        readers = tuple(k for k, read in enumerate(stage_cut.attrs_read) if name in read)
        if len(readers) > 1:
            out[name] = readers
    return out
