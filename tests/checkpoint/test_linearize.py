"""Issue 6, acceptance 2: linearization gives one stage per residual block
of a ResNet-style convnet and one or a few stages per transformer block of
GPT-2, BERT and Llama (attention masks and rotary tables do not hold a
giant stage open)."""

from __future__ import annotations

import logging
import re
import warnings

import pytest

import model_zoo
from automap.solve.linearize import linearize
from automap.trace.tracing import trace

logging.getLogger("transformers").setLevel(logging.ERROR)


def _stages_per_block(traced, stages, pattern):
    """For each block (module path prefix matching ``pattern``), the stages holding its nodes."""
    holding: dict[str, set[int]] = {}
    for k, stage in enumerate(stages):
        for name in stage:
            m = re.match(pattern, traced.nodes[name].module_path)
            if m:
                holding.setdefault(m.group(0), set()).add(k)
    return holding


def _traced(builder):
    warnings.simplefilter("ignore")
    model, inputs, loss = builder("meta")
    return trace(model, inputs, loss_fn=loss)


def test_resnet_one_stage_per_residual_block():
    traced = _traced(model_zoo.resnet)
    stages = linearize(traced)
    holding = _stages_per_block(traced, stages, r"layer\d+")
    assert sorted(holding) == ["layer1", "layer2"]
    assert all(len(s) == 1 for s in holding.values())
    assert len({next(iter(s)) for s in holding.values()}) == 2  # distinct stages


@pytest.mark.parametrize("builder, pattern", [
    (model_zoo.gpt2, r"transformer\.h\.\d+"),
    (model_zoo.bert, r"bert\.encoder\.layer\.\d+"),
    (model_zoo.llama, r"model\.layers\.\d+"),
])
def test_transformers_a_few_stages_per_block(builder, pattern):
    traced = _traced(builder)
    stages = linearize(traced)
    holding = _stages_per_block(traced, stages, pattern)
    assert len(holding) == 2  # the zoo's models have two layers
    for block, ks in holding.items():
        assert 1 <= len(ks) <= 4, (block, ks)
    # Blocks do not share a stage: each block's stages are its own.
    a, b = holding.values()
    assert not a & b
    ops = sum(len(s) for s in stages)
    assert max(len(s) for s in stages) < ops / 2  # no giant stage


def test_every_op_node_is_in_exactly_one_stage():
    traced = _traced(model_zoo.gpt2)
    stages = linearize(traced)
    flat = [n for s in stages for n in s]
    ops = [n.name for n in traced.graph.nodes if n.op == "call_function"]
    assert sorted(flat) == sorted(ops)
    order = {n.name: i for i, n in enumerate(traced.graph.nodes)}
    assert [order[n] for n in flat] == sorted(order[n] for n in flat)  # stages keep graph order
