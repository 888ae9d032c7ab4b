"""Shared-subgraph pruning: block detection, tied ILP variables, and
depth-reduced planning that predicts what the full graph predicts."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from automap import DeviceMesh, StalePlanError
from automap.planner.plan import Plan
from automap.planner.search import plan
from automap.solve.blocks import detect_blocks
from automap.solve.depth import reduced_depth, repeated_stacks
from automap.trace.tracing import default_loss, trace

logging.getLogger("transformers").setLevel(logging.ERROR)
MESH = DeviceMesh((2, 2), alpha_s=[2e-5, 5e-6], bandwidth_bytes_per_s=[2.5e10, 2e11])
#: Given speeds: measured ones move with the machine's load, and the plans
#: compared here with them (a loaded run once put tied and untied 2 % apart).
SPEEDS = dict(flops_per_s=5e10, memory_bandwidth_bytes_per_s=1e10, op_overhead_s=5e-6)


def _gpt2(layers: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=64, n_head=4, n_positions=32, vocab_size=128)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
        ids = torch.randint(0, 128, (4, 32))
    return model, {"input_ids": ids, "labels": ids}


def test_gpt2_layers_form_one_class():
    model, inputs = _gpt2(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        classes = detect_blocks(trace(model, inputs, loss_fn=default_loss))
    assert [(c.container, len(c)) for c in classes] == [("transformer.h", 4)]
    sizes = {len(i) for i in classes[0].instances}
    assert len(sizes) == 1 and sizes.pop() > 20


def test_tied_plan_has_depth_independent_variables_and_matches_untied():
    warnings.simplefilter("ignore")
    small, inputs = _gpt2(2)
    deep, deep_inputs = _gpt2(6)
    tied_small = plan(small, inputs, MESH, **SPEEDS)
    tied_deep = plan(deep, deep_inputs, MESH, **SPEEDS)
    untied_deep = plan(deep, deep_inputs, MESH, tie_blocks=False, **SPEEDS)
    assert tied_deep.solver["binaries"] == tied_small.solver["binaries"]
    assert untied_deep.solver["binaries"] > 2 * tied_deep.solver["binaries"]
    # Tying restricts the search: never better, and here within 2 %.
    untied, tied = untied_deep.solver["objective_s"], tied_deep.solver["objective_s"]
    assert untied <= tied * (1 + 1e-9) and tied <= untied * 1.02


def test_reduced_depth_predicts_the_full_plan_and_restores_the_model():
    warnings.simplefilter("ignore")
    model, inputs = _gpt2(5)
    full = plan(model, inputs, MESH, 2**30, **SPEEDS)
    reduced = plan(model, inputs, MESH, 2**30, reduce_depth=True, **SPEEDS)
    assert len(model.transformer.h) == 5  # restored
    assert reduced.solver["reduced_depth"] == [["transformer.h", 5, 2]]
    assert reduced.predicted_step_s == pytest.approx(full.predicted_step_s, rel=1e-9)
    # A reduced plan is not generated: its peak is the memory model's, which the
    # full plan's simulated step checks. Each traced block stands for several at
    # once, so the reduced timeline bounds the full one from above (within 2 %).
    assert "simulated" not in reduced.solver and full.solver["simulated"]
    modelled = full.solver["modelled_peak_bytes"]
    assert modelled <= reduced.predicted_peak_memory_bytes <= 1.02 * modelled
    # Nor can it be applied: said as much, not as a changed model (the
    # fingerprint of its few traced layers is not the model's).
    full.check_generable()
    with pytest.raises(StalePlanError, match=r"reduce_depth=True \(planned on transformer.h: "
                       r"2 of 5 layers\)"):
        Plan.from_json(reduced.to_json()).check_generable()


def test_reduced_depth_only_cuts_uniform_stacks():
    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.same = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))
            self.mixed = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 8),
                                              torch.nn.Linear(8, 4)])

    model = Mixed()
    assert [p for p, _ in repeated_stacks(model)] == ["same"]
    with reduced_depth(model) as stacks:
        assert len(model.same) == 2 and len(model.mixed) == 3
        assert [(s.path, s.depth, s.kept) for s in stacks] == [("same", 4, 2)]
    assert len(model.same) == 4


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_encoder_decoder_models_get_two_block_classes(family):
    from transformers import (
        BartConfig,
        BartForConditionalGeneration,
        T5Config,
        T5ForConditionalGeneration,
    )

    warnings.simplefilter("ignore")
    if family == "t5":
        config = T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=3,
                          num_decoder_layers=3, num_heads=4, decoder_start_token_id=0,
                          pad_token_id=0)
        cls, containers = T5ForConditionalGeneration, ["encoder.block", "decoder.block"]
    else:
        config = BartConfig(vocab_size=128, d_model=64, encoder_layers=3, decoder_layers=3,
                            encoder_attention_heads=4, decoder_attention_heads=4,
                            encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
                            decoder_start_token_id=2, pad_token_id=1)
        cls = BartForConditionalGeneration
        containers = ["model.encoder.layers", "model.decoder.layers"]
    with torch.device("meta"):
        model = cls(config)
        ids = torch.randint(3, 128, (4, 16))
    inputs = {"input_ids": ids, "labels": ids}
    classes = detect_blocks(trace(model, inputs, loss_fn=default_loss))
    assert [c.container for c in classes] == containers
    # T5's first layer of each stack carries the relative position bias: it stands alone.
    assert [len(c) for c in classes] == ([2, 2] if family == "t5" else [3, 3])
    p = plan(model, inputs, MESH)
    assert p.solver["status"] == "Optimal"
    assert [c for c, _ in p.solver["block_classes"]] == containers
