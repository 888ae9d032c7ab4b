"""The reduction stage before the ILP: which nodes decide their own strategy
(roots) and how every other node's strategy follows from its root's.

The ILP (``automap.solve.ilp``) gets one set of binaries per root; a node
``v`` of root ``r`` takes strategy ``index[v][j]`` when ``r`` takes ``j``,
which is also the map from the reduced problem's solution back to a full
one. Three rules shrink the problem:

- Tied block instances (TAP) take their first instance's strategy
  (``tie_map``): the problem does not grow with depth.
- A single-input node follows its producer (Alpa's merging): it reads the
  producer's output as it is.
- With ``reduce_formulation``, a node of several inputs (elementwise ops:
  residual adds, mask ands, gates) follows the producer of one input in the
  same way, where that producer reads no parameter. The edges between two
  such nodes (GPT-2 small on (2,2,2): 106 x 106 spec pairs each) were most
  of the ILP's edge variables: 210 k down to 105 k, binaries 3 845 down to
  3 028, the plans at 1.0x, 0.5x and 0.3x budgets unchanged. A producer that reads a
  parameter (an embedding, a matmul) is not followed: its output is where
  a plan may change layout (GPT-2's first add converts the embedding's
  output to a batch split; following it cost 0.26 % of step time).

Every rule is a restriction of the choice, never a change of what a choice
costs: the ILP prices each node and edge, memory rows included, from the
full strategy table, so a reduced plan's time and memory are exact for that
plan. Merging followers is off with ``merge_followers=False`` (the exact ILP
over every node's strategies). The multi-input rule is off by default
(``reduce_formulation=False``): a residual stream that follows one producer
cannot change layout to save memory, so tight budgets lose plans (GPT-2
small on (4,4,4) at 0.5x: no plan where the formulation before it found one;
at 1.0x a plan 5 % slower; GPT-2 on (2,2) at 0.6x without checkpointing:
no plan).

Measured and left out: strategies dominated by another with the same specs
on every edge of the group (no better in time or any memory column) are
15 of GPT-2's 3 845, not worth a pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from automap.solve.strategies import StrategyTable


@dataclass
class Groups:
    """``root[v]``: the node whose binaries decide ``v``; ``index[v][j]``:
    ``v``'s strategy when its root takes strategy ``j``; ``members[r]``: the
    nodes root ``r`` decides, in table order."""

    root: dict[str, str]
    index: dict[str, np.ndarray]
    members: dict[str, list[str]]


def tie_map(table: StrategyTable, blocks) -> dict[str, str]:
    """Node of a later block instance -> the corresponding node of the first,
    where both have the same strategies (same shapes, same signature)."""
    tie: dict[str, str] = {}
    for block in blocks:
        first = block.instances[0]
        for instance in block.instances[1:]:
            for rep, name in zip(first, instance):
                a, b = table.nodes.get(rep), table.nodes.get(name)
                if (a is not None and b is not None and a.in_specs == b.in_specs
                        and a.out_specs == b.out_specs):
                    tie[name] = rep
    return tie


def groups(table: StrategyTable, *, merge_followers: bool = True, blocks=None,
           reduce_formulation: bool = False) -> Groups:
    """Each node's root and, per strategy of the root, the node's strategy
    (see the module's rules)."""
    tie = tie_map(table, blocks or [])
    nodes = table.nodes
    root: dict[str, str] = {}
    index: dict[str, np.ndarray] = {}
    for name, node in nodes.items():
        root[name], index[name] = name, np.arange(len(node))
        rep = tie.get(name)
        if rep is not None:
            root[name], index[name] = root[rep], index[rep]
            continue
        if (not merge_followers or len(node) < 2 or not node.inputs
                or node.kind not in ("einsum", "view")):
            continue
        if len(node.inputs) == 1:
            candidates = [0]
        elif reduce_formulation:
            candidates = [k for k, (producer, _) in enumerate(node.inputs)
                          if not _reads_parameter(table, producer)]
        else:
            candidates = []
        for k in candidates:
            follows = _follow(table, node, k, index)
            if follows is not None:
                producer = node.inputs[k][0]
                root[name], index[name] = root[producer], follows
                break
    members: dict[str, list[str]] = {}
    for name in nodes:
        members.setdefault(root[name], []).append(name)
    return Groups(root, index, members)


def _follow(table: StrategyTable, node, k: int, index: dict[str, np.ndarray]):
    """Per strategy of input ``k``'s producer's root, the strategy of
    ``node`` that reads that input as produced; None where the node's
    strategies do not differ by that input's spec alone or some produced
    spec has no strategy reading it."""
    producer, o = node.inputs[k]
    by_spec: dict[str, int] = {}
    for t, specs in enumerate(node.in_specs):
        if specs[k] in by_spec:
            return None
        by_spec[specs[k]] = t
    produced = [table.nodes[producer].out_specs[i][o] for i in index[producer]]
    if not all(spec in by_spec for spec in produced):
        return None
    return np.array([by_spec[spec] for spec in produced])


def _reads_parameter(table: StrategyTable, name: str) -> bool:
    return any(table.nodes[q].kind == "parameter" for q, _ in table.nodes[name].inputs)
