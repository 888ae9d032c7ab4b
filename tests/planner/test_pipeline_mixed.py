"""Issue 18: stages running intra-op plans of their own. The partition DP
picks, per stage, the fastest of several submesh plans that fits
(``best_mixed_split``: under 1F1B the first stage keeps more microbatches in
flight than the last, so it may need a leaner plan than the others), and
``pipeline_merge`` makes one plan of them. Meta tensors, no process group;
``tests/generate/test_pipeline_gloo.py`` trains such a plan on gloo."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import automap
from automap import DeviceMesh
from automap.planner.pipeline_chain import Chain, Unit
from automap.planner.pipeline_merge import merged_plan, stage_of_nodes
from automap.planner.pipeline_mesh import cut_mesh
from automap.planner.pipeline_partition import best_mixed_split, best_partition


def _chain(time_s: float, saved: float, units: int = 4) -> Chain:
    return Chain([f"n{i}" for i in range(units)],
                 [Unit(i, i, 0, forward_s=time_s / 3, backward_s=2 * time_s / 3,
                       saved_bytes=saved, state={(f"p{i}", 0): (1.0, 0.0)})
                  for i in range(units)], {})


def test_each_stage_takes_the_fastest_plan_that_fits():
    """1F1B, 2 stages, 4 microbatches: stage 0 keeps 2 in flight, stage 1 one.
    A fast plan (1 s a unit, 10 bytes saved) fits stage 1 only (2 + 2 x 20 >
    30); a lean one (1.5 s, 2 bytes) fits both. Mixed: lean then fast, faster
    than the lean plan alone; the fast one alone fits no split."""
    fast, lean = _chain(1.0, 10.0), _chain(1.5, 2.0)
    stages = cut_mesh(DeviceMesh((2,)), 2)
    budget = 30.0
    assert best_partition(fast, stages, 4, "1f1b", budget, recompute=False) is None
    alone = best_partition(lean, stages, 4, "1f1b", budget, recompute=False)
    mixed = best_mixed_split([fast, lean], stages, 4, "1f1b", budget, recompute=False)
    assert mixed is not None and mixed.bounds == [(0, 2), (2, 4)]
    assert mixed.plan_of == [1, 0] and mixed.recompute == [False, False]
    # sum(t) + (M - 1) max(t): (3 + 2) + 3 x 3 against (3 + 3) + 3 x 3.
    assert mixed.step_s == pytest.approx(14.0)
    assert alone.step_s == pytest.approx(15.0)


def test_one_plan_mixes_to_itself_and_other_units_do_not_mix():
    chain = _chain(1.0, 1.0)
    stages = cut_mesh(DeviceMesh((2,)), 2)
    mixed = best_mixed_split([chain, chain], stages, 4, "gpipe", 100.0)
    alone = best_partition(chain, stages, 4, "gpipe", 100.0)
    assert mixed.bounds == alone.bounds and mixed.step_s == pytest.approx(alone.step_s)
    assert best_mixed_split([chain, _chain(1.0, 1.0, units=5)], stages, 4, "gpipe",
                            100.0) is None


def test_merged_plan_takes_each_stages_nodes_and_plans_the_cut_again():
    """A data-parallel first stage and a tensor-parallel second of the test MLP:
    every node keeps its stage's plan's specs, a parameter its reader's, and
    the value crossing the cut is converted between the two plans' specs."""
    from automap.planner.search import plan as solve_plan
    from automap.trace.tracing import default_loss, trace
    from forced_plans import BATCH, forced_plan
    from pipeline_plans import build_case, computed_nodes, first_node_in
    from speeds import speeds

    model, _, _, micro = build_case("mlp", 2)
    traced = trace(model, micro, loss_fn=default_loss)
    mesh = DeviceMesh((2,))
    dp = forced_plan(model, micro, default_loss, mesh, params={},
                     inputs={"args_0": BATCH, "args_1": BATCH})[1]
    tp = solve_plan(model, micro, mesh, loss_fn=default_loss, **speeds(1e6))
    computed = computed_nodes(traced)
    firsts = [computed[0], first_node_in(traced, "fc3")]
    stage_of = stage_of_nodes(dp, computed, firsts)
    assert stage_of["p_model_fc1_weight"] == 0 and stage_of["p_model_head_weight"] == 1
    assert stage_of["args_1"] == 1  # the targets, read by the loss only
    merged = merged_plan([dp, tp], stage_of)
    for name, node in merged.nodes.items():
        assert node == (dp if stage_of[name] == 0 else tp).nodes[name]
    cut = [e for e in merged.edges if stage_of[e.producer] == 0 and stage_of[e.consumer] == 1
           and e.producer in computed]
    assert cut and all(e.src == dp.nodes[e.producer].outputs[e.output_index]
                       and e.dst == tp.nodes[e.consumer].inputs[e.input_index] for e in cut)
    assert any(e.steps for e in cut) and np.isfinite(sum(e.cost_s for e in cut))
    assert merged_plan([dp, dp], stage_of) is dp


def test_explain_names_each_stages_plan():
    """A plan whose stages run different submesh plans says which, per stage."""
    from automap.trace.tracing import trace
    from pipeline_plans import DeepMLP, computed_nodes, mean_square_loss, pipelined

    with torch.device("meta"):
        model, inputs = DeepMLP(64), (torch.randn(64, 64),)
    plan = automap.plan(model, inputs, DeviceMesh((2,)), loss_fn=mean_square_loss,
                        flops_per_s=1e10)
    traced = trace(model, inputs, loss_fn=mean_square_loss)
    piped = pipelined(plan, traced, [computed_nodes(traced)[3]], world=4, microbatches=2,
                      schedule="1f1b")
    stages = [{"plan": 1, "intra_op_step_s": 2e-3, "intra_op_peak_bytes": 2**20},
              {"plan": 0, "intra_op_step_s": 1e-3, "intra_op_peak_bytes": 2**21}]
    text = dataclasses.replace(piped, solver={**piped.solver,
                                              "pipeline_stage_plans": stages}).explain()
    assert "intra-op plan per stage" in text
    assert "0: #1 (2.000 ms, 1.0 MiB" in text and "1: #0 (1.000 ms, 2.0 MiB" in text
    assert "intra-op plan per stage" not in piped.explain()
