"""Issue 16, acceptance 1: the ops current models use have sharding strategies
beyond running whole, and the split each one allows is the one that is right
for it (checked on the strategy table of small graphs); every model of the
matrix traces with a signature for every op."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from automap import DeviceMesh, ShardingSpec
from automap.solve.signatures import op_family, signature
from automap.solve.strategies import build_strategy_table
from automap.trace.tracing import trace
from model_matrix import MATRIX, build


class Fn(nn.Module):
    """A module running ``fn`` on its inputs, with a weight so that there is a
    gradient to take."""

    def __init__(self, fn, shape) -> None:
        super().__init__()
        self.fn = fn
        self.w = nn.Parameter(torch.ones(shape))

    def forward(self, *xs):
        return self.fn(xs[0] * self.w, *xs[1:])


def _table(fn, *inputs, mesh=(4,)):
    model = Fn(fn, inputs[0].shape[1:])
    traced = trace(model, tuple(inputs), loss_fn=lambda out: (
        out[0] if isinstance(out, (tuple, list)) else out).float().sum())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an op without a strategy warns
        return build_strategy_table(traced, None, DeviceMesh(mesh), flops_per_s=1e12)


def _options(table, family):
    return next(n for n in table.nodes.values() if n.op == family)


def _input_specs(node, k=0) -> set[str]:
    return {s[k] for s in node.in_specs}


X = torch.randn(8, 16, 12)

CASES = {
    # family: (function, inputs, input specs that must be offered, ones that must not)
    "chunk": (lambda x: x.chunk(2, -1)[0], [X], {"S0RR", "RS0R"}, {"RRS0"}),
    "unbind": (lambda x: x.unbind(1)[0], [X], {"S0RR", "RRS0"}, {"RS0R"}),
    "topk": (lambda x: x.topk(3, -1)[0], [X], {"S0RR", "RS0R"}, {"RRS0"}),
    "sort": (lambda x: x.sort(1)[0], [X], {"S0RR", "RRS0"}, {"RS0R"}),
    "cumsum": (lambda x: x.cumsum(1), [X], {"S0RR", "RRS0"}, {"RS0R"}),
    "diff": (lambda x: torch.diff(x, dim=-1), [X], {"S0RR", "RS0R"}, {"RRS0"}),
    "pad": (lambda x: F.pad(x, (1, 1)), [X], {"S0RR", "RS0R"}, {"RRS0"}),
    "repeat": (lambda x: x.repeat(1, 2, 1), [X], {"S0RR", "RRS0"}, {"RS0R"}),
    "min": (lambda x: x.min(-1)[0], [X], {"S0RR", "RS0R"}, {"RRS0"}),
    "gather": (lambda x, i: x.gather(2, i), [X, torch.randint(0, 12, (8, 16, 4))],
               {"S0RR", "RS0R"}, {"RRS0"}),
    "index": (lambda x, i: x[:, i], [X, torch.randint(0, 16, (4,))], {"S0RR", "RRS0"},
              {"RS0R"}),
    "scatter_add": (lambda x, i: x.scatter_add(2, i, torch.ones(8, 16, 4)),
                    [X, torch.randint(0, 12, (8, 16, 4))], {"S0RR", "RS0R"}, {"RRS0"}),
    "hardswish_": (lambda x: F.hardswish(x.clone(), inplace=True), [X],
                   {"S0RR", "RS0R", "RRS0"}, set()),
    "numpy_T": (lambda x: x.T, [X], {"S0RR", "RS0R", "RRS0"}, set()),
    "adaptive_avg_pool1d": (lambda x: F.adaptive_avg_pool1d(x, 1), [X], {"S0RR", "RS0R"},
                            {"RRS0"}),
    "upsample_bilinear2d": (lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"),
                            [torch.randn(4, 8, 4, 4)], {"S0RRR", "RS0RR"}, {"RRS0R"}),
    "conv_transpose2d": (lambda x: F.conv_transpose2d(x, torch.ones(8, 4, 2, 2)),
                         [torch.randn(4, 8, 4, 4)], {"S0RRR", "RS0RR"}, {"RRS0R"}),
    # Class dims: split, with partial max and sum (vocab-parallel loss).
    "logsumexp": (lambda x: torch.logsumexp(x, -1), [X], {"S0RR", "RRS0"}, set()),
    "log_softmax": (lambda x: F.log_softmax(x, -1), [X], {"RRS0"}, set()),
    "cross_entropy_loss": (lambda x, y: F.cross_entropy(x, y), [torch.randn(8, 16),
                           torch.randint(0, 16, (8,))], {"S0R", "RS0"}, set()),
}


@pytest.mark.parametrize("family", sorted(CASES))
def test_op_offers_the_right_splits(family):
    fn, inputs, offered, refused = CASES[family]
    table = _table(fn, *inputs)
    specs = _input_specs(_options(table, family))
    assert offered <= specs, f"{family} offers {sorted(specs)}"
    assert not refused & specs, f"{family} offers {sorted(refused & specs)}"


def test_histc_counts_are_partial_sums_over_its_input_split():
    table = _table(lambda x: torch.histc(x, 4, 0, 1), torch.randn(8, 16))
    node = _options(table, "histc")
    split = [i for i, s in enumerate(node.in_specs) if s[0] == "S0R"]
    assert split and all(node.reductions[i][0] == [0] for i in split)  # all-reduced counts


def test_recurrent_nets_split_on_the_batch_only():
    model = nn.LSTM(12, 6, num_layers=2, batch_first=True)
    traced = trace(model, (X,), loss_fn=lambda out: out[0].sum())
    table = build_strategy_table(traced, None, DeviceMesh((4,)), flops_per_s=1e12)
    node = _options(table, "lstm")
    assert {s[0] for s in node.in_specs} == {"RRR", "S0RR"}
    dp = node.in_specs.index(next(s for s in node.in_specs if s[0] == "S0RR"))
    assert all(axes == [0] for axes in node.reductions[dp][2][3:])  # weights' gradients


def test_grouped_matmul_splits_experts():
    from transformers.integrations import moe  # registers transformers::grouped_mm_fallback

    assert moe is not None
    offs = torch.tensor([2, 5, 5, 8])
    w = torch.randn(4, 16, 6)
    table = _table(lambda x, o: torch.ops.transformers.grouped_mm_fallback(x[0], w, o),
                   torch.randn(1, 8, 16), offs)
    node = _options(table, "grouped_mm_fallback")
    expert = [i for i, s in enumerate(node.in_specs) if s[1] == "S0RR"]
    assert expert and all(node.reductions[i][0] == [0] for i in expert)


@pytest.mark.parametrize("name", [n for family in MATRIX.values() for n in family])
def test_every_op_of_every_matrix_model_has_a_signature(name):
    model, inputs, loss_fn = build(name)
    traced = trace(model, inputs, loss_fn=loss_fn)
    missing = sorted({op_family(n) for n in traced.graph.nodes if n.op == "call_function"
                      and isinstance(n.meta.get("val"), (torch.Tensor, list, tuple))
                      and signature(n) is None})
    assert not missing


@pytest.mark.parametrize("family", ["log_softmax", "logsumexp", "cross_entropy_loss"])
def test_class_splits_pay_for_their_max_and_sums(family):
    """A split class dim costs all-reduces of one value per row (the max and
    the sums over the shards): priced, and far cheaper than gathering rows."""
    fn, inputs, _, _ = CASES[family]
    table = _table(fn, *inputs)
    node = _options(table, family)
    dims = [ShardingSpec.parse(s[0]).dims for s in node.in_specs]
    split = [i for i, d in enumerate(dims) if d[-1] and not any(d[:-1])]  # classes only
    whole = [i for i, d in enumerate(dims) if not any(d)]
    assert split and whole
    rows_bytes = inputs[0].numel() // inputs[0].shape[-1] * inputs[0].element_size()
    for i in split:
        assert node.forward_comm_s[i] >= table.mesh.all_reduce_cost_s(rows_bytes, [0])
        assert node.forward_comm_s[i] < 4 * table.mesh.all_reduce_cost_s(rows_bytes, [0])
