"""Reshape localisation and global divisors: ops whose arguments or results
depend on the global shape, rewritten for this rank's shards.

- view/reshape/expand/unflatten sizes become the local shard sizes of the
  node's planned output spec;
- a mean whose reduced dims are split becomes a sum divided by the GLOBAL count,
  so the shards' partial sums add up to the serial mean;
- a mean-reduced cross-entropy/NLL over a split batch becomes a sum divided by
  the global number (or class-weight sum) of targets not ignored;
- an embedding whose table rows are split looks up only its own vocab range.
"""

from __future__ import annotations

import math

import torch
from torch import fx

from automap.generate.ops import loss_denominator, vocab_parallel_embedding
from automap.sharding.spec import ShardingSpec

_SIZE_ARG_OPS = {"view", "reshape", "_unsafe_view", "expand"}
_MEAN_REDUCTION, _SUM_REDUCTION = 1, 2
#: Position of (weight, reduction, ignore_index) in each loss op's arguments.
_LOSS_ARGS = dict.fromkeys(("cross_entropy_loss", "nll_loss", "nll_loss_nd"), (2, 3, 4))
_LOSS_DEFAULTS = (None, _MEAN_REDUCTION, -100)


def global_shape(node: fx.Node) -> list[int]:
    return [int(s) for s in node.meta["val"].shape]


def local_sizes(family: str, args: tuple, node: fx.Node, out_spec: str, mesh) -> tuple:
    """``args`` with the size arguments of a view-like op set to the local shard sizes."""
    spec = ShardingSpec.parse(out_spec)
    if spec.is_replicated or (family not in _SIZE_ARG_OPS and family != "unflatten"):
        return args
    local = [int(s) for s in spec.local_shape(global_shape(node), mesh)]
    if family in _SIZE_ARG_OPS:
        return (args[0], local, *args[2:])
    dim = args[1] + len(local) - len(args[2]) + 1 if args[1] < 0 else args[1]
    return (args[0], args[1], local[dim:dim + len(args[2])], *args[3:])


def mean_as_partial_sum(em, node: fx.Node, args: tuple, kwargs: dict) -> fx.Node:
    """mean(x, dims) over split dims: sum(x, dims) / (global count of reduced elements)."""
    shape = global_shape(node.args[0])
    dims = args[1] if len(args) > 1 and args[1] is not None else kwargs.get("dim")
    if dims is None or dims == []:
        count = math.prod(shape)
        total = em.call(torch.ops.aten.sum.default, args[0], **_dtype_kwarg(kwargs))
    else:
        dims = [dims] if isinstance(dims, int) else list(dims)
        count = math.prod(shape[d] for d in dims)
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        total = em.call(torch.ops.aten.sum.dim_IntList, args[0], dims, keepdim,
                        **_dtype_kwarg(kwargs))
    return em.call(torch.ops.aten.div.Scalar, total, float(count))


def _dtype_kwarg(kwargs: dict) -> dict:
    return {"dtype": kwargs["dtype"]} if kwargs.get("dtype") is not None else {}


def is_mean_loss(family: str, args: tuple, kwargs: dict) -> bool:
    if family not in _LOSS_ARGS:
        return False
    return _loss_arg(family, args, kwargs, 1) == _MEAN_REDUCTION


def _loss_arg(family: str, args: tuple, kwargs: dict, which: int):
    position = _LOSS_ARGS[family][which]
    name = ("weight", "reduction", "ignore_index")[which]
    if len(args) > position:
        return args[position]
    return kwargs.get(name, _LOSS_DEFAULTS[which])


def loss_as_partial_sum(em, target_op, family: str, args: tuple, kwargs: dict,
                        partial_axes) -> fx.Node:
    """A mean-reduced loss over a split batch: this rank's sum over its targets
    divided by the global count (or weight sum) of targets not ignored."""
    weight, _, ignore_index = (_loss_arg(family, args, kwargs, i) for i in range(3))
    # Positional from here on: (input, target, weight, reduction, ignore_index, ...).
    rest = list(args[5:])
    kwargs = {k: v for k, v in kwargs.items()
              if k not in ("weight", "reduction", "ignore_index")}
    args = [args[0], args[1], weight, _SUM_REDUCTION, ignore_index, *rest]
    total = em.call(target_op, *args, **kwargs)
    denominator = em.call(loss_denominator, args[1], weight, ignore_index,
                          em.group(partial_axes))
    return em.call(torch.ops.aten.div.Tensor, total, denominator)


def vocab_parallel(em, args: tuple, kwargs: dict, weight_spec: str, weight_node: fx.Node,
                   rank: int) -> fx.Node:
    """An embedding lookup into this rank's rows of a table split on dim 0."""
    bounds = ShardingSpec.parse(weight_spec).local_slices(global_shape(weight_node), em.mesh,
                                                          rank)
    start, end = (int(b) for b in bounds[0])
    padding_idx = args[2] if len(args) > 2 else kwargs.get("padding_idx", -1)
    return em.call(vocab_parallel_embedding, args[0], args[1], start, end, int(padding_idx))
