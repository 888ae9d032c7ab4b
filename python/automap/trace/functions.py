"""Custom ``torch.autograd.Function``s kept whole in the traced graph.

A non-strict export runs a Function's forward op by op and autograd would
differentiate those ops, not call the Function's backward: a straight-through
estimator (forward rounds, backward passes the gradient on) would train with
a zero gradient. While :func:`automap.trace.trace` exports, the ``forward`` of
every user Function class (found among the subclasses of
``torch.autograd.Function``; ``apply`` looks it up at each call, so a stored
``f = MyFunction.apply`` is caught too) instead calls one custom op per Function
(and per set of non-tensor arguments), ``automap::autograd_function_<Name>_<n>``,
taking and returning lists of tensors. Its implementation runs the user's forward; its backward runs
the user's forward again (to rebuild what the forward saved on its ``ctx``) and
then the user's backward, so the module trains with the Function's own
gradient at the cost of one more forward.

While tracing, the ops the forward and backward run are recorded
(:class:`OpaqueFunction`): the planner lets a Function whose every op is
pointwise split like an elementwise op, and runs any other whole (replicated).
A Function that cannot be kept (non-tensor outputs, in-place ``mark_dirty``)
raises :class:`~automap.errors.UnsupportedFunctionError` naming it.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from automap.errors import UnsupportedFunctionError

#: Prefix of the custom ops that stand for Functions (``signatures`` keys on it).
OP_PREFIX = "autograd_function_"
_LIBRARY = torch.library.Library("automap", "FRAGMENT")


@dataclass
class OpaqueFunction:
    """One Function called with one set of non-tensor arguments."""

    cls: type
    forward: Any  # the class's own forward (a plain function)
    spec: Any  # pytree spec of (args, kwargs) of the apply call
    constants: list  # its leaves, tensors replaced by None
    op_name: str
    #: aten op families (``aten.mul.Tensor`` -> ``mul``) its forward and its
    #: backward ran while tracing; None when the backward could not be run then.
    forward_ops: set[str] = field(default_factory=set)
    backward_ops: set[str] | None = None
    tuple_output: bool = False  # the forward returns a tuple (of one, maybe)

    @property
    def name(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"

    def arguments(self, tensors) -> tuple[tuple, dict]:
        tensors = iter(tensors)
        leaves = [next(tensors) if c is None else c for c in self.constants]
        return pytree.tree_unflatten(leaves, self.spec)


#: Op name -> the Function it stands for (this process's registrations).
FUNCTIONS: dict[str, OpaqueFunction] = {}
_BY_KEY: dict[tuple, OpaqueFunction] = {}


class _Ctx:
    """The ``ctx`` a Function's forward fills and its backward reads."""

    def __init__(self, function: OpaqueFunction, needs_input_grad: tuple = ()) -> None:
        self._function = function
        self.saved_tensors: tuple = ()
        self.needs_input_grad = needs_input_grad
        self.materialize_grads = True

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors

    @property
    def saved_variables(self) -> tuple:
        return self.saved_tensors

    def mark_non_differentiable(self, *tensors) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value

    def mark_dirty(self, *tensors) -> None:
        raise UnsupportedFunctionError(
            f"autograd.Function {self._function.name} modifies its inputs in place "
            "(ctx.mark_dirty); automap keeps Functions as opaque ops, which must not: "
            "return a new tensor instead", self._function.name)


def _has_setup_context(cls: type) -> bool:
    base = torch.autograd.function._SingleLevelFunction.setup_context
    return getattr(cls.setup_context, "__func__", cls.setup_context) is not getattr(
        base, "__func__", base)


def _run_forward(function: OpaqueFunction, tensors, ctx: _Ctx) -> list[torch.Tensor]:
    args, kwargs = function.arguments(tensors)
    with torch.no_grad():
        if _has_setup_context(function.cls):
            out = function.forward(*args, **kwargs)
            function.cls.setup_context(ctx, args, out)
        else:
            out = function.forward(ctx, *args, **kwargs)
    function.tuple_output = isinstance(out, (tuple, list))
    outs = list(out) if function.tuple_output else [out]
    if not all(isinstance(o, torch.Tensor) for o in outs):
        raise UnsupportedFunctionError(
            f"autograd.Function {function.name} returns {type(out).__name__} with "
            "non-tensor values; automap keeps Functions as opaque ops returning tensors "
            "only", function.name)
    # A custom op's outputs must be new tensors.
    return [o.clone() if any(torch._C._is_alias_of(o, t) for t in tensors) else o
            for o in outs]


class _OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _register(function: OpaqueFunction) -> None:
    name = function.op_name
    _LIBRARY.define(f"{name}(Tensor[] tensors) -> Tensor[]")

    def forward(tensors):
        return _run_forward(function, tensors, _Ctx(function))

    def fake(tensors):
        # While tracing: the shapes, and which ops forward and backward run.
        with _OpRecorder() as recorder:
            ctx = _Ctx(function, tuple(t.requires_grad for t in tensors))
            outs = _run_forward(function, tensors, ctx)
        function.forward_ops |= recorder.ops
        grads = [torch.ones_like(o) for o in outs]
        with contextlib.suppress(Exception), _OpRecorder() as recorder:
            function.cls.backward(ctx, *grads)
            function.backward_ops = (function.backward_ops or set()) | recorder.ops
        return outs

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[0])
        ctx.needs = tuple(t.requires_grad for t in inputs[0])

    def backward(ctx, grads):
        tensors = ctx.saved_tensors
        user_ctx = _Ctx(function, _needs_by_argument(function, ctx.needs))
        outs = _run_forward(function, [t.detach() for t in tensors], user_ctx)
        grads = [torch.zeros_like(o) if g is None else g for g, o in zip(grads, outs)]
        result = function.cls.backward(user_ctx, *grads)
        result = list(result) if isinstance(result, (tuple, list)) else [result]
        by_tensor = [g for g, c in zip(result, function.constants) if c is None]
        return [torch.zeros_like(t) if g is None else g for g, t in zip(by_tensor, tensors)]

    _LIBRARY.impl(name, forward, "CompositeExplicitAutograd")
    torch.library.register_fake(f"automap::{name}", fake, lib=_LIBRARY)
    torch.library.register_autograd(f"automap::{name}", backward, setup_context=setup_context,
                                    lib=_LIBRARY)


def _needs_by_argument(function: OpaqueFunction, needs: tuple) -> tuple:
    it = iter(needs)
    return tuple(next(it) if c is None else False for c in function.constants)


def _opaque(cls: type, forward, args: tuple, kwargs: dict) -> OpaqueFunction:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    constants = [None if isinstance(x, torch.Tensor) else x for x in leaves]
    key = (cls, repr(spec), repr(constants))
    function = _BY_KEY.get(key)
    if function is None:
        stem = re.sub(r"\W", "_", cls.__qualname__)
        function = OpaqueFunction(cls, forward, spec, constants,
                                  f"{OP_PREFIX}{stem}_{len(FUNCTIONS)}")
        _register(function)
        FUNCTIONS[function.op_name] = function
        _BY_KEY[key] = function
    return function


def _user_functions() -> list[type]:
    """Every Function class defined outside torch and automap (which trace through
    or are automap's own collectives)."""
    found, stack = [], list(torch.autograd.Function.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if not cls.__module__.startswith(("torch.", "automap.")):
            found.append(cls)
    return found


def _calling_op(cls: type, forward):
    """A forward for ``cls`` that calls its custom op instead of running."""
    new_style = _has_setup_context(cls)

    def call(*args, **kwargs):
        args = args if new_style else args[1:]  # the ctx of apply: unused
        function = _opaque(cls, forward, args, kwargs)
        tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        outs = getattr(torch.ops.automap, function.op_name)(tensors)
        return tuple(outs) if function.tuple_output else outs[0]

    return staticmethod(call)


@contextlib.contextmanager
def opaque_functions():
    """While active, applying a user Function calls its custom op."""
    patched = []
    for cls in _user_functions():
        if not isinstance(inspect.getattr_static(cls, "forward"), staticmethod):
            continue  # legacy Functions with instance methods: torch refuses them anyway
        patched.append((cls, cls.__dict__.get("forward")))
        cls.forward = _calling_op(cls, cls.forward)
    try:
        yield
    finally:
        for cls, own in reversed(patched):
            if own is None:
                del cls.forward
            else:
                cls.forward = own
