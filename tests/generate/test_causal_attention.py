"""Constant causal attention masks (automap.trace.causal_mask): Hugging Face models pass
``is_causal=True`` without a mask when run eagerly but build the mask when exported;
the generated program calls the causal kernel again, without the mask, wherever the
plan keeps the queries' sequence whole. Training equality of such programs is in the
GPT-2 cases of tests/generate/test_generate_gloo.py and the pipeline tests."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from automap import DeviceMesh
from automap.generate.build import generate_graph
from automap.sharding.process_groups import SimulatedGroups
from automap.trace import causal_mask
from automap.trace.causal_mask import CAUSAL_MASK
from automap.trace.tracing import trace
from forced_plans import forced_plan
from generate_workers import FORCED
from serial import build

SEQ = 8


class Attention(nn.Module):
    """One attention op over a mask made by ``make_mask(seq, x)``."""

    def __init__(self, make_mask) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.make_mask = make_mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 2, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.make_mask(s, x))
        return out.pow(2).mean()


def _bool_causal(s, x):
    return torch.ones(s, s, dtype=torch.bool).tril()


def _float_causal(s, x):
    return torch.full((s, s), float("-inf")).triu(1)


def _lowest_float_causal(s, x):
    keep = torch.arange(s)[None, :] <= torch.arange(s)[:, None]
    return torch.zeros(s, s).masked_fill(~keep, torch.finfo(torch.float32).min)[None, None]


def _sliding_window(s, x):
    return torch.ones(s, s, dtype=torch.bool).tril() & torch.ones(s, s, dtype=torch.bool).triu(-2)


def _reads_the_input(s, x):
    # Causal where the input is positive: depends on values, never constant.
    return torch.ones(s, s, dtype=torch.bool).tril() & (x[0, :, :1] > -1e9)


def _marked(make_mask) -> list[bool]:
    torch.manual_seed(0)
    traced = trace(Attention(make_mask), (torch.randn(2, SEQ, 16),),
                   loss_fn=lambda out: out)
    return [bool(n.meta.get(CAUSAL_MASK)) for n in traced.graph.nodes
            if "scaled_dot_product_attention" in str(n.target)]


@pytest.mark.parametrize("make_mask", [_bool_causal, _float_causal, _lowest_float_causal])
def test_constant_causal_masks_are_marked(make_mask):
    assert _marked(make_mask) == [True]


@pytest.mark.parametrize("make_mask", [_sliding_window, _reads_the_input])
def test_other_masks_are_kept(make_mask):
    assert _marked(make_mask) == [False]


def test_masks_too_large_to_evaluate_are_kept(monkeypatch):
    monkeypatch.setattr(causal_mask, "MAX_EVALUATED_ELEMENTS", SEQ * SEQ - 1)
    assert _marked(_bool_causal) == [False]


def _attention_calls(graph):
    return [n for n in graph.nodes if "scaled_dot_product_attention" in str(n.target)]


def test_gpt2_runs_the_causal_kernel_without_the_mask():
    model, inputs, loss_fn = build("gpt2")
    mesh = DeviceMesh((2,), alpha_s=1e-5, bandwidth_bytes_per_s=1e9)
    traced, plan = forced_plan(model, inputs, loss_fn, mesh, **FORCED["dp_tokens"](mesh))
    marked = [n for n in traced.graph.nodes if n.meta.get(CAUSAL_MASK)]
    assert len(marked) == model.config.n_layer
    graph = generate_graph(traced, plan, SimulatedGroups(mesh, 0, "gloo"), 0,
                           torch.device("cpu")).graph
    calls = _attention_calls(graph)
    assert len(calls) == model.config.n_layer
    for call in calls:
        assert call.args[3:6] == (None, 0.0, True), call.args
    # The mask's construction is gone with its last reader.
    built = {str(n.target) for n in graph.nodes}
    assert not built & {"aten.cumsum.default", "aten.__and__.Tensor", "aten.le.Tensor"}


def test_queries_split_on_the_sequence_keep_their_rows_of_the_mask():
    model, inputs, loss_fn = build("gpt2")
    mesh = DeviceMesh((2,), alpha_s=1e-5, bandwidth_bytes_per_s=1e9)
    seq_split = {n: (lambda ins, outs: ins[0] == "RRS0R")
                 for n in ("scaled_dot_product_attention", "scaled_dot_product_attention_1")}
    traced, plan = forced_plan(model, inputs, loss_fn, mesh, ops=seq_split)
    graph = generate_graph(traced, plan, SimulatedGroups(mesh, 0, "gloo"), 0,
                           torch.device("cpu")).graph
    split = [c for c in _attention_calls(graph) if isinstance(c.args[3], torch.fx.Node)]
    assert len(split) == 2, [c.args for c in _attention_calls(graph)]
    for call in split:
        assert len(call.args) < 6 or not call.args[5]


def test_the_causal_kernel_is_priced_where_it_runs():
    """Strategies that keep the queries' sequence whole are priced at the causal
    kernel's work, (L+1)/2L of the masked one's; those that split it at the masked one's."""
    from automap.cluster.device import DeviceProfile
    from automap.solve.strategies import build_strategy_table
    from automap.trace.profiling import profile_traced

    model, inputs, loss_fn = build("gpt2")
    traced = trace(model, inputs, loss_fn=loss_fn)
    mesh = DeviceMesh((2,), alpha_s=1e-5, bandwidth_bytes_per_s=1e9)
    profile = profile_traced(traced, "adamw")
    slow = DeviceProfile(flops_per_s=1e6, memory_bandwidth_bytes_per_s=1e15, op_overhead_s=1e-12)
    table = build_strategy_table(traced, profile, mesh, device=slow)
    options = table.nodes["scaled_dot_product_attention"]
    seq = inputs["input_ids"].shape[1]
    by_q = {ins[0]: options.compute_s[i] for i, ins in enumerate(options.in_specs)}
    # Split on the heads (queries whole) vs on the queries' sequence: the same share
    # of the work, the first at the causal kernel's.
    assert by_q["RS0RR"] == pytest.approx(by_q["RRS0R"] * (seq + 1) / (2 * seq), rel=1e-6)
