"""The ILP's flow edges (``ShardingIlp(edge_formulation="flow")``, and
``"flow-memory"`` under a budget; issue 15):
an edge's conversions routed through the network of its optimal paths' single
steps price every (fractional) choice of the two nodes' strategies as the
transport block of spec pairs does, so the unconstrained optimum is the
same, from far fewer columns on 3-D meshes."""

from __future__ import annotations

import math
import random

import highspy
import numpy as np
import pytest

from automap import DeviceMesh, InfeasibleBudgetError, InvalidArgumentError, enumerate_specs, plan
from automap.sharding.layout import conversion_network, resharding_cost_matrix
from automap.solve.ilp import ShardingIlp
from automap.solve.strategies import NodeOptions, StrategyTable
from model_matrix import build
from random_tables import random_node

MESH = DeviceMesh((2, 2, 2), alpha_s=[1e-5, 5e-6, 2e-6],
                  bandwidth_bytes_per_s=[2.5e10, 1e11, 2e11])


def _lp_value(cost, rows, lower, upper) -> float:
    """min cost @ x over 0 <= x, lower <= rows @ x <= upper (dense, small)."""
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    n = len(cost)
    h.addVars(n, np.zeros(n), np.full(n, highspy.kHighsInf))
    h.changeColsCost(n, np.arange(n, dtype=np.int32), np.asarray(cost, dtype=np.float64))
    for row, lo, hi in zip(rows, lower, upper):
        idx = np.flatnonzero(row).astype(np.int32)
        h.addRow(lo, hi, len(idx), idx, row[idx])
    h.run()
    assert h.getModelStatus() == highspy.HighsModelStatus.kOptimal
    return h.getInfo().objective_function_value


@pytest.mark.parametrize("seed", range(6))
def test_the_flow_over_optimal_steps_costs_what_the_transport_costs(seed):
    """For random fractional supplies (the producer's strategy weights) and
    demands (the consumer's), the min-cost flow over ``conversion_network``
    equals the min-cost transport with ``resharding_cost_matrix``'s costs."""
    rng = random.Random(seed)
    shape = rng.choice([(8, 4), (4, 8, 16), (8, 8, 2)])
    specs = [str(s) for s in enumerate_specs(shape, MESH)]
    srcs, dsts = rng.sample(specs, min(12, len(specs))), rng.sample(specs, min(12, len(specs)))
    supply = np.array([rng.random() for _ in srcs])
    supply /= supply.sum()
    demand = np.array([rng.random() for _ in dsts])
    demand /= demand.sum()
    r = resharding_cost_matrix(MESH, srcs, dsts, shape) * 1e6
    na, nb = r.shape
    transport_rows = [np.kron(np.eye(na)[i], np.ones(nb)) for i in range(na)] + \
                     [np.kron(np.ones(na), np.eye(nb)[j]) for j in range(nb)]
    transport = _lp_value(r.ravel(), transport_rows, np.r_[supply, demand],
                          np.r_[supply, demand])
    net = conversion_network(MESH, srcs, dsts, shape)
    balance = np.zeros(net.num_specs)
    np.add.at(balance, net.src_pos, supply)
    np.add.at(balance, net.dst_pos, -demand)
    incidence = np.zeros((net.num_specs, len(net.arc_cost_s)))
    incidence[net.arc_from, np.arange(len(net.arc_cost_s))] += 1.0
    incidence[net.arc_to, np.arange(len(net.arc_cost_s))] -= 1.0
    # out - in = supply - demand at each spec (a spec both sends and receives
    # where the producer and the consumer may both choose it).
    flow = _lp_value(net.arc_cost_s * 1e6, list(incidence), balance, balance)
    assert flow == pytest.approx(transport, rel=1e-9, abs=1e-9)


def test_an_unknown_edge_formulation_is_refused():
    with pytest.raises(InvalidArgumentError, match="edge_formulation"):
        ShardingIlp(None, edge_formulation="transport")  # checked before the table


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["gpt2", "resnet"])
def test_flow_edges_plan_what_pair_edges_plan(name, monkeypatch):
    """The same unconstrained plan (step time, peak) from fewer edge columns."""
    from automap.solve import ilp

    model, inputs, loss_fn = build(name)
    got = {}
    for form in ("pairs", "flow"):
        monkeypatch.setattr(ilp, "EDGE_FORMULATION", form)
        p = plan(model, inputs, MESH, loss_fn=loss_fn, flops_per_s=1e14,
                 memory_bandwidth_bytes_per_s=1e12)
        got[form] = (p.predicted_step_s, p.predicted_peak_memory_bytes,
                     p.solver["edge_variables"])
    assert got["flow"][0] == pytest.approx(got["pairs"][0], rel=1e-9)
    assert got["flow"][1] == pytest.approx(got["pairs"][1], rel=1e-9)
    assert got["flow"][2] < got["pairs"][2] / 3


def _wide_table(rng: random.Random) -> StrategyTable:
    """A random chain-with-skips of 4 nodes whose activations have many specs
    on the 3-D mesh (so edges get flow networks), a parameter first."""
    specs = {shape: [str(s) for s in enumerate_specs(shape, MESH)]
             for shape in [(8, 8, 4), (16, 8)]}
    nodes: dict[str, NodeOptions] = {}
    for i in range(4):
        shape = rng.choice(list(specs))
        parameter = i == 0
        producers = [] if parameter else rng.sample(range(i), k=min(i, rng.randint(1, 2)))
        inputs = [(f"n{p}", 0) for p in producers]
        k = rng.randint(20, 26)
        in_specs = [tuple(rng.choice(specs[nodes[f"n{p}"].outputs[0].shape]) for p in producers)
                    for _ in range(k)]
        out_specs = [(rng.choice(specs[shape]),) for _ in range(k)]
        nodes[f"n{i}"] = random_node(rng, f"n{i}", parameter, inputs, shape, in_specs,
                                     out_specs)
    return StrategyTable(MESH, nodes)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", range(8))
def test_under_a_budget_flow_memory_edges_have_the_exact_optimum_of_pair_edges(seed, monkeypatch):
    """Branch and bound on both formulations (no dives): the same optimum, or
    the same infeasibility and least budget, the flow build from fewer edge
    columns (its activation edges' buffers counted by shard-count class)."""
    from automap.solve import ilp

    monkeypatch.setattr(ilp, "BUDGETED_FLOW_SHRINK", 1.0)  # every smaller network
    rng = random.Random(seed)
    table = _wide_table(rng)
    free = ShardingIlp(table, merge_followers=False).solve(None).peak_memory_bytes
    budget = free * rng.uniform(0.3, 1.0)
    got = {}
    for form in ("pairs", "flow-memory"):
        ilp = ShardingIlp(table, merge_followers=False, exact_columns=math.inf,
                          edge_formulation=form)
        try:
            sol = ilp.solve(budget)
            got[form] = (sol.objective_s, sol.num_edge_variables)
            assert sol.peak_memory_bytes <= budget * (1 + 1e-6)
        except InfeasibleBudgetError as err:
            got[form] = ("infeasible", err.smallest_feasible_budget_bytes)
    flow, pairs = got["flow-memory"], got["pairs"]
    if pairs[0] == "infeasible":
        assert flow[0] == "infeasible"
        assert flow[1] == pytest.approx(pairs[1], rel=1e-6)
        return
    assert flow[0] == pytest.approx(pairs[0], rel=1e-5)
    assert flow[1] < pairs[1]


@pytest.mark.timeout(600)
def test_flow_memory_edges_plan_the_test_gpt2_within_a_budget_as_pair_edges(monkeypatch):
    """Opt-in flow edges under a budget: on the test GPT-2 at half its
    unconstrained peak on (2,2,2) the plan fits and is within the issue's
    0.5 % of the pair formulation's (the dives take other paths: here 0.30 %
    faster; on the test BERT 0.36 % slower, why it is not the default)."""
    from automap.solve import ilp

    model, inputs, loss_fn = build("gpt2")
    options = dict(loss_fn=loss_fn, flops_per_s=1e14, memory_bandwidth_bytes_per_s=1e12,
                   op_overhead_s=5e-6)
    budget = 0.5 * plan(model, inputs, MESH, **options).predicted_peak_memory_bytes
    got = {}
    for form in ("pairs", "flow-memory"):
        monkeypatch.setattr(ilp, "EDGE_FORMULATION", form)
        p = plan(model, inputs, MESH, budget, **options)
        assert p.predicted_peak_memory_bytes <= budget
        got[form] = p.predicted_step_s
    assert got["flow-memory"] == pytest.approx(got["pairs"], rel=5e-3)
