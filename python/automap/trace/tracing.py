"""Tracing: the graph automap plans on.

:func:`trace` exports a model with ``torch.export.export(..., strict=False)``. The
result is an aten-level fx graph (training IR: autograd-capable ops such as
``aten.linear``, ``aten.conv2d``, ``aten.scaled_dot_product_attention``) in which
parameters, buffers and user inputs are placeholders. Export runs the model's Python on
FakeTensors, so no real compute happens and models built on ``torch.device("meta")``
trace as well as ordinary ones.

Custom ``torch.autograd.Function``s stay one op each, whose backward is the
Function's own (:mod:`automap.trace.functions`).

Example inputs: a tensor, a tuple of positional arguments, or a dict of keyword
arguments (the usual form for Hugging Face models: ``{"input_ids": ..., "labels": ...}``).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree

from automap.errors import TraceError
from automap.progress import stage
from automap.trace import hf_compat
from automap.trace.causal_mask import mark_causal_masks
from automap.trace.functions import opaque_functions
from automap.trace.mixed_precision import (
    MixedPrecision,
    insert_autocast_casts,
    resolve_mixed_precision,
)

log = logging.getLogger(__name__)

#: Attribute under which :class:`_Step` holds the user's model; stripped from every
#: module path and parameter name so that names are the user's own.
_INNER = "model"


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor value of the graph."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


@dataclass(frozen=True)
class NodeInfo:
    """What the planner needs to know about one node: its op, its output tensors and
    the module it belongs to (``""`` for the root module)."""

    name: str
    op: str
    outputs: tuple[TensorMeta, ...]
    module_path: str
    module_type: str


@dataclass(frozen=True)
class StateInfo:
    """A parameter, buffer or lifted constant of the traced model.

    ``name`` is the fully qualified name, as in ``model.named_parameters()``.
    torch.export lifts every name of a tied tensor to its own placeholder; ``tied`` lists
    all names of the tensor (empty when untied), e.g. GPT-2's ``transformer.wte.weight``
    and ``lm_head.weight``. ``node`` is its placeholder in the graph."""

    name: str
    kind: str
    node: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    tied: tuple[str, ...] = ()

    @property
    def canonical(self) -> str:
        """The name that stands for the tensor (the first of its tied names)."""
        return self.tied[0] if self.tied else self.name

    @property
    def module_path(self) -> str:
        return self.name.rpartition(".")[0]

    @property
    def nbytes(self) -> int:
        return TensorMeta(self.shape, self.dtype).nbytes


class TracedGraph:
    """An exported model: the fx graph plus the facts about it the planner needs.

    - ``exported``: the ``torch.export.ExportedProgram``.
    - ``graph_module``: its fx GraphModule; placeholders are the lifted parameters,
      buffers and constants (in that order), then the flattened user inputs.
    - ``nodes``: ``NodeInfo`` by node name, for every placeholder and op node.
    - ``parameters``, ``buffers``, ``constants``: ``StateInfo`` by name.
    - ``tied_parameters``: groups of names that are one tensor.
    - ``has_loss``: whether the graph ends in the scalar training loss (``loss_fn`` given
      to :func:`trace`); the graph output at ``user_output_index`` is then the loss.
    """

    def __init__(self, exported: ExportedProgram, model: nn.Module, has_loss: bool) -> None:
        self.exported = exported
        self.graph_module: fx.GraphModule = exported.graph_module
        self.graph: fx.Graph = exported.graph_module.graph
        self.has_loss = has_loss
        #: The ``MixedPrecision`` the graph computes in (None: as traced).
        self.mixed_precision: MixedPrecision | None = None
        self.model_type = type(model).__name__

        ties = _tie_groups(model)
        placeholders = {n.name: n for n in self.graph.nodes if n.op == "placeholder"}
        sig = exported.graph_signature
        self.parameters: dict[str, StateInfo] = {}
        self.buffers: dict[str, StateInfo] = {}
        self.constants: dict[str, StateInfo] = {}
        self._state_by_node: dict[str, StateInfo] = {}
        named = dict(model.named_parameters(remove_duplicate=False))
        for kind, mapping, table in (
            ("parameter", sig.inputs_to_parameters, self.parameters),
            ("buffer", sig.inputs_to_buffers, self.buffers),
            ("constant", sig.inputs_to_lifted_tensor_constants, self.constants),
        ):
            for node_name, target in mapping.items():
                name = _strip_inner(target)
                meta = _tensor_metas(placeholders[node_name].meta.get("val"))[0]
                param = named.get(name)
                info = StateInfo(
                    name=name,
                    kind=kind,
                    node=node_name,
                    shape=meta.shape,
                    dtype=meta.dtype,
                    requires_grad=bool(param is not None and param.requires_grad),
                    tied=ties.get(name, ()),
                )
                table[name] = info
                self._state_by_node[node_name] = info
        self.tied_parameters: list[tuple[str, ...]] = list(
            dict.fromkeys(info.tied for info in self.parameters.values() if info.tied)
        )
        self.user_input_nodes: list[str] = [
            spec.arg.name for spec in sig.input_specs if spec.kind.name == "USER_INPUT"
        ]
        # Graph outputs also carry buffer mutations in a functional IR; they come first.
        kinds = [spec.kind.name for spec in sig.output_specs]
        self.user_output_index = kinds.index("USER_OUTPUT") if "USER_OUTPUT" in kinds else 0

        self.nodes: dict[str, NodeInfo] = {}
        for node in self.graph.nodes:
            if node.op in ("placeholder", "call_function"):
                self.nodes[node.name] = self._node_info(node)

    def _node_info(self, node: fx.Node) -> NodeInfo:
        state = self._state_by_node.get(node.name)
        if state is not None:
            path, module_type = state.module_path, ""
        else:
            path, module_type = _module_of(node)
        op = "placeholder" if node.op == "placeholder" else _op_name(node.target)
        return NodeInfo(node.name, op, _tensor_metas(node.meta.get("val")), path, module_type)

    @property
    def device(self) -> torch.device:
        """The device the graph was traced on (of its first placeholder)."""
        for node in self.graph.nodes:
            val = node.meta.get("val")
            if node.op == "placeholder" and isinstance(val, torch.Tensor):
                return val.device
        return torch.device("cpu")

    def graph_module_on(self, device: str | torch.device) -> fx.GraphModule:
        """The graph module with its device constants retargeted to ``device``.

        Export records the devices it saw as constants (``arange(device=...)``,
        ``.to(device)``, metadata asserts), so a graph traced on ``meta`` cannot run on
        FakeTensors of another device as is. Nodes keep their names and metadata."""
        device = torch.device(device)
        if device.type == self.device.type:
            return self.graph_module
        return _retargeted(self.graph_module, self.device.type, device)

    def state_of(self, node_name: str) -> StateInfo | None:
        """The parameter, buffer or constant a placeholder stands for (else ``None``)."""
        return self._state_by_node.get(node_name)

    def module(self) -> nn.Module:
        """A runnable, trainable fx GraphModule with the parameters as attributes."""
        return self.exported.module()

    def __str__(self) -> str:
        n_ops = sum(1 for n in self.graph.nodes if n.op == "call_function")
        unique = [p for p in self.parameters.values() if p.canonical == p.name]
        lines = [
            f"TracedGraph of {self.model_type}: {n_ops} ops, {len(unique)} parameter tensors "
            f"({sum(p.nbytes for p in unique)} bytes), {len(self.buffers)} buffers, "
            f"{len(self.user_input_nodes)} inputs" + (", ends in the loss" if self.has_loss else "")
        ]
        lines += [f"  tied: {' = '.join(group)}" for group in self.tied_parameters]
        return "\n".join(lines)

    __repr__ = __str__


class _Step(nn.Module):
    """The user's model plus the call arguments automap adds and, optionally, the loss,
    so that one export gives the graph of a whole training forward."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None, extra_kwargs: dict) -> None:
        super().__init__()
        setattr(self, _INNER, model)
        self._loss_fn = loss_fn
        self._extra_kwargs = extra_kwargs

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        model = getattr(self, _INNER)
        before = _persistent_buffers(model)
        out = model(*args, **{**self._extra_kwargs, **kwargs})
        _check_buffers_kept(model, before)
        if self._loss_fn is None:
            return out
        loss = self._loss_fn(out)
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0
                and loss.is_floating_point()):
            what = (f"a tensor of shape {list(loss.shape)} and dtype {loss.dtype}"
                    if isinstance(loss, torch.Tensor) else type(loss).__name__)
            raise TraceError(f"the loss must be a floating-point scalar (0-dim) tensor; "
                             f"loss_fn returned {what}")
        return loss


def _persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a state dict holds (non-persistent ones are caches a forward
    may rebuild, e.g. a rotary table grown for a longer sequence)."""
    return {f"{prefix}.{name}" if prefix else name: buf
            for prefix, module in model.named_modules()
            for name, buf in module._buffers.items()
            if buf is not None and name not in module._non_persistent_buffers_set}


def _check_buffers_kept(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    """A ``TraceError`` where the forward rebinds a buffer of the state dict
    (``self.ema = 0.9 * self.ema + ...``): export records no update for it, so
    the buffer would silently never change; an in-place update is traced."""
    after = _persistent_buffers(model)
    rebound = sorted(name for name, buf in before.items() if after.get(name) is not buf)
    if rebound:
        raise TraceError(
            f"the forward assigns a new tensor to buffer(s) {rebound}; that update is not "
            "part of the traced program, so the buffer would never change. Update it in "
            "place instead (e.g. self.ema.mul_(0.9).add_(0.1 * x), under torch.no_grad() "
            "where it reads activations)")


def default_loss(output: Any) -> torch.Tensor:
    """The loss automap differentiates when none is given: a scalar output as is, the
    ``loss`` of a Hugging Face ``ModelOutput``, else the sum of the first floating-point
    output (backward then starts from a gradient of ones of that output's shape)."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    hf_loss = hf_compat.loss_from_output(output)
    if isinstance(hf_loss, torch.Tensor):
        return hf_loss
    for leaf in pytree.tree_leaves(output):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            # A scalar (a loss returned first in a tuple) is the loss itself.
            return leaf if leaf.dim() == 0 else leaf.sum()
    raise TraceError(
        f"the model's output ({type(output).__name__}) has no floating-point tensor to "
        "differentiate; pass loss_fn=... that maps the output to a scalar loss"
    )


def split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """Positional and keyword arguments from automap's example-input forms: a tensor,
    a tuple/list of positional arguments, or a dict of keyword arguments."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def distinct_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The inputs with every repeated tensor replaced by a copy. torch.export
    merges arguments that are one tensor (``input_ids=ids, labels=ids``) into one
    placeholder; a module built from that graph would read one where the user
    later passes two."""
    seen: set[int] = set()

    def distinct(t: torch.Tensor) -> torch.Tensor:
        if id(t) in seen:
            return t.clone()
        seen.add(id(t))
        return t

    return pytree.tree_map_only(torch.Tensor, distinct, (args, kwargs))


@torch.enable_grad()  # the training graph, whatever the caller's grad mode
def trace(
    model: nn.Module,
    example_inputs: Any,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    attn_implementation: str | None = None,
    mixed_precision: MixedPrecision | str | None = None,
) -> TracedGraph:
    """Export ``model`` called on ``example_inputs`` to an aten-level fx graph.

    ``loss_fn``: maps the model's output to the scalar loss; when given, the loss is
    part of the graph (:func:`default_loss` is what profiling uses). Hugging Face models
    get the adjustments of :mod:`automap.trace.hf_compat` (``use_cache=False``,
    ``return_dict=True``, ``attn_implementation`` when given) without being modified.
    The model is traced in its current mode (``.train()`` / ``.eval()``).
    ``mixed_precision`` (None, ``"bf16"``, ``"fp16"`` or a ``MixedPrecision``): the
    graph computes as under ``torch.autocast`` in that dtype, with explicit casts
    (:mod:`automap.trace.mixed_precision`); ``traced.mixed_precision`` records it.

    Raises :class:`~automap.errors.TraceError` when torch.export cannot trace the model,
    saying why and what to try.
    """
    if not isinstance(model, nn.Module):
        raise TraceError(f"trace expects an nn.Module, got {type(model).__name__}")
    setting = resolve_mixed_precision(mixed_precision)
    args, kwargs = distinct_inputs(*split_inputs(example_inputs))
    _check_one_device(model, args, kwargs)
    is_hf = hf_compat.is_hf_model(model)
    step = _Step(model, loss_fn, hf_compat.call_kwargs(model) if is_hf else {})
    step.training = model.training  # not .train(): it would reset every submodule's mode
    with stage(log, f"traced {type(model).__name__} with torch.export") as tracing:
        try:
            with hf_compat.adjusted(model, attn_implementation) if is_hf else \
                    contextlib.nullcontext(), opaque_functions():
                exported = torch.export.export(step, args, kwargs, strict=False)
        except TraceError:
            raise
        except Exception as exc:
            cause = _cause(exc, TraceError)
            if cause is not None:
                raise cause from exc
            raise TraceError(_explain_export_failure(model, exc, is_hf)) from exc
        _check_static_shapes(exported.graph_module)
        _check_operand_dtypes(exported.graph_module)
        if setting is not None:
            device_type = _first_device_type(args, kwargs, model)
            casts = insert_autocast_casts(exported.graph_module, setting, device_type)
            log.info("mixed precision %s: %d casts inserted", setting.param_dtype, casts)
        mark_causal_masks(exported.graph_module)
        traced = TracedGraph(exported, model, has_loss=loss_fn is not None)
        traced.mixed_precision = setting
        tracing.result(f"{len(traced.nodes)} nodes")
    return traced


def _check_static_shapes(graph_module: torch.fx.GraphModule) -> None:
    """A ``TraceError`` where a tensor's shape depends on the data (boolean-mask
    indexing, ``nonzero``, ``unique``): plans price and shard shapes known when
    planning (torch's guard error escaped untyped from the graph's metadata)."""
    for node in graph_module.graph.nodes:
        for leaf in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(leaf, torch.Tensor) and not all(
                    isinstance(d, int) for d in leaf.shape):
                stack = node.meta.get("nn_module_stack") or {}
                where = next(reversed(stack.values()))[0] if stack else ""
                raise TraceError(
                    f"{_op_name(node.target)} ({node.name}{' in ' + where if where else ''}) "
                    f"makes a tensor whose shape depends on the data ({list(leaf.shape)}); "
                    "automap plans static shapes. Use a fixed-shape form instead (e.g. "
                    "torch.where(mask, x, 0) for x[mask], or a padded result)")


#: Ops whose kernels take one floating dtype for all their tensor operands (eager
#: raises on a mix; fake tensors in torch.export do not check: a float32 input to
#: a float64 model traced and planned, and failed at the first call).
_ONE_DTYPE_OPS = frozenset({
    "linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "mv", "dot", "convolution",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})
# (Not the norms: their CPU and CUDA kernels take low-precision inputs with fp32
# weights.)


def _packet_name(node: torch.fx.Node) -> str | None:
    """The aten op's name without overload (``linear``), None for other targets."""
    return getattr(getattr(node.target, "_overloadpacket", None), "__name__", None)


def _check_operand_dtypes(graph_module: torch.fx.GraphModule) -> None:
    """A ``TraceError`` where an op of ``_ONE_DTYPE_OPS`` reads floating tensors of
    several dtypes, before mixed precision inserts its casts: its inputs and
    parameters, and intermediates (a float32 input through a LayerNorm without
    weights into a float64 model's first Linear planned, and failed at the
    first call on every rank)."""
    # Nodes whose traced dtype is eager's: inputs and parameters, and what ops
    # compute from such (type promotion as eager's), not from an FFT's output
    # (fake propagation's dtype may differ there, and in what follows it).
    real: set[torch.fx.Node] = set()
    for node in graph_module.graph.nodes:
        name = _packet_name(node)
        if node.op == "placeholder" or (
                node.op == "call_function" and "fft" not in (name or "")
                and "complex" not in (name or "") and all(a in real for a in node.all_input_nodes)):
            real.add(node)
        if node.op != "call_function" or name not in _ONE_DTYPE_OPS:
            continue
        dtypes = {str(v.dtype).removeprefix("torch.") for a in node.all_input_nodes
                  if a in real
                  and isinstance(v := a.meta.get("val"), torch.Tensor) and v.is_floating_point()}
        if len(dtypes) > 1:
            stack = node.meta.get("nn_module_stack") or {}
            where = next(reversed(stack.values()))[0] if stack else node.name
            raise TraceError(
                f"{name} in {where or 'the model'} reads tensors of dtypes "
                f"{sorted(dtypes)}; eager PyTorch refuses the mix. Give example inputs of "
                "the model's dtype (or cast the model), or use mixed_precision=...")


def _check_one_device(model: nn.Module, args: Any, kwargs: Any) -> None:
    """A ``TraceError`` naming both devices where the example inputs are on one
    device and the model's state on another: the trace runs the model on its
    inputs (a GPU run's batch with the model still on the CPU, say). The module
    ``apply`` and ``autoparallelize`` return runs on their ``device`` whatever
    device it was traced on, so trace where the model is."""
    inputs = {t.device for t in pytree.tree_leaves((args, kwargs))
              if isinstance(t, torch.Tensor) and t.dim() > 0}
    state = {t.device for t in [*model.parameters(), *model.buffers()]}
    if len(inputs) == 1 and len(state) == 1 and inputs != state:
        (on_inputs,), (on_model,) = inputs, state
        raise TraceError(
            f"the example inputs are on {on_inputs} and the model's parameters on "
            f"{on_model}: trace both on one device (pass example inputs on {on_model}, and "
            f"a loss_fn whose tensors are there too; the module automap returns runs on "
            f"its device= and takes its inputs there)")


def _first_device_type(args: Any, kwargs: Any, model: nn.Module) -> str:
    """The device type autocast is asked about: the inputs' or parameters' (meta
    tensors follow CPU autocast's policy)."""
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    tensors += list(model.parameters())
    kind = tensors[0].device.type if tensors else "cpu"
    return "cpu" if kind == "meta" else kind


def _cause(exc: BaseException | None, kind: type) -> BaseException | None:
    """The first exception of type ``kind`` in ``exc``'s chain (export wraps them)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _explain_export_failure(model: nn.Module, exc: Exception, is_hf: bool) -> str:
    text = f"{type(exc).__name__}: {exc}"
    first_line = text.strip().splitlines()[0][:300]
    if "data-dependent" in text or "DataDependent" in text:
        hint = (
            "the forward branches on tensor values (data-dependent control flow); make the "
            "branch depend on shapes or constants, or use torch.cond"
        )
    elif "Cache" in text and is_hf:
        hint = "the model builds a KV cache; pass use_cache=False in the example inputs"
    elif is_hf:
        hint = (
            "try attn_implementation='eager' or 'sdpa', pass labels so the model computes "
            "its loss, and check the model runs eagerly on the same inputs"
        )
    else:
        hint = (
            "check that the model runs eagerly on the same inputs; call "
            "torch.export.export(model, args, kwargs, strict=False) for torch's full report"
        )
    return f"torch.export could not trace {type(model).__name__}: {first_line}. Try: {hint}."


def _tie_groups(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """For every tied parameter or buffer name, all names of that tensor in the model's
    registration order (the first is the name ``named_parameters()`` reports)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        groups.setdefault(id(tensor), []).append(name)
    return {name: tuple(names) for names in groups.values() if len(names) > 1 for name in names}


def _strip_inner(name: str) -> str:
    if name == _INNER:
        return ""
    return name[len(_INNER) + 1 :] if name.startswith(_INNER + ".") else name


_PATH_NOISE = (
    (re.compile(r"^L\['self'\]\.?|^L__self___?"), ""),
    (re.compile(r"\.?_modules\['([^']+)'\]"), r".\1"),
    (re.compile(r"\[(\d+)\]"), r".\1"),
    (re.compile(r"\['([^']+)'\]"), r".\1"),
    (re.compile(r"^\."), ""),
)


def normalize_module_path(path: str) -> str:
    """A module path from ``nn_module_stack`` as the user's fully qualified module name
    (torch versions spell it ``L['self'].h[0]``, ``L__self___h_0`` or ``h.0``)."""
    for pattern, repl in _PATH_NOISE:
        path = pattern.sub(repl, path)
    return _strip_inner(path)


def _module_of(node: fx.Node) -> tuple[str, str]:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, module_type = list(stack.values())[-1]
    module_type = module_type if isinstance(module_type, str) else module_type.__qualname__
    module_type = module_type.rpartition(".")[2]
    # Ops of the loss outside the model belong to the user's root module.
    return normalize_module_path(path), "" if module_type == _Step.__name__ else module_type


def _retargeted(gm: fx.GraphModule, src_type: str, device: torch.device) -> fx.GraphModule:
    def fix(value: Any) -> Any:
        return pytree.tree_map_only(
            torch.device, lambda d: device if d.type == src_type else d, value
        )

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    attrs: dict[str, Any] = {}
    for node in gm.graph.nodes:
        new = graph.node_copy(node, env.__getitem__)
        new.args, new.kwargs = fix(new.args), fix(new.kwargs)
        env[node] = new
        if node.op == "get_attr":  # e.g. the bodies of higher-order ops (wrap_with_*)
            attr = getattr(gm, node.target)
            is_graph = isinstance(attr, fx.GraphModule)
            attrs[node.target] = _retargeted(attr, src_type, device) if is_graph else attr
    return fx.GraphModule(attrs, graph)


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


def _tensor_metas(val: Any) -> tuple[TensorMeta, ...]:
    return tuple(
        TensorMeta(tuple(int(s) for s in leaf.shape), leaf.dtype)
        for leaf in pytree.tree_leaves(val)
        if isinstance(leaf, torch.Tensor)
    )
