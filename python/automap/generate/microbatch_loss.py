"""How a pipelined step weighs its microbatches' losses so that their sum is
the whole batch's loss.

The pipeline runs the traced graph of ONE microbatch, whose loss is
normalised over that microbatch. Summing the microbatches' losses times
``1 / M`` is the batch's loss only for a mean over equally many terms per
microbatch; a new-user sweep found the other cases silently wrong (2
microbatches): a ``reduction="sum"`` loss came out halved (31.90 against
63.80), and a cross-entropy whose ignored targets fell unevenly (1 and 4 kept
per microbatch) gave 2.1522 against 2.1230. The weights, per the reduction
that makes the loss (read from the graph, through dtype casts and scalings):

- an unscaled sum (``aten.sum`` of everything, or a loss with
  ``reduction="sum"``): 1 (a scaled one may divide by the microbatch's size:
  ``x.sum() / x.numel()`` traces as a division by a constant, so it is taken
  for a mean);
- a mean over the kept targets (``cross_entropy``/``nll_loss``, mean): the
  microbatch's count of kept targets (or their class-weight sum) over the
  batch's, counted from the inputs before the step by the graph's own ops from
  the input to the loss's target (label shifts included);
- anything else (a mean over elements): ``1 / M``.

A microbatch whose targets are all ignored has weight 0 and a NaN loss of its
own (0 / 0); the pipeline's loss function drops it (``pipeline._weighted_loss``).
Batch norm's statistics are per microbatch (refused where a pipeline has
several, ``check_batch_statistics``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from automap.errors import InvalidPipelineError

#: Ops a loss passes through on its way out without changing how it splits.
_PASSING = {"aten::_to_copy", "aten::to", "aten::clone", "aten::alias", "aten::view",
            "aten::reshape", "aten::squeeze", "aten::contiguous"}
#: Scalings by a constant (a Python number): linear, the weights stay.
_SCALING = {"aten::mul", "aten::div"}
#: Losses reduced over the kept targets (ignore_index, class weights).
_COUNTED = {"aten::cross_entropy_loss", "aten::nll_loss", "aten::nll_loss_nd",
            "aten::nll_loss2d"}
_SUM, _MEAN = 2, 1


def _schema_name(node: fx.Node) -> str | None:
    schema = getattr(node.target, "_schema", None)
    return None if schema is None else schema.name


def _argument(node: fx.Node, name: str):
    """The value of ``node``'s schema argument ``name`` (its default if unset)."""
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == name:
            if i < len(node.args):
                return node.args[i]
            if name in node.kwargs:
                return node.kwargs[name]
            return arg.default_value if arg.has_default_value() else None
    raise KeyError(name)


def _has_argument(node: fx.Node, name: str) -> bool:
    return any(a.name == name for a in node.target._schema.arguments)


def _loss_source(traced) -> tuple[fx.Node | None, bool]:
    """The node whose reduction makes the graph's loss (through casts and
    constant scalings), or None; and whether a constant scaled it."""
    output = next(n for n in traced.graph.nodes if n.op == "output")
    outs = output.args[0]
    node = outs[traced.user_output_index] if isinstance(outs, (tuple, list)) else outs
    scaled = False
    while isinstance(node, fx.Node) and node.op == "call_function":
        name = _schema_name(node)
        if name in _PASSING or (name == "aten::sum" and _is_scalar(node.args[0])):
            # (the sum of a scalar is that scalar: a loss returned first in a
            # tuple, summed by a loss_fn, was weighted as a sum, 2x with M = 2)
            node = node.args[0]
        elif name in _SCALING and not any(isinstance(a, fx.Node) for a in node.args[1:]):
            node, scaled = node.args[0], True
        else:
            return node, scaled
    return None, scaled


def _is_scalar(value) -> bool:
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 0


@dataclass(frozen=True)
class MicrobatchWeights:
    """Each microbatch's loss weight, given the whole batch's input leaves
    (the traced graph's user inputs in order)."""

    kind: str  # "sum", "mean" or "counted"
    count: Callable[[list], torch.Tensor] | None = None

    def __call__(self, leaves: list, microbatches: int) -> list[float]:
        if self.kind == "sum":
            return [1.0] * microbatches
        if self.count is None:  # "mean"
            return [1.0 / microbatches] * microbatches
        chunks = [torch.chunk(v, microbatches, dim=0) if isinstance(v, torch.Tensor)
                  else [v] * microbatches for v in leaves]
        counts = [self.count([c[i] for c in chunks]) for i in range(microbatches)]
        total = torch.stack(counts).sum()
        return [float(c / total) for c in counts]


def microbatch_weights(traced) -> MicrobatchWeights:
    """How the pipelined step weighs ``traced``'s (one microbatch's) loss."""
    source, scaled = _loss_source(traced)
    if source is None:
        return MicrobatchWeights("mean")
    name = _schema_name(source)
    # A sum scaled by a constant is ambiguous: the constant may be the
    # microbatch's own size (x.sum() / x.numel(), a mean traced for one
    # microbatch), so only an unscaled sum is weighted as one.
    if name == "aten::sum":  # the loss is a scalar: a sum of everything
        return MicrobatchWeights("mean" if scaled else "sum")
    if not _has_argument(source, "reduction"):
        return MicrobatchWeights("mean")
    reduction = _argument(source, "reduction")
    if reduction == _SUM:
        return MicrobatchWeights("mean" if scaled else "sum")
    if reduction != _MEAN or name not in _COUNTED:
        return MicrobatchWeights("mean")
    count = _target_count(traced, source)
    return MicrobatchWeights("mean") if count is None else MicrobatchWeights("counted", count)


def _target_count(traced, loss: fx.Node) -> Callable[[list], torch.Tensor] | None:
    """A function of one microbatch's input leaves giving the loss's count of
    kept targets (or their class-weight sum), by the graph's own ops from the
    inputs to the target; None where the target depends on more than the
    inputs, or the class weights are not a known constant."""
    target = _argument(loss, "target")
    ignore_index = _argument(loss, "ignore_index")
    weight = _argument(loss, "weight")
    smoothing = _argument(loss, "label_smoothing") if _has_argument(loss, "label_smoothing") \
        else 0.0
    if weight is not None and smoothing:
        return None  # its smoothing term divides by another sum
    inputs = list(traced.user_input_nodes)
    order: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def visit(node: fx.Node) -> bool:
        if node in seen:
            return True
        seen.add(node)
        if node.op == "placeholder":
            if node.name not in inputs:
                return False  # a parameter or buffer: not a function of the inputs
        elif node.op != "call_function":
            return False
        else:
            for arg in node.all_input_nodes:
                if not visit(arg):
                    return False
        order.append(node)
        return True

    if not isinstance(target, fx.Node) or not visit(target):
        return None
    class_weight = _constant(traced, weight) if isinstance(weight, fx.Node) else None
    if weight is not None and class_weight is None:
        return None

    def count(leaves: list) -> torch.Tensor:
        env: dict[fx.Node, object] = {}
        for node in order:
            if node.op == "placeholder":
                env[node] = leaves[inputs.index(node.name)]
            else:
                args = fx.node.map_arg(node.args, lambda n: env[n])
                kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
                env[node] = node.target(*args, **kwargs)
        labels = env[target]
        assert isinstance(labels, torch.Tensor)
        kept = labels != ignore_index
        if class_weight is None:
            return kept.sum().to(torch.float64)
        w = class_weight.to(labels.device)
        return (w[labels.masked_fill(~kept, 0)] * kept).sum().to(torch.float64)

    return count


def _constant(traced, node: fx.Node) -> torch.Tensor | None:
    """The value of a buffer or lifted constant placeholder, where it is real."""
    exported = traced.exported
    signature = exported.graph_signature
    value = None
    if node.name in signature.inputs_to_buffers:
        value = exported.state_dict.get(signature.inputs_to_buffers[node.name])
    elif node.name in signature.inputs_to_lifted_tensor_constants:
        value = exported.constants.get(signature.inputs_to_lifted_tensor_constants[node.name])
    if not isinstance(value, torch.Tensor) or value.is_meta:
        return None
    return value.detach()


#: Batch-norm ops (each has a ``training`` argument).
_BATCH_NORM = {"aten::batch_norm", "aten::native_batch_norm", "aten::_native_batch_norm_legit",
               "aten::_native_batch_norm_legit_functional", "aten::cudnn_batch_norm",
               "aten::miopen_batch_norm"}


def check_batch_statistics(traced, microbatches: int | str) -> None:
    """``InvalidPipelineError`` where ``traced`` normalises by batch statistics
    in training mode and the pipeline splits the batch into several
    microbatches (``"auto"``: at least one per stage, so several): each would
    be normalised by its own statistics (a sweep: a first layer's gradient norm
    17.2 against the serial model's 1.26, and ``num_batches_tracked`` counting
    every microbatch)."""
    if microbatches != "auto" and int(microbatches) <= 1:
        return
    name = batch_statistics_node(traced)
    if name is not None:
        count = "several" if microbatches == "auto" else microbatches
        raise InvalidPipelineError(
            f"the model normalises by batch statistics in training mode ({name}): a "
            f"pipeline of {count} microbatches would normalise each by its own "
            "statistics and update the running statistics once per microbatch, which is "
            "not the serial model's step. Use microbatches=1, pipeline='off', or a "
            "normalisation without batch statistics (LayerNorm, GroupNorm)")


def batch_statistics_node(traced) -> str | None:
    """The first node of ``traced`` normalising by batch statistics in
    training mode (batch norm), or None."""
    for node in traced.graph.nodes:
        if node.op == "call_function" and _schema_name(node) in _BATCH_NORM \
                and _argument(node, "training") is True:
            return node.name
    return None
