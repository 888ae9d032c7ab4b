"""Linearization of a traced graph into a chain of stages for activation
checkpointing (MAP section 5.2.2-5.2.4); the algorithm is in the native
core (rust/linearize.rs). This module says which nodes are placeholders,
non-differentiable (masks, ids, positions: they hold no stage open) or
in-place (they stay with their parent)."""

from __future__ import annotations

import torch

from automap import _core


def _differentiable(val) -> bool:
    leaves = val if isinstance(val, (list, tuple)) else [val]
    return any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in leaves)


def _inplace(node) -> bool:
    name = getattr(node.target, "__name__", "")
    return node.op == "call_function" and name.split(".")[0].endswith("_") and not name.startswith(
        "_")


def _trainable(traced, node) -> bool:
    """Among placeholders only trainable parameters carry gradients: data
    inputs, buffers (rotary frequencies, BatchNorm statistics) and constants
    seed the common nodes, like the attention mask in the paper."""
    state = traced.state_of(node.name)
    return state is not None and state.kind == "parameter" and state.requires_grad


def _carries_gradient(traced, node) -> bool:
    if node.op == "placeholder":
        return _trainable(traced, node)
    return _differentiable(node.meta.get("val"))


def linearize(traced) -> list[list[str]]:
    """The stages of a ``TracedGraph``: lists of node names in graph order
    (parameters and inputs belong to none)."""
    nodes = [n for n in traced.graph.nodes if n.op in ("placeholder", "call_function")]
    index = {n.name: i for i, n in enumerate(nodes)}
    stages = _core.linearize(
        [[index[p.name] for p in n.all_input_nodes if p.name in index] for n in nodes],
        [n.op == "placeholder" for n in nodes],
        [not _carries_gradient(traced, n) for n in nodes],
        [_inplace(n) for n in nodes],
    )
    return [[nodes[i].name for i in stage] for stage in stages]
