"""Mixed precision: the traced graph computes as under ``torch.autocast`` while
parameters stay full-precision masters.

``torch.export`` traces above autocast, so an autocast region around the export
leaves no trace in the graph. :func:`insert_autocast_casts` therefore asks
autocast itself, node by node: each aten op runs once on FakeTensors under
``torch.autocast(device, param_dtype)`` while a dispatch mode records which of
its inputs autocast casts, and to what dtype; those casts become explicit
``aten._to_copy`` nodes in front of the op. The graph then runs, without any
autocast context, exactly what the serial model computes under autocast (the
same casts before the same ops, and their backward casts the gradients back),
and everything downstream (profiler, planner, generator) sees the low-precision
activations as ordinary tensors of that dtype: their bytes are priced, their
conversions move half the bytes, and a parameter's cast is an elementwise node
whose placement the planner chooses (cast before or after an all-gather).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from automap.errors import InvalidArgumentError

log = logging.getLogger(__name__)

#: The string shorthands of ``mixed_precision=``.
SHORTHANDS = {"bf16": torch.bfloat16, "fp16": torch.float16}
_LOW_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MixedPrecision:
    """Compute in ``param_dtype`` (as ``torch.autocast(device, param_dtype)``
    would) with float32 master parameters and optimizer state; data-parallel
    gradients are all-reduced in ``reduce_dtype`` (float32 by default: summing in
    bf16 loses the small gradients). ``"bf16"`` and ``"fp16"`` are the shorthands
    ``MixedPrecision(torch.bfloat16)`` and ``MixedPrecision(torch.float16)``."""

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.param_dtype not in _LOW_DTYPES:
            raise InvalidArgumentError(
                f"MixedPrecision param_dtype must be torch.bfloat16 or torch.float16, got "
                f"{self.param_dtype!r}")
        if not isinstance(self.reduce_dtype, torch.dtype) or \
                not self.reduce_dtype.is_floating_point or self.reduce_dtype.is_complex:
            raise InvalidArgumentError(
                f"MixedPrecision reduce_dtype must be a real floating torch dtype (e.g. "
                f"torch.float32), got {self.reduce_dtype!r}")

    def to_dict(self) -> dict:
        return {"param_dtype": _dtype_name(self.param_dtype),
                "reduce_dtype": _dtype_name(self.reduce_dtype)}

    @classmethod
    def from_dict(cls, data: dict) -> MixedPrecision:
        return cls(_dtype_of(data["param_dtype"]), _dtype_of(data["reduce_dtype"]))


def resolve_mixed_precision(value: object) -> MixedPrecision | None:
    """``mixed_precision=`` as given to automap: None, ``"bf16"``, ``"fp16"`` or a
    ``MixedPrecision``; anything else is an ``InvalidArgumentError``."""
    if value is None or isinstance(value, MixedPrecision):
        return value
    if isinstance(value, str) and value in SHORTHANDS:
        return MixedPrecision(SHORTHANDS[value])
    raise InvalidArgumentError(
        f"mixed_precision must be None, 'bf16', 'fp16' or an automap.MixedPrecision, got "
        f"{value!r}")


def describe(setting: MixedPrecision | None) -> str:
    if setting is None:
        return "full precision (mixed_precision=None)"
    return (f"mixed precision {_dtype_name(setting.param_dtype)} (gradients reduced in "
            f"{_dtype_name(setting.reduce_dtype)})")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_of(name: object) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"mixed precision dtype must name a torch dtype, got {name!r}")
    return dtype


class _CastRecorder(TorchDispatchMode):
    """Records the dtype autocast casts each of the watched tensors to."""

    def __init__(self, watched: dict[int, tuple]) -> None:
        super().__init__()
        self.watched = watched  # id(fake tensor) -> position among the node's inputs
        self.casts: dict[tuple, torch.dtype] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and args and id(args[0]) in self.watched:
            dtype = kwargs.get("dtype")
            if dtype is not None and dtype != args[0].dtype:
                self.casts[self.watched[id(args[0])]] = dtype
        return func(*args, **kwargs)


class _AutocastRun(fx.Interpreter):
    """Runs the graph on FakeTensors, each aten op under autocast, and notes per
    node the casts autocast applied to its inputs (position -> dtype)."""

    def __init__(self, gm: fx.GraphModule, device_type: str, dtype: torch.dtype) -> None:
        super().__init__(gm)
        self.device_type, self.dtype = device_type, dtype
        self.casts: dict[str, dict[tuple, torch.dtype]] = {}
        #: Metadata asserts (export's record of a ``.to(dtype)`` that was a no-op
        #: when traced, e.g. HF's ``logits.float()``) -> the dtype they see now.
        self.asserted: dict[str, torch.dtype] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "placeholder":
            return n.meta["val"]
        if n.target is torch.ops.aten._assert_tensor_metadata.default:
            # It checks the traced dtype, which mixed precision changes on purpose.
            checked = self.env.get(n.args[0]) if isinstance(n.args[0], fx.Node) else None
            if isinstance(checked, torch.Tensor):
                self.asserted[n.name] = checked.dtype
            return None
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload) \
                or n.target.namespace != "aten":
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        watched, dtypes = {}, {}  # id -> position; position -> dtype as met
        for i, a in enumerate(args):
            for j, t in enumerate(a if isinstance(a, (list, tuple)) else [a]):
                if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
                    watched[id(t)] = (i, j) if isinstance(a, (list, tuple)) else (i,)
                    dtypes[watched[id(t)]] = t.dtype
        recorder = _CastRecorder(watched)
        with torch.autocast(self.device_type, self.dtype), recorder:
            out = n.target(*args, **kwargs)
        casts = recorder.casts
        if casts and _mixes_dtypes(dtypes, casts):
            # Casts autocast made inside a composite op's decomposition (an LSTM's
            # or GRU's inner linears cast its weights, not its input or state): in
            # front of the whole op they would mix dtypes, which the op refuses.
            # It runs in its inputs' widest dtype instead, without autocast.
            widest = max(dtypes.values(), key=lambda d: torch.finfo(d).bits)
            log.debug("mixed precision: %s runs in %s (autocast's casts %s)", n.name,
                      widest, casts)
            args = tuple(_to_dtype(a, widest) for a in args)
            out = n.target(*args, **kwargs)
            casts = {where: widest for where, dtype in dtypes.items() if dtype != widest}
        elif not casts and _mixes_dtypes(dtypes, casts):
            # Autocast cast only inside the op (an einsum's bmm on its permuted
            # operands): without autocast the op may refuse the mixed inputs it
            # was given (a bf16 cumsum beside fp32 weights). Where it does, its
            # inputs are cast to the dtype autocast computed it in.
            try:
                n.target(*args, **kwargs)
            except RuntimeError:
                computed = next((t.dtype for t in pytree.tree_leaves(out)
                                 if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
                if computed is not None:
                    casts = {where: computed for where, dtype in dtypes.items()
                             if dtype != computed}
        if casts:
            self.casts[n.name] = casts
        return out


def _to_dtype(value: Any, dtype: torch.dtype) -> Any:
    """``value`` (a tensor, a list or tuple of them, or anything else) with its
    floating tensors in ``dtype``."""
    if isinstance(value, (list, tuple)):
        return type(value)(_to_dtype(v, dtype) for v in value)
    if isinstance(value, torch.Tensor) and value.dtype.is_floating_point:
        return value.to(dtype)
    return value


def _mixes_dtypes(dtypes: dict[tuple, torch.dtype], casts: dict[tuple, torch.dtype]) -> bool:
    """Whether floating inputs of ``dtypes`` (position -> dtype, as the autocast
    run met them) would have several dtypes with ``casts`` applied."""
    return len({casts.get(where, dtype) for where, dtype in dtypes.items()}) > 1


def insert_autocast_casts(gm: fx.GraphModule, setting: MixedPrecision, device_type: str) -> int:
    """Make ``gm`` compute as under ``torch.autocast(device_type,
    setting.param_dtype)``: explicit ``aten._to_copy`` casts in front of the ops
    autocast would cast, and every node's ``meta["val"]`` propagated again.
    Returns the number of casts inserted (one per cast value and dtype)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    placeholders = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = next((v.fake_mode for v in placeholders if hasattr(v, "fake_mode")), None)
    if fake_mode is None:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    run = _AutocastRun(gm, device_type, setting.param_dtype)
    with fake_mode:
        run.run(*placeholders)
    made: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}
    for node in list(gm.graph.nodes):
        for where, dtype in run.casts.get(node.name, {}).items():
            arg = node.args[where[0]]
            source = arg[where[1]] if len(where) == 2 else arg
            if not isinstance(source, fx.Node):
                continue
            cast = made.get((source, dtype))
            if cast is None:
                # Before its first reader (not after the source: placeholders come first).
                with gm.graph.inserting_before(node):
                    cast = gm.graph.call_function(torch.ops.aten._to_copy.default, (source,),
                                                  {"dtype": dtype})
                cast.meta.update({k: v for k, v in node.meta.items()
                                  if k in ("nn_module_stack", "stack_trace", "source_fn_stack")})
                made[(source, dtype)] = cast
            if len(where) == 2:
                items = list(arg)
                items[where[1]] = cast
                node.update_arg(where[0], type(arg)(items))
            else:
                node.update_arg(where[0], cast)
    for node in gm.graph.nodes:
        now = run.asserted.get(node.name)
        if now is not None and node.kwargs.get("dtype") not in (None, now):
            node.update_kwarg("dtype", now)
    gm.graph.lint()
    gm.recompile()
    with fake_mode:
        FakeTensorProp(gm, fake_mode).propagate_dont_convert_inputs(*placeholders)
    return len(made)
