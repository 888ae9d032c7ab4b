"""Communication pass: the layout conversion of every edge (the plan's cached
layout path, replayed as named autograd collectives) and the collectives a node
runs itself (all-reduce or reduce-scatter of partial outputs, the backward
all-reduce of partial input gradients)."""

from __future__ import annotations

from torch import fx

from automap.sharding.collectives import (
    all_gather_dim,
    all_reduce_sum,
    all_to_all_dims,
    identity_all_reduce_grad,
    reduce_scatter_dim,
    split_dim,
)
from automap.sharding.layout import layout_path


class Emitter:
    """Appends nodes to a new graph; owns the ``group_*`` attributes (one per set
    of mesh axes) the collectives take."""

    def __init__(self, graph: fx.Graph, groups, attrs: dict) -> None:
        self.graph = graph
        self.groups = groups
        self.mesh = groups.mesh
        self.attrs = attrs
        self._group_nodes: dict[tuple[int, ...], fx.Node] = {}

    def call(self, target, *args, name: str | None = None, **kwargs) -> fx.Node:
        return self.graph.create_node("call_function", target, tuple(args), kwargs, name=name)

    def group(self, axes) -> fx.Node:
        """The get_attr node of this rank's group along ``axes`` (in that order)."""
        axes = tuple(int(a) for a in axes)
        node = self._group_nodes.get(axes)
        if node is None:
            attr = "group_" + "_".join(str(a) for a in axes)
            self.attrs[attr] = self.groups.axis_group(axes)
            node = self.graph.get_attr(attr)  # at its first use; later uses follow it
            self._group_nodes[axes] = node
        return node

    def convert(self, x: fx.Node, src: str, dst: str, shape, dtype_bytes: int) -> fx.Node:
        """``x`` (this rank's shard under ``src``) as its shard under ``dst``."""
        if src == dst:
            return x
        for step in layout_path(self.mesh, src, dst, list(shape), dtype_bytes).steps:
            g = self.group((step.axis,))
            if step.kind == "all_gather":
                x = self.call(all_gather_dim, x, step.dim, g)
            elif step.kind == "shard":
                x = self.call(split_dim, x, step.dim, g)
            else:
                x = self.call(all_to_all_dims, x, step.dim, step.to_dim, g)
        return x

    def reduce_grad(self, x: fx.Node, axes) -> fx.Node:
        """Identity whose backward all-reduces the gradient over ``axes``."""
        return self.call(identity_all_reduce_grad, x, self.group(axes)) if axes else x

    def reduce_partial(self, x: fx.Node, axes, scatter_dim: int | None) -> fx.Node:
        """Make partial sums over ``axes`` whole: all-reduce, or reduce-scatter onto
        ``scatter_dim`` (the shard index along ``axes`` follows the spec's order)."""
        if not axes:
            return x
        if scatter_dim is None:
            return self.call(all_reduce_sum, x, self.group(axes))
        return self.call(reduce_scatter_dim, x, scatter_dim, self.group(axes))

