"""Repeated blocks of a traced graph (TAP's shared subgraphs), found by the
native core from module paths confirmed by a structural hash. The planner
ties the strategy variables of all instances of a class together, so the
ILP does not grow with depth."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from automap import _core


@dataclass
class BlockClass:
    container: str  # e.g. "transformer.h"
    instances: list[list[str]]  # node names; instances[k][j] corresponds to instances[0][j]

    def __len__(self) -> int:
        return len(self.instances)


def _shape_key(val) -> str:
    leaves = val if isinstance(val, (list, tuple)) else [val]
    return ";".join(f"{t.dtype}{list(t.shape)}" for t in leaves if isinstance(t, torch.Tensor))


def detect_blocks(traced) -> list[BlockClass]:
    """Classes of structurally identical block instances of a ``TracedGraph``."""
    names, keys, shape_keys, paths, inputs = [], [], [], [], []
    position: dict[str, int] = {}
    for node in traced.graph.nodes:
        if node.op not in ("placeholder", "call_function"):
            continue
        info = traced.nodes.get(node.name)
        position[node.name] = len(names)
        names.append(node.name)
        shape = _shape_key(node.meta.get("val"))
        # Parameters are keyed by shape only: their names differ per layer.
        keys.append(f"{'placeholder' if node.op == 'placeholder' else node.target}|{shape}")
        shape_keys.append(shape)
        paths.append(info.module_path if info is not None else "")
        inputs.append([position[a.name] for a in node.all_input_nodes if a.name in position])
    return [BlockClass(container, [[names[i] for i in inst] for inst in instances])
            for container, instances in _core.detect_blocks(keys, shape_keys, paths, inputs)]
