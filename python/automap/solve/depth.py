"""Depth-reduced planning: a model that stacks L identical blocks is traced
with only ``keep`` of them, and the planner weights what it sees by how
often it occurs in the real model: a block's nodes and inner edges L/keep
times, the edges from one block into the next (L-1)/(keep-1) times. With
the blocks' variables tied, tracing, profiling and solving no longer grow
with depth. The user's model is restored on exit."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Stack:
    path: str  # e.g. "transformer.h"
    depth: int  # blocks in the real model
    kept: int  # blocks traced


def _same_structure(modules) -> bool:
    first = modules[0]
    shapes = [(k, tuple(v.shape)) for k, v in first.state_dict(keep_vars=True).items()]
    return all(
        type(m) is type(first)
        and [(k, tuple(v.shape)) for k, v in m.state_dict(keep_vars=True).items()] == shapes
        for m in modules[1:]
    )


def repeated_stacks(model: nn.Module, min_depth: int = 3) -> list[tuple[str, nn.ModuleList]]:
    """ModuleLists of at least ``min_depth`` blocks of one type and shape."""
    found = []
    for path, module in model.named_modules():
        if (isinstance(module, nn.ModuleList) and len(module) >= min_depth
                and not any(path.startswith(p + ".") for p, _ in found)
                and _same_structure(list(module))):
            found.append((path, module))
    return found


@contextlib.contextmanager
def reduced_depth(model: nn.Module, keep: int = 2):
    """Within the block, every repeated stack of ``model`` holds only its
    first ``keep`` blocks; yields the ``Stack``s that were cut."""
    cut: list[tuple[nn.Module, str, nn.ModuleList, Stack]] = []
    try:
        for path, stack in repeated_stacks(model, min_depth=keep + 1):
            parent_path, _, name = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            setattr(parent, name, nn.ModuleList(list(stack)[:keep]))
            cut.append((parent, name, stack, Stack(path, len(stack), keep)))
        yield [c[3] for c in cut]
    finally:
        for parent, name, stack, _ in reversed(cut):
            setattr(parent, name, stack)


def multiplicities(blocks, stacks: list[Stack], edges):
    """Node and edge weights for the ILP: ``blocks`` from ``detect_blocks`` on
    the reduced graph, ``edges`` as (producer, output, consumer, input)."""
    by_path = {s.path: s for s in stacks}
    where: dict[str, tuple[int, int, Stack]] = {}  # node -> (class, instance, stack)
    for c, block in enumerate(blocks):
        stack = by_path.get(block.container)
        if stack is None:
            continue
        for i, instance in enumerate(block.instances):
            for name in instance:
                where[name] = (c, i, stack)
    node_weight = {name: s.depth / s.kept for name, (_, _, s) in where.items()}
    # Instances of each class that a tensor from outside the class feeds.
    feeds: dict[tuple, set] = {}
    for producer, o, consumer, _ in edges:
        into = where.get(consumer)
        came = where.get(producer)
        if into is not None and (came is None or came[0] != into[0]):
            feeds.setdefault((producer, o, into[0]), set()).add(into[1])
    edge_weight = {}
    for edge in edges:
        producer, o, consumer, _ = edge
        into = where.get(consumer)
        if into is None:
            continue
        c, i, s = into
        came = where.get(producer)
        if came is not None and came[0] == c and came[1] == i - 1:
            edge_weight[edge] = (s.depth - 1) / (s.kept - 1)  # block to next block
        elif came is None or came[0] != c:
            # From outside: into every block (a mask), or only into the first
            # (the stream entering the stack), once.
            every = len(feeds[(producer, o, c)]) == s.kept
            edge_weight[edge] = s.depth / s.kept if every else 1.0
        else:
            edge_weight[edge] = s.depth / s.kept
    return node_weight, edge_weight


def instance_repeats(blocks, stacks: list[Stack]) -> dict[str, int]:
    """Per node of a cut stack's traced blocks: how many real blocks its
    instance stands for, in order (the last traced block repeats for all the
    blocks that were cut); for rebuilding the real depth of a chain."""
    by_path = {s.path: s for s in stacks}
    repeats: dict[str, int] = {}
    for block in blocks:
        stack = by_path.get(block.container)
        if stack is None:
            continue
        for i, instance in enumerate(block.instances):
            times = stack.depth - stack.kept + 1 if i == len(block.instances) - 1 else 1
            for name in instance:
                repeats[name] = times
    return repeats
