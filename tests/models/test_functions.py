"""Issue 16, acceptance 2: a custom autograd.Function is never traced through.
It stays one op that runs the Function's own backward; a pointwise one splits
like an elementwise op, any other runs whole; one that cannot be kept raises a
typed error naming it. (Training against the serial model on gloo:
test_numerics.py and the matrix's straight_through.)"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from automap import DeviceMesh, UnsupportedFunctionError
from automap.solve.strategies import build_strategy_table
from automap.trace.tracing import trace


class Scale(torch.autograd.Function):
    """Forward scales, backward passes on twice the gradient (not the derivative)."""

    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x * factor

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad, None


class RowNorm(torch.autograd.Function):
    """Not pointwise: each row divided by its sum."""

    @staticmethod
    def forward(ctx, x):
        out = x / x.sum(-1, keepdim=True)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad - (grad * out).sum(-1, keepdim=True)


class WithCount(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone(), 3

    @staticmethod
    def backward(ctx, grad, _):
        return grad


class Model(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.fc(x))


def _traced(fn):
    model = Model(fn)
    x = torch.rand(8, 4)
    return model, x, trace(model, (x,), loss_fn=lambda out: out.sum())


def _function_node(traced):
    return next(n for n in traced.graph.nodes if n.name.startswith("autograd_function"))


def test_function_is_one_op_with_its_own_backward():
    model, x, traced = _traced(lambda h: Scale.apply(h, 3.0))
    assert not any("mul" in str(n.target) for n in traced.graph.nodes)  # not traced through
    serial = copy.deepcopy(model)
    serial(x).sum().backward()
    module = traced.module()
    module(x).backward()
    grads = dict(module.named_parameters())
    for name, p in serial.named_parameters():
        assert torch.allclose(grads["model." + name].grad, p.grad)
        # Twice autograd's gradient of x * 3: the Function's backward ran.
        assert torch.allclose(p.grad, 2 / 3 * _autograd_grad(model, x, name))


def _autograd_grad(model, x, name):
    plain = copy.deepcopy(model)
    plain.fn = lambda h: h * 3.0
    plain(x).sum().backward()
    return dict(plain.named_parameters())[name].grad


@pytest.mark.parametrize("fn, splits", [(lambda h: Scale.apply(h, 3.0), True),
                                        (RowNorm.apply, False)])
def test_pointwise_functions_split_others_run_whole(fn, splits):
    _, _, traced = _traced(fn)
    table = build_strategy_table(traced, None, DeviceMesh((4,)), flops_per_s=1e12)
    node = table.nodes[_function_node(traced).name]
    assert node.kind == ("einsum" if splits else "replicate")
    assert ("S0R",) in node.in_specs if splits else node.in_specs == [("RR",)]


def test_a_function_that_cannot_be_kept_is_named():
    with pytest.raises(UnsupportedFunctionError, match="WithCount") as err:
        _traced(lambda h: WithCount.apply(h)[0])
    assert err.value.function.endswith("WithCount")
