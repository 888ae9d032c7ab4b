"""The planner prices the data-parallel gradient buckets the program runs: for
each plan, the parameters whose gradients the generated graph leaves to the
bucketed sync (``generate.build.defer_parameter_gradient_sync``) and their
mesh axes are those ``solve.gradient_buckets.deferred_gradients`` finds on the
strategy table, also for parameters reached through parts of the graph
computed from state alone (a position table, a cast, a gate). Single process:
the graph is generated for one rank with simulated groups."""

from __future__ import annotations

import pytest
import torch

from automap import DeviceMesh
from automap.checkpoint.chain import choice_of_plan
from automap.generate.build import defer_parameter_gradient_sync, generate_graph
from automap.sharding.process_groups import SimulatedGroups
from automap.solve.gradient_buckets import deferred_gradients
from automap.solve.strategies import build_strategy_table
from automap.trace.profiling import profile_traced
from forced_plans import forced_plan
from generate_workers import FORCED
from serial import build

CASES = [
    ("state_parts", "dp", (2, 2)),
    ("state_parts", "dp", (4,)),
    ("state_parts", "solver_slow", (2, 2)),
    ("state_parts_whole_loss", "dp", (2, 2)),
    ("gpt2", "dp_tokens", (2, 2)),
    ("gpt2", "vocab", (4,)),
    ("mlp", "megatron", (4,)),
    ("mlp", "2d", (2, 2)),
]


def _deferred(model_name: str, kind: str, mesh_shape) -> tuple[dict, dict]:
    model, inputs, loss_fn = build(model_name)
    mesh = DeviceMesh(mesh_shape)
    if kind == "solver_slow":
        traced, plan = forced_plan(model, inputs, loss_fn, mesh)
    else:
        traced, plan = forced_plan(model, inputs, loss_fn, mesh, **FORCED[kind](mesh))
    table = build_strategy_table(traced, profile_traced(traced, "adamw"), mesh)
    planned = {name: tuple(axes) for name, (axes, _) in
               deferred_gradients(table, choice_of_plan(table, plan)).items()}
    rank = mesh.ranks[-1]
    out = generate_graph(traced, plan, SimulatedGroups(mesh, rank, "gloo"), rank,
                         torch.device("cpu"))
    generated = {traced.parameters[name].node: tuple(axes)
                 for name, axes in defer_parameter_gradient_sync(out)
                 if traced.parameters[name].requires_grad}
    return planned, generated


@pytest.mark.parametrize("model_name, kind, mesh_shape", CASES)
def test_planner_and_program_bucket_the_same_gradients(model_name, kind, mesh_shape):
    planned, generated = _deferred(model_name, kind, mesh_shape)
    assert planned == generated


def test_parts_computed_from_state_alone_are_bucketed():
    planned, generated = _deferred("state_parts", "dp", (2, 2))
    # Every parameter: the position table (read through arange's lookup, scaled),
    # the scale (read directly and in that part) and the gate (through a sigmoid).
    assert len(planned) == 7 and set(planned.values()) == {(0, 1)}


def test_a_part_read_whole_is_not_bucketed():
    planned, generated = _deferred("state_parts_whole_loss", "dp", (2, 2))
    # The position table's part is also read whole (a penalty the loss adds):
    # its parameters, the table and the scale it shares, keep their all-reduces.
    assert planned == generated
    assert not any("pos" in name or "scale" in name for name in planned)
    assert any("gate" in name for name in planned)
