"""Reshape localisation and global divisors: ops whose arguments or results
depend on the global shape, rewritten for this rank's shards.

- view/reshape/expand/unflatten sizes become the local shard sizes of the
  node's planned output spec;
- a mean whose reduced dims are split becomes a sum divided by the GLOBAL count,
  so the shards' partial sums add up to the serial mean;
- a mean-reduced cross-entropy/NLL over a split batch becomes a sum divided by
  the global number (or class-weight sum) of targets not ignored;
- an embedding whose table rows are split looks up only its own vocab range;
- softmax, log_softmax, logsumexp and cross-entropy whose class dim is split
  take a max and a sum over the shards (Megatron-LM's vocab-parallel loss);
- a grouped matmul whose experts are split computes its experts' rows;
- random ops on a split tensor draw the whole tensor and keep their block, so
  that every rank draws what the serial model draws (ARCHITECTURE.md, "Random
  numbers").
"""

from __future__ import annotations

import math

import torch
from torch import fx

from automap.generate import ops
from automap.generate.ops import loss_denominator, vocab_parallel_embedding
from automap.generate.state import local_bounds
from automap.sharding.collectives import split_dim
from automap.sharding.spec import ShardingSpec
from automap.trace.causal_mask import CAUSAL_MASK, causal_call

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


def causal_attention(node: fx.Node, args: tuple, kwargs: dict, node_plan) -> tuple[tuple, dict]:
    """Attention whose traced mask is the constant causal pattern
    (``automap.trace.causal_mask``) as the causal kernel without the mask, as eager
    models call it, where this rank's queries span the whole sequence; else as traced."""
    if not node.meta.get(CAUSAL_MASK):
        return args, kwargs
    seq_dim = node.args[0].meta["val"].dim() - 2
    if _axes_of(node_plan.inputs[0], seq_dim):
        return args, kwargs
    return causal_call(args, kwargs)


RANDOM = {"dropout", "dropout_", "rand_like", "randn_like", "bernoulli"}
_NORMALISING = {"softmax", "_softmax", "log_softmax", "_log_softmax"}
_GROUPED_MM = {"_grouped_mm", "grouped_mm", "grouped_mm_fallback"}


def _axes_of(spec: str, dim: int) -> list[int]:
    return list(ShardingSpec.parse(spec).dims[dim])


def rewrite(em, node: fx.Node, family: str, args: tuple, kwargs: dict, node_plan, rank: int):
    """The op of ``node`` on this rank's shards where running it as is would be
    wrong (see the module docstring): ``(value, partial axes left to reduce,
    scatter dim)``, or None where the op runs as is."""
    if family in RANDOM:
        out_spec = node_plan.outputs[0]
        if ShardingSpec.parse(out_spec).is_replicated or (
                family.startswith("dropout") and (args[1] == 0 or not args[2])):
            return None
        bounds = local_bounds(out_spec, global_shape(node), em.mesh, rank)
        if family.startswith("dropout"):
            value = em.call(ops.sharded_dropout, node.target, args[0], *args[1:3],
                            global_shape(node), bounds)
        else:
            value = em.call(ops.sharded_random_like, node.target, args[0], global_shape(node),
                            bounds, *args[1:], **kwargs)
        return value, [], None
    if family == "scaled_dot_product_attention" and _arg(args, kwargs, 4, "dropout_p", 0.0):
        spec = node_plan.outputs[0]
        if ShardingSpec.parse(spec).is_replicated:
            return None
        shard = _shard_index(local_bounds(spec, global_shape(node), em.mesh, rank),
                             global_shape(node))
        return em.call(ops.with_shard_rng, shard, node.target, *args, **kwargs), [], None
    if family in _NORMALISING:
        dim = args[1] % node.meta["val"].dim()
        axes = _axes_of(node_plan.inputs[0], dim)
        if not axes:
            return None
        fn = ops.class_parallel_softmax if "log" not in family else ops.class_parallel_log_softmax
        return em.call(fn, args[0], dim, em.group(axes)), [], None
    if family == "logsumexp" and node_plan.partial_axes:
        # Every partial axis splits a reduced dim: the result is whole after it.
        dims = [args[1]] if isinstance(args[1], int) else list(args[1])
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        partial = list(node_plan.partial_axes)
        value = em.call(ops.class_parallel_logsumexp, args[0], dims, keepdim, em.group(partial))
        return _scattered(em, value, partial, node_plan.scatter_dim), [], None
    if family == "cross_entropy_loss":
        return _class_parallel_loss(em, node, args, kwargs, node_plan, rank)
    if family in _GROUPED_MM:
        axes = _axes_of(node_plan.inputs[1], 0)
        if not axes:
            return None
        first = local_bounds(node_plan.inputs[1], global_shape(node.args[1]), em.mesh,
                             rank)[0][0]
        offs = args[2] if len(args) > 2 else kwargs["offs"]
        value = em.call(ops.expert_parallel_grouped_mm, node.target, args[0], args[1], offs,
                        first)
        return value, list(node_plan.partial_axes), node_plan.scatter_dim
    return None


def _arg(args: tuple, kwargs: dict, position: int, name: str, default=None):
    return args[position] if len(args) > position else kwargs.get(name, default)


def _shard_index(bounds, shape) -> int:
    """Which block ``bounds`` is, numbered over the grid of equal blocks."""
    index = 0
    for (start, end), size in zip(bounds, shape):
        index = index * (size // max(end - start, 1)) + start // max(end - start, 1)
    return index


def _scattered(em, value: fx.Node, axes, scatter_dim):
    """A whole result split along ``scatter_dim`` over ``axes`` where the plan
    reduce-scatters it (the shard this rank's reduce-scatter would keep)."""
    if scatter_dim is None:
        return value
    return em.call(split_dim, value, scatter_dim, em.group(axes))


def _class_parallel_loss(em, node: fx.Node, args: tuple, kwargs: dict, node_plan, rank: int):
    logits = node.args[0]
    class_dim = 1 if logits.meta["val"].dim() > 1 else 0
    classes = _axes_of(node_plan.inputs[0], class_dim)
    if not classes:
        return None
    _, reduction, ignore_index = (_loss_arg("cross_entropy_loss", args, kwargs, i)
                                  for i in range(3))
    start = local_bounds(node_plan.inputs[0], global_shape(logits), em.mesh, rank)[class_dim][0]
    losses = em.call(ops.class_parallel_cross_entropy, args[0], args[1], ignore_index,
                     start, em.group(classes))
    batch = [a for a in node_plan.partial_axes if a not in classes]
    if reduction == 0:  # per target, whole over the class axes
        return _scattered(em, losses, classes, node_plan.scatter_dim), batch, None
    total = em.call(torch.ops.aten.sum.default, losses)
    if reduction == _MEAN_REDUCTION:
        denominator = em.call(loss_denominator, args[1], None, ignore_index,
                              em.group(batch) if batch else None)
        total = em.call(torch.ops.aten.div.Tensor, total, denominator)
    return total, batch, None
