"""The intra-op ILP against exhaustive enumeration on random small graphs
(<= 6 nodes, 1-D and 2-D meshes), with and without a memory budget."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from automap import DeviceMesh, InfeasibleBudgetError, enumerate_specs, layout_path
from automap.solve.ilp import solve_ilp
from automap.solve.strategies import NodeOptions, StrategyTable, TensorInfo

SHAPES = [(4, 4), (8, 4), (4,), (8, 2, 2)]


def _random_table(rng: random.Random, mesh: DeviceMesh) -> StrategyTable:
    nodes: dict[str, NodeOptions] = {}
    n = rng.randint(2, 6)
    for i in range(n):
        shape = rng.choice(SHAPES)
        producers = rng.sample(range(i), k=min(i, rng.randint(0, 2)))
        inputs = [(f"n{p}", 0) for p in producers]
        choices = rng.randint(1, 4)
        in_specs, out_specs = [], []
        for _ in range(choices):
            in_specs.append(tuple(str(rng.choice(enumerate_specs(nodes[p].outputs[0].shape, mesh)))
                                  for p, _ in inputs))
            out_specs.append((str(rng.choice(enumerate_specs(shape, mesh))),))
        k = len(in_specs)

        def draw(scale, k=k):
            return np.array([rng.random() * scale for _ in range(k)])

        nodes[f"n{i}"] = NodeOptions(
            f"n{i}", "op", "einsum", inputs, [TensorInfo(shape, 4, True)], in_specs, out_specs,
            draw(1e-5), draw(1e-5), draw(1e-5), draw(100.0), draw(100.0), draw(50.0))
    return StrategyTable(mesh, nodes)


def _brute_force(table: StrategyTable, budget):
    names = list(table.nodes)
    best = (np.inf, None)
    for combo in itertools.product(*(range(len(table.nodes[n])) for n in names)):
        c = dict(zip(names, combo))
        memory = sum(table.nodes[n].persistent_bytes[c[n]] + table.nodes[n].saved_bytes[c[n]]
                     for n in names)
        memory += max(table.nodes[n].transient_bytes[c[n]] for n in names)
        if budget is not None and memory > budget + 1e-6:
            continue
        t = sum(table.nodes[n].time_s[c[n]] for n in names)
        for producer, o, consumer, k in table.edges():
            src = table.nodes[producer].out_specs[c[producer]][o]
            dst = table.nodes[consumer].in_specs[c[consumer]][k]
            t += layout_path(table.mesh, src, dst, table.nodes[producer].outputs[o].shape).cost_s
        best = min(best, (t, c), key=lambda x: x[0])
    return best


@pytest.mark.parametrize("mesh", [DeviceMesh((4,)), DeviceMesh((2, 2), alpha_s=[1e-6, 1e-5])],
                         ids=["4", "2x2"])
@pytest.mark.parametrize("seed", range(12))
def test_ilp_equals_exhaustive_enumeration(mesh, seed):
    rng = random.Random(seed)
    table = _random_table(rng, mesh)
    budget = None if seed % 3 == 0 else rng.uniform(100.0, 700.0)
    best_s, _ = _brute_force(table, budget)
    if not np.isfinite(best_s):
        with pytest.raises(InfeasibleBudgetError) as err:
            solve_ilp(table, budget, merge_followers=False)
        assert err.value.smallest_feasible_budget_bytes > budget
        return
    sol = solve_ilp(table, budget, merge_followers=False)
    assert sol.objective_s == pytest.approx(best_s, rel=1e-6, abs=1e-12)
    if budget is None:  # merging followers restricts the search: never better
        assert solve_ilp(table, None).objective_s >= best_s * (1 - 1e-9)
    if budget is not None:
        assert sol.peak_memory_bytes <= budget + 1e-6


def test_smallest_feasible_budget_is_feasible_and_tight():
    rng = random.Random(99)
    mesh = DeviceMesh((4,))
    table = _random_table(rng, mesh)
    with pytest.raises(InfeasibleBudgetError) as err:
        solve_ilp(table, 1.0, merge_followers=False)
    smallest = err.value.smallest_feasible_budget_bytes
    assert solve_ilp(table, smallest, merge_followers=False).peak_memory_bytes <= smallest
    assert np.isfinite(_brute_force(table, smallest)[0])
    assert not np.isfinite(_brute_force(table, smallest * 0.99 - 1)[0])
