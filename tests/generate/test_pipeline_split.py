"""The pipeline cut of a generated program (no process group: simulated groups):
which values cross each boundary, what each stage holds, and the typed errors
of bad stage ranges and pipeline arguments."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

import pipeline_plans as pp
from automap import DeviceMesh
from automap.api import first_microbatch
from automap.errors import InvalidPipelineError, InvalidPlanError
from automap.generate.build import generate_graph
from automap.generate.pipeline import generate_pipeline
from automap.generate.pipeline_split import cut, shared_parameters, stage_graph, traced_stage_of
from automap.planner.search import plan as solve_plan
from automap.sharding.process_groups import SimulatedGroups
from automap.trace.tracing import default_loss, trace
from speeds import speeds

STARTS = {"mlp": ["fc2", "fc3", "head"],
          "gpt2": ["transformer.h.0", "transformer.h.1", "transformer.ln_f"]}


@functools.cache
def _cut(model_name: str):
    model, _, _, micro = pp.build_case(model_name, 4)
    traced = trace(model, micro, loss_fn=default_loss)
    mesh = DeviceMesh((1,))
    plan = solve_plan(model, micro, mesh, loss_fn=default_loss, **speeds(1e6))
    plan = pp.pipelined(plan, traced, [pp.first_node_in(traced, m) for m in STARTS[model_name]],
                        world=4, microbatches=4, schedule="gpipe")
    out = generate_graph(traced, plan, SimulatedGroups(mesh, 0), 0, "cpu")
    return traced, plan, out, cut(out, traced, plan.pipeline.stages)


def test_targets_are_forwarded_to_the_loss_through_every_stage():
    traced, plan, out, stage_cut = _cut("mlp")
    for k in (1, 2, 3):
        names = [v.name for v in stage_cut.boundaries[k]]
        assert "args_1" in names, (k, names)  # the targets, read by the loss only
        assert len(names) == 2, names  # and one activation
    graphs = [stage_graph(out, stage_cut, k) for k in range(4)]
    assert [len([n for n in g.graph.nodes if n.op == "placeholder"]) for g in graphs] == \
        [2, 2, 2, 2]
    assert sorted(graphs[0].shards) == ["fc1.bias", "fc1.weight"]
    assert sorted(graphs[3].shards) == ["head.bias", "head.weight"]


def test_the_tied_embedding_is_held_by_the_first_and_last_stage():
    traced, plan, out, stage_cut = _cut("gpt2")
    assert shared_parameters(stage_cut, out.shards) == {"transformer.wte.weight": (0, 3)}
    last = stage_graph(out, stage_cut, 3)
    assert "transformer.wte.weight" in last.shards
    assert "transformer.wpe.weight" not in last.shards


def test_bad_stage_ranges_are_refused():
    traced, plan, _, _ = _cut("mlp")
    stages = plan.pipeline.stages
    gap = [stages[0], stages[2], stages[3]]
    with pytest.raises(InvalidPlanError, match="without gaps"):
        traced_stage_of(traced, gap)
    unknown = [SimpleNamespace(first_node="nope", last_node=stages[0].last_node), *stages[1:]]
    with pytest.raises(InvalidPlanError, match="not a computed node"):
        traced_stage_of(traced, unknown)
    with pytest.raises(InvalidPlanError, match="graph has"):
        traced_stage_of(traced, stages[:3])


def test_bad_pipeline_arguments_raise_typed_errors():
    _, plan, _, _ = _cut("mlp")
    for schedule in ("interleaved", "zero_bubble"):
        bad = SimpleNamespace(pipeline=SimpleNamespace(**{**vars(plan.pipeline),
                                                          "schedule": schedule}))
        with pytest.raises(InvalidPipelineError, match="schedule"):
            generate_pipeline(None, bad, None)
    few = SimpleNamespace(pipeline=SimpleNamespace(**{**vars(plan.pipeline), "microbatches": 2,
                                                      "schedule": "1f1b"}))
    with pytest.raises(InvalidPipelineError, match="at least as many microbatches"):
        generate_pipeline(None, few, None)
    x = torch.zeros(6, 3)
    assert first_microbatch({"x": x}, 3)["x"].shape == (2, 3)
    with pytest.raises(InvalidPipelineError, match="divide"):
        first_microbatch((x,), 4)
