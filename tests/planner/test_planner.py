"""automap.plan end to end: the plans make sense (Megatron when memory is
tight on fast links, data parallel with slow links and ample memory), typed
errors, and the Plan's JSON contract."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import automap
from automap import DeviceMesh, InfeasibleBudgetError, StalePlanError, UnsupportedOpError
from automap.planner.plan import Plan
from automap.planner.search import plan
from planning_models import gpt2_block_case

FAST = DeviceMesh((1, 4), alpha_s=5e-6, bandwidth_bytes_per_s=2e11)  # NVLink-class
SLOW = DeviceMesh((1, 4), alpha_s=5e-5, bandwidth_bytes_per_s=1e10)  # PCIe-class
#: An A100's sustained speeds (dense FLOP/s, memory bandwidth, kernel launch).
A100 = {"flops_per_s": 30e12, "memory_bandwidth_bytes_per_s": 1.5e12, "op_overhead_s": 5e-6}
MiB = 2**20


def _linears(p: Plan):
    return [n for n in p.nodes.values() if n.op == "linear"]  # q, k, v, proj, fc1, fc2


@pytest.fixture(scope="module")
def small_batch_block():
    return gpt2_block_case(batch=2, seq=1024, hidden=1024, heads=16)


def test_megatron_when_memory_is_too_small_for_data_parallelism(small_batch_block):
    model, inputs, loss = small_batch_block
    budget = 160 * MiB  # replicated weights + grads + Adam alone take 192 MiB
    p = plan(model, inputs, FAST, budget, loss_fn=loss, **A100)
    q, k, v, proj, fc1, fc2 = _linears(p)
    for column in (q, k, v, fc1):  # weight rows (output features) split, output split
        assert column.inputs[1] == "S1R" and column.outputs[0] == "RRS1", column
        # Megatron's f: the input gradient is all-reduced in the backward.
        assert column.grad_reduce_axes == [[1], [], []] and not column.partial_axes
    for row in (proj, fc2):  # contraction split: the partial sum is reduced
        assert row.inputs[1] == "RS1" and row.partial_axes == [1], row
        # Megatron's g (an all-reduce), or a reduce-scatter onto the features
        # when the elementwise ops after it are cheaper split.
        assert (row.outputs[0], row.scatter_dim) in (("RRR", None), ("RRS1", 2)), row
        if row.scatter_dim is None:  # the bias gradient is whole (a bias is added)
            assert row.grad_reduce_axes == [[], [], []]
    attention = next(n for n in p.nodes.values() if n.op == "scaled_dot_product_attention")
    assert attention.outputs == ["RS1RR"]  # heads
    forward_reductions = [n.name for n in p.nodes.values() if n.forward_comm_s > 0]
    # One reduction per sub-block (and the loss's scalar, where the ops after
    # fc2 run split).
    assert forward_reductions in ([proj.name, fc2.name], [proj.name, fc2.name, "mean"])
    assert p.predicted_peak_memory_bytes <= budget


def test_data_parallel_with_slow_links_and_ample_memory():
    model, inputs, loss = gpt2_block_case(batch=8, seq=1024, hidden=1024, heads=16)
    p = plan(model, inputs, SLOW, None, loss_fn=loss, **A100)
    for n in _linears(p):
        assert n.inputs[0] == "RS1R" or n.inputs[0] == "S1RR", n  # batch split
        assert n.inputs[1] == "RR"  # weights replicated
        assert n.forward_comm_s == 0 and n.backward_comm_s > 0  # gradient all-reduce
    assert not [e for e in p.edges if e.steps]  # no layout conversion anywhere


def test_infeasible_budget_names_the_smallest(small_batch_block):
    model, inputs, loss = small_batch_block
    with pytest.raises(InfeasibleBudgetError) as err:
        plan(model, inputs, FAST, 10 * MiB, loss_fn=loss)
    smallest = err.value.smallest_feasible_budget_bytes
    assert 10 * MiB < smallest < 160 * MiB
    assert "smallest feasible budget" in str(err.value)
    p = plan(model, inputs, FAST, smallest, loss_fn=loss)
    assert p.predicted_peak_memory_bytes <= smallest


def test_plan_json_round_trip_and_stale_plans(tmp_path, small_batch_block):
    model, inputs, loss = small_batch_block
    p = plan(model, inputs, FAST, None, loss_fn=loss)
    path = tmp_path / "plan.json"
    p.to_json(str(path))
    again = Plan.from_json(str(path))
    assert again.to_dict() == p.to_dict()
    assert "predicted step" in again.explain()
    from automap.trace.tracing import trace

    again.check_matches(trace(model, inputs, loss_fn=loss), FAST)
    other_model, other_inputs, _ = gpt2_block_case(batch=4, seq=1024, hidden=1024, heads=16)
    with pytest.raises(StalePlanError, match="different graph"):
        again.check_matches(trace(other_model, other_inputs, loss_fn=loss))
    with pytest.raises(StalePlanError, match="mesh"):
        again.check_matches(trace(model, inputs, loss_fn=loss), DeviceMesh((2, 2)))
    data = p.to_dict()
    data["schema_version"] = 0
    with pytest.raises(StalePlanError, match="schema"):
        Plan.from_dict(data)


class _Odd(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.cummax(self.fc(x), 1).values.sum()  # no strategy (yet)


def test_unsupported_ops_fall_back_or_raise_when_strict():
    with torch.device("meta"):
        model, x = _Odd(), torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = plan(model, (x,), DeviceMesh((2,)))
    assert any("no sharding generator" in str(w.message) for w in caught)
    assert p.unsupported_ops
    with pytest.raises(UnsupportedOpError) as err:
        plan(model, (x,), DeviceMesh((2,)), strict=True)
    assert err.value.ops


def test_plan_needs_a_mesh():
    model, inputs, loss = gpt2_block_case(batch=1, seq=8, hidden=16, heads=2)
    with pytest.raises(automap.InvalidMeshError):
        plan(model, inputs, None)


def test_follower_merging_costs_little_on_a_gpt2_block(small_batch_block):
    model, inputs, loss = small_batch_block
    exact = plan(model, inputs, FAST, None, loss_fn=loss, merge_followers=False)
    merged = plan(model, inputs, FAST, None, loss_fn=loss)
    assert merged.solver["binaries"] < exact.solver["binaries"]
    assert exact.solver["objective_s"] <= merged.solver["objective_s"] * (1 + 1e-9)
    assert merged.solver["objective_s"] <= exact.solver["objective_s"] * 1.01


class InPlace(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.c = torch.nn.Linear(16, 64), torch.nn.Linear(16, 64)
        self.b = torch.nn.Linear(64, 16)

    def forward(self, x):
        h, g = self.a(x), self.c(x)
        h.add_(g)
        return self.b(h).pow(2).mean()


def test_in_place_ops_read_their_mutated_input_as_produced():
    """h.add_(g): converting h first would be cheapest here (h arrives split by
    rows, g and the consumer want columns), but the generator cannot convert a
    tensor an op writes into; the plan converts g and the result instead."""

    def forced(table, node):
        want = {"linear": ("S0R",), "linear_1": ("RS0",)}.get(node.name)
        if want is not None:
            return [o == want for o in node.out_specs]
        if node.name == "linear_2":
            return [i[0] == "RS0" for i in node.in_specs]
        return [True] * len(node)

    with torch.device("meta"):
        model, x = InPlace(), torch.randn(32, 16)
    p = plan(model, (x,), DeviceMesh((4,)), strategy_filter=forced)
    add = next(n for n in p.nodes.values() if n.op == "add_")
    converted = {e.input_index for e in p.edges if e.consumer == add.name and e.steps}
    assert converted == {1}, p.explain()  # g is converted, h (input 0) is not


@pytest.mark.parametrize("budget_share", [None, 0.8])
def test_a_banned_conversion_is_held_at_zero_and_priced_nothing(budget_share):
    """The in-place op's banned conversions are columns held at 0: their price
    (``_FORBIDDEN_S``) is left out of the LP, whose costs otherwise ran from 1
    to 1e9 (HiGHS: "badly scaled", on the test T5 on (2,))."""
    from automap.solve import ilp as solving
    from automap.solve.strategies import build_strategy_table
    from automap.trace.profiling import profile_traced
    from automap.trace.tracing import trace

    torch.manual_seed(0)
    traced = trace(InPlace(), (torch.randn(32, 16),), loss_fn=lambda loss: loss)
    table = build_strategy_table(traced, profile_traced(traced, "adamw"), DeviceMesh((4,)))
    ilp = solving.ShardingIlp(table)
    fastest = ilp.solve(None)
    budget = None if budget_share is None else budget_share * fastest.peak_memory_bytes
    model = ilp._build(budget)
    cost, upper = np.asarray(model.lp.col_cost_), np.asarray(model.lp.col_upper_)
    assert (upper == 0).any()  # some conversion is banned
    assert not cost[upper == 0].any()
    assert cost.max() < solving._FORBIDDEN_S * 1e6 * 1e-3


def test_a_cluster_json_plans_on_its_best_meshes(tmp_path, small_batch_block):
    """A hand-written cluster JSON (the MAP paper's box): plan tries its top
    meshes and keeps the fastest; the device speeds come from the file."""
    import json

    model, inputs, loss = small_batch_block
    box = {"version": 1, "devices": 8,
           "device": {"kind": "cuda", "name": "A100", "sustained_flops_per_s": 30e12,
                      "memory_bandwidth_bytes_per_s": 1.5e12, "op_overhead_s": 5e-6},
           "tiers": [{"group_size": 2, "alpha_s": 5e-6, "bandwidth_bytes_per_s": 2e11},
                     {"group_size": 4, "alpha_s": 1e-5, "bandwidth_bytes_per_s": 2e10},
                     {"group_size": 8, "alpha_s": 2e-5, "bandwidth_bytes_per_s": 1e10}]}
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(box))
    best = plan(model, inputs, str(path), loss_fn=loss)
    assert {k: best.cost_constants[k] for k in A100} == A100
    candidates = automap.Cluster.from_json(str(path)).meshes()[:3]
    assert best.mesh in candidates
    each = [plan(model, inputs, m, loss_fn=loss, **A100).predicted_step_s
            for m in candidates]
    assert best.predicted_step_s == pytest.approx(min(each))
