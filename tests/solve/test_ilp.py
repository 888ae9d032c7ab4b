"""The intra-op ILP against exhaustive enumeration on random small graphs
(<= 6 nodes, 1-D and 2-D meshes, a parameter among them), with and without a
memory budget: the memory every plan is checked against is
``automap.solve.memory``'s model, which the ILP's rows encode."""

from __future__ import annotations

import inspect
import itertools
import math
import random

import numpy as np
import pytest

from automap import DeviceMesh, InfeasibleBudgetError, enumerate_specs, layout_path
from automap.solve.ilp import ShardingIlp, solve_ilp
from automap.solve.memory import estimate_memory, least_held_bytes, timeline
from automap.solve.strategies import NodeOptions, StrategyTable
from random_tables import random_node

SHAPES = [(4, 4), (8, 4), (4,), (8, 2, 2)]


def _random_table(rng: random.Random, mesh: DeviceMesh) -> StrategyTable:
    nodes: dict[str, NodeOptions] = {}
    n = rng.randint(2, 6)
    for i in range(n):
        shape = rng.choice(SHAPES)
        parameter = i == 0 and rng.random() < 0.5
        producers = [] if parameter else rng.sample(range(i), k=min(i, rng.randint(0, 2)))
        inputs = [(f"n{p}", 0) for p in producers]
        choices = rng.randint(1, 4)
        in_specs, out_specs = [], []
        for _ in range(choices):
            in_specs.append(tuple(str(rng.choice(enumerate_specs(nodes[p].outputs[0].shape, mesh)))
                                  for p, _ in inputs))
            out_specs.append((str(rng.choice(enumerate_specs(shape, mesh))),))
        nodes[f"n{i}"] = random_node(rng, f"n{i}", parameter, inputs, shape, in_specs,
                                     out_specs)
    return StrategyTable(mesh, nodes)


def _brute_force(table: StrategyTable, budget):
    names = list(table.nodes)
    line = timeline(table)
    best = (np.inf, None)
    for combo in itertools.product(*(range(len(table.nodes[n])) for n in names)):
        c = dict(zip(names, combo))
        memory = estimate_memory(table, c, line).peak_bytes
        if budget is not None and memory > budget * (1 + 1e-9):
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
    budget = None if seed % 3 == 0 else rng.uniform(150.0, 600.0)
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
        assert sol.peak_memory_bytes <= budget * (1 + 1e-6)


def test_smallest_feasible_budget_is_feasible_and_tight():
    rng = random.Random(99)
    mesh = DeviceMesh((4,))
    table = _random_table(rng, mesh)
    with pytest.raises(InfeasibleBudgetError) as err:
        solve_ilp(table, 1.0, merge_followers=False)
    smallest = err.value.smallest_feasible_budget_bytes
    assert solve_ilp(table, smallest, merge_followers=False).peak_memory_bytes <= smallest
    assert np.isfinite(_brute_force(table, smallest)[0])
    # Tight: the least peak over every plan (the ILP rounds the budget up to bytes).
    least = min(estimate_memory(table, dict(zip(table.nodes, combo)), timeline(table)).peak_bytes
                for combo in itertools.product(*(range(len(n)) for n in table.nodes.values())))
    assert least <= smallest <= least + 1



@pytest.mark.parametrize("seed", range(16))
def test_lp_dives_fit_the_budget_and_name_a_reachable_least(seed):
    """The large-model path (LP relaxation, dives, least from the LP), forced
    on small random graphs: a plan it returns fits and is no better than the
    optimum; a budget it refuses names a least budget that some plan needs at
    least and that the same solver then meets."""
    rng = random.Random(1000 + seed)
    mesh = DeviceMesh((2, 2), alpha_s=[1e-6, 1e-5])
    table = _random_table(rng, mesh)
    budget = rng.uniform(100.0, 600.0)
    best_s, _ = _brute_force(table, budget)
    ilp = ShardingIlp(table, merge_followers=False, exact_columns=0)
    try:
        sol = ilp.solve(budget)
    except InfeasibleBudgetError as err:
        least = err.smallest_feasible_budget_bytes
        assert least is not None and least > budget
        true_least = min(
            estimate_memory(table, dict(zip(table.nodes, combo)), timeline(table)).peak_bytes
            for combo in itertools.product(*(range(len(n)) for n in table.nodes.values())))
        assert least >= true_least - 1
        assert ilp.solve(least).peak_memory_bytes <= least
        return
    assert sol.peak_memory_bytes <= budget * (1 + 1e-6)
    assert sol.objective_s >= best_s * (1 - 1e-9)
    assert 0.0 <= sol.gap < 1.0


@pytest.mark.parametrize("seed", range(8))
def test_budgets_that_fit_need_no_least_budget_lp(seed, monkeypatch):
    """A budget the unconstrained optimum fits returns it without a solve; a budget
    some plan fits is solved without the (sometimes slow) least-budget LP; the
    least bound is still there for whoever asks."""
    rng = random.Random(2000 + seed)
    mesh = DeviceMesh((2, 2), alpha_s=[1e-6, 1e-5])
    table = _random_table(rng, mesh)
    peaks = [estimate_memory(table, dict(zip(table.nodes, combo)), timeline(table)).peak_bytes
             for combo in itertools.product(*(range(len(n)) for n in table.nodes.values()))]
    ilp = ShardingIlp(table, merge_followers=False, exact_columns=0)
    fastest = ilp.solve(None)
    least_lps = []
    original = ShardingIlp._least_relaxation
    monkeypatch.setattr(ShardingIlp, "_least_relaxation", lambda self, model, *a: least_lps.append(
        inspect.stack()[1].function) or original(self, model, *a))
    budget = (min(peaks) + fastest.peak_memory_bytes) / 2
    if budget < fastest.peak_memory_bytes and any(p <= budget * 0.99 for p in peaks):
        sol = ilp.solve(budget)
        assert sol.peak_memory_bytes <= budget * (1 + 1e-6)
        # (A dive that finds no plan may still look for the least-memory plan.)
        assert "_relaxed" not in least_lps
        assert 0 < ilp.least_bound_bytes() <= min(peaks) + 1

    def no_solver(*args, **kwargs):
        raise AssertionError("HiGHS ran for a budget the fastest plan fits")

    monkeypatch.setattr(ilp, "_run", no_solver)
    loose = ilp.solve(fastest.peak_memory_bytes * 1.01)
    assert loose.choice == fastest.choice
    assert ilp.could_fit(fastest.peak_memory_bytes * 1.001)


def _fresh_decisions(seed: int, fractions):
    """A random table, budgets at ``fractions`` of its fastest plan's peak, and
    whether a fresh instance's LP relaxation may fit each."""
    table = _random_table(random.Random(seed), DeviceMesh((2, 2), alpha_s=[1e-6, 1e-5]))
    fastest = ShardingIlp(table, merge_followers=False, exact_columns=0).solve(None)
    budgets = [fastest.peak_memory_bytes * f for f in fractions]
    return table, budgets, [ShardingIlp(table, merge_followers=False,
                                        exact_columns=0).could_fit(b) for b in budgets]


@pytest.mark.parametrize("seed", range(8))
def test_lp_feasibility_proofs_are_kept_monotone(seed, monkeypatch):
    """Issue 15: the budgeted LP's feasibility is monotone in the budget, so
    one proof decides every smaller budget (infeasible) or every larger one
    (feasible) without HiGHS; each decision is the one a fresh instance
    makes, and ``could_fit`` never needs the least-budget LP to decide."""
    table, budgets, fresh = _fresh_decisions(3000 + seed, (0.05, 0.2, 0.4, 0.6, 0.8, 0.95))
    assert fresh == sorted(fresh)  # monotone: False ... False True ... True
    ilp = ShardingIlp(table, merge_followers=False, exact_columns=0)
    least_lps = []
    original = ShardingIlp._least_relaxation
    monkeypatch.setattr(ShardingIlp, "_least_relaxation",
                        lambda self, model, *a: least_lps.append(1) or original(self, model, *a))
    order = [2, 5, 0, 4, 1, 3]
    decided = {}
    for i in order:
        decided[i] = ilp.could_fit(budgets[i])
    assert [decided[i] for i in range(len(budgets))] == fresh
    assert not least_lps
    # What was proved is kept: no HiGHS run for the budgets it decides.
    monkeypatch.setattr(ilp, "_run", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("HiGHS ran for a budget already decided")))
    if False in fresh:
        infeasible = budgets[fresh.index(True) - 1] if True in fresh else budgets[-1]
        assert not ilp.could_fit(infeasible * 0.999)
    if True in fresh:
        assert ilp.could_fit(budgets[fresh.index(True)] * 1.001)


@pytest.mark.parametrize("seed", [0, 1, 3, 4, 5, 6])
def test_a_feasible_rungs_optimum_is_set_aside_while_smaller_rungs_are_probed(seed,
                                                                           monkeypatch):
    """Issue 15: the ladder's bisection proves a rung feasible, probes smaller
    ones, then solves the lowest that fits: that rung's relaxation is not
    solved again (its instance was set aside, solver state and all), so the
    solve runs HiGHS as often, and finds the same, as right after the proof."""
    table, budgets, fresh = _fresh_decisions(3000 + seed, (0.05, 0.2, 0.4, 0.6, 0.8, 0.95))
    assert True in fresh and fresh.index(True) > 0
    fits, under = budgets[fresh.index(True)], budgets[fresh.index(True) - 1]
    runs = []
    original = ShardingIlp._run
    monkeypatch.setattr(ShardingIlp, "_run", lambda self, *a, **k: runs.append(1) or
                        original(self, *a, **k))

    def solved(ilp):
        del runs[:]
        try:
            found = ilp.solve(fits)
            return found.choice, found.objective_s, len(runs)
        except InfeasibleBudgetError as err:
            return str(err), len(runs)

    straight = ShardingIlp(table, merge_followers=False, exact_columns=0)
    assert straight.could_fit(fits)
    probed = ShardingIlp(table, merge_followers=False, exact_columns=0)
    assert probed.could_fit(fits) and not probed.could_fit(under)
    assert solved(probed) == solved(straight)


def _recorded_runs(monkeypatch) -> list:
    """Every HiGHS run of every ``ShardingIlp``: (iteration limit asked for,
    the time limit it was given past the run time before it, its simplex
    iteration limit, status, iterations)."""
    runs = []
    original = ShardingIlp._run

    def run(self, h, iterations=None):
        before = h.getRunTime()
        status = original(self, h, iterations=iterations)
        runs.append((iterations, h.getOptionValue("time_limit")[1] - before,
                     h.getOptionValue("simplex_iteration_limit")[1], status,
                     h.getInfo().simplex_iteration_count))
        return status
    monkeypatch.setattr(ShardingIlp, "_run", run)
    return runs


@pytest.mark.parametrize("seed", range(8))
def test_quick_lp_probes_stop_on_iterations_not_on_the_clock(seed, monkeypatch):
    """Issue 15: a quick probe is cut short by a simplex iteration limit and
    gets the whole time limit, so what it proves, and the path the search
    takes after it, do not depend on the machine's load: the same runs, to
    the iteration, under a time limit of 5 s and of 5,000 s, and the same
    decisions as probes never cut short."""
    from automap.solve import ilp as ilp_module

    table, budgets, uncut = _fresh_decisions(4000 + seed, (0.6, 0.2, 0.95, 0.4, 0.8, 0.05))
    # One iteration per probe: most are cut short.
    monkeypatch.setattr(ilp_module, "QUICK_LP_WORK", 1e-9)
    monkeypatch.setattr(ilp_module, "QUICK_LP_MIN_ITERATIONS", 1)
    runs = _recorded_runs(monkeypatch)
    decided, sequences = [], []
    for limit_s in (5.0, 5000.0):
        runs.clear()
        ilp = ShardingIlp(table, merge_followers=False, exact_columns=0, time_limit_s=limit_s)
        decided.append([ilp.could_fit(b) for b in budgets])
        probes = [r for r in runs if r[0] is not None]
        assert all(r[0] == 1 and r[2] == 1 for r in probes)  # the iteration limit asked for
        assert all(r[1] == pytest.approx(limit_s) for r in runs)  # never a share of the clock
        assert all(r[2] == 2**31 - 1 for r in runs if r[0] is None)  # full runs: no limit
        sequences.append([(r[0], r[3], r[4]) for r in runs])
    assert decided[0] == decided[1] == uncut
    assert sequences[0] == sequences[1]



@pytest.mark.parametrize("seed", range(6))
def test_a_least_budget_lp_cut_short_is_resumed_where_the_least_is_asked(seed, monkeypatch):
    """Issue 15: where a probe does not decide a budget, the least-budget LP
    runs for no more than the probe's work, once (the test T5 on (2,2,2): it
    ran into the 60 s limit before the budget's own LP decided in 17 s); the
    budget is decided as by a fresh instance, and the least bound asked for
    later resumes that LP to the bound a fresh instance finds."""
    from automap.solve import ilp as ilp_module

    table, budgets, uncut = _fresh_decisions(5000 + seed, (0.6, 0.2, 0.95, 0.05))
    fresh_bound = ShardingIlp(table, merge_followers=False, exact_columns=0)
    fresh_bound.could_fit(budgets[0])
    expected = fresh_bound.least_bound_bytes()
    monkeypatch.setattr(ilp_module, "QUICK_LP_WORK", 1e-9)
    monkeypatch.setattr(ilp_module, "QUICK_LP_MIN_ITERATIONS", 1)
    capped = []
    original = ShardingIlp._least_relaxation

    def least(self, model, iterations=None):
        h = original(self, model, iterations)
        if iterations is not None:
            capped.append((h.getInfo().simplex_iteration_count, model.least_ended))
        return h
    monkeypatch.setattr(ShardingIlp, "_least_relaxation", least)
    ilp = ShardingIlp(table, merge_followers=False, exact_columns=0)
    assert [ilp.could_fit(b) for b in budgets] == uncut
    [(iterations, ended)] = capped  # run once, under the guard
    assert iterations <= 1 and not ended  # cut short at the probe's work
    assert ilp._least_bound_bytes == 0.0  # no bound from an LP cut short
    assert ilp.least_bound_bytes() == pytest.approx(expected, rel=1e-6)
    assert ilp._budgeted.least_ended


@pytest.mark.parametrize("seed", range(6))
def test_a_stalled_dive_step_is_cut_short_and_undone(seed, monkeypatch):
    """Every LP solve of a dive runs under its own time cap (at least
    ``DIVE_STEP_MIN_S``, at most ``DIVE_STEP_FACTOR`` times the dive's slowest
    solve so far, never over the time limit); one that reaches it is a fix that
    failed: undone, and the dive goes on to a plan that fits."""
    from automap.solve import ilp as ilp_module

    rng = random.Random(3000 + seed)
    table = _random_table(rng, DeviceMesh((2, 2), alpha_s=[1e-6, 1e-5]))
    peaks = [estimate_memory(table, dict(zip(table.nodes, combo)), timeline(table)).peak_bytes
             for combo in itertools.product(*(range(len(n)) for n in table.nodes.values()))]
    ilp = ShardingIlp(table, merge_followers=False, exact_columns=0, time_limit_s=60.0)
    fastest = ilp.solve(None)
    caps, stalled = [], []
    original = ShardingIlp._run

    def run(self, h, iterations=None, seconds=None):
        if seconds is not None:
            caps.append(seconds)
            if not stalled:  # the dive's first solve stalls: its cap is reached at once
                stalled.append(True)
                return original(self, h, iterations, seconds=0.0)
        return original(self, h, iterations, seconds)

    monkeypatch.setattr(ShardingIlp, "_run", run)
    budget = (min(peaks) + fastest.peak_memory_bytes) / 2
    try:
        sol = ilp.solve(budget)
    except InfeasibleBudgetError:
        return  # no plan between the LP bound and the plans known: nothing to dive to
    assert sol.peak_memory_bytes <= budget * (1 + 1e-6)
    assert all(ilp_module.DIVE_STEP_MIN_S <= cap <= max(
        ilp_module.DIVE_STEP_MIN_S, ilp_module.DIVE_STEP_FACTOR * 60.0) for cap in caps)


@pytest.mark.parametrize("seed", range(4))
def test_memory_rows_are_quantized_upper_bounds_whatever_the_first_budget(seed):
    """Memory-row coefficients are multiples of ``MEMORY_QUANTUM`` x the
    state's least bytes (HiGHS's dual simplex stalled on 1e-9 ones), the
    same bytes whatever budget built the rows, so the least budget does not
    depend on the first budget asked; and a budget the rows accept is one the
    memory model accepts: rounding only ever over-estimates."""
    from automap.solve import ilp as ilp_module

    rng = random.Random(4000 + seed)
    table = _random_table(rng, DeviceMesh((2, 2), alpha_s=[1e-6, 1e-5]))
    peaks = [estimate_memory(table, dict(zip(table.nodes, combo)), timeline(table)).peak_bytes
             for combo in itertools.product(*(range(len(n)) for n in table.nodes.values()))]
    leasts = set()
    for first in (max(peaks), 10 * max(peaks), 1.0):
        ilp = ShardingIlp(table, merge_followers=False)
        with pytest.raises(InfeasibleBudgetError) as err:
            ilp.solve(first) if first == 1.0 else (ilp.solve(first), ilp.solve(1.0))
        leasts.add(err.value.smallest_feasible_budget_bytes)
        model = ilp._budgeted
        quantum = ilp_module.MEMORY_QUANTUM * max(1.0, least_held_bytes(
            table, ilp.node_weight, ilp.index)) / model.mem_unit
        values = np.abs(np.asarray(model.lp.a_matrix_.value_))
        assert values[values > 0].min() >= min(1.0, quantum) * (1 - 1e-9)
    assert len(leasts) == 1
    for budget in sorted(peaks)[::3]:
        try:
            sol = ShardingIlp(table, merge_followers=False).solve(budget)
        except InfeasibleBudgetError:
            continue
        assert sol.peak_memory_bytes <= budget * (1 + 1e-9)


class _StubHighs:
    """A HiGHS instance that answers ``statuses`` run by run (for ``_run``)."""

    def __init__(self, statuses, seconds_per_run=0.1):
        self.statuses, self.runs, self.cleared, self.clock = list(statuses), 0, [], 0.0
        self.seconds_per_run, self.options = seconds_per_run, {}

    def getRunTime(self):
        return self.clock

    def setOptionValue(self, name, value):
        self.options[name] = value

    def run(self):
        self.runs += 1
        self.clock += self.seconds_per_run

    def clearSolver(self):
        self.cleared.append(self.runs)

    def getModelStatus(self):
        return self.statuses[min(self.runs, len(self.statuses)) - 1]


def test_an_undecided_lp_run_is_run_again_from_scratch_unperturbed_then_as_before():
    """HiGHS's "Unknown" and "Not Set" (numerical trouble, a run that ended on
    an error) are no answers: the run starts again from scratch without the dual
    simplex's cost perturbation (where a perturbed run stalled), then from
    scratch as before, within the same limits; the perturbation is restored
    for later runs; limits and answers are returned as they are."""
    import highspy

    status = highspy.HighsModelStatus
    perturbation = "dual_simplex_cost_perturbation_multiplier"
    ilp = ShardingIlp(_random_table(random.Random(0), DeviceMesh((4,))), time_limit_s=60.0)
    seen = []

    class Recording(_StubHighs):
        def run(self):
            seen.append(self.options.get(perturbation, 1.0))
            super().run()

    unperturbed = Recording([status.kUnknown, status.kInfeasible])
    assert ilp._run(unperturbed) == status.kInfeasible
    assert (unperturbed.runs, unperturbed.cleared, seen) == (2, [1], [1.0, 0.0])
    assert unperturbed.options[perturbation] == 1.0
    seen.clear()
    fresh = Recording([status.kNotset, status.kUnknown, status.kOptimal])
    assert ilp._run(fresh) == status.kOptimal
    assert (fresh.runs, fresh.cleared, seen) == (3, [1, 2], [1.0, 0.0, 1.0])
    for stop in (status.kTimeLimit, status.kIterationLimit, status.kOptimal):
        once = _StubHighs([stop, status.kOptimal])
        assert ilp._run(once, iterations=10) == stop and once.runs == 1
    spent = _StubHighs([status.kUnknown, status.kOptimal], seconds_per_run=2.0)
    assert ilp._run(spent, seconds=1.0) == status.kUnknown and spent.runs == 1


@pytest.mark.parametrize("seed", range(8))
def test_the_objective_ceiling_is_above_every_plan_and_changes_no_decision(seed, monkeypatch):
    """Issue 15: budgeted relaxations stop where the dual simplex's objective
    passes ``objective_ceiling`` ("Bound on objective reached"), taken as proof
    that no plan fits. Sound: the costliest plan (exhaustive) costs less than
    half the ceiling, which is no looser than every column at its costliest
    bound; and every fit or no-fit decision is the one made without a ceiling."""
    import dataclasses

    import highspy

    from automap.solve import ilp as ilp_module

    table, budgets, with_ceiling = _fresh_decisions(
        5000 + seed, (0.05, 0.2, 0.4, 0.6, 0.8, 0.95, 1.2))
    ilp = ShardingIlp(table, merge_followers=False, exact_columns=0)
    ilp.could_fit(budgets[-1])
    model = ilp._budgeted
    ceiling = model.objective_ceiling()
    assert np.isfinite(ceiling)
    assert ceiling <= dataclasses.replace(model, costliest_plan_s=math.inf).objective_ceiling()
    names = list(table.nodes)
    costliest_s = 0.0
    for combo in itertools.product(*(range(len(table.nodes[n])) for n in names)):
        c = dict(zip(names, combo))
        t = sum(table.nodes[n].time_s[c[n]] for n in names)
        for producer, o, consumer, k in table.edges():
            src = table.nodes[producer].out_specs[c[producer]][o]
            dst = table.nodes[consumer].in_specs[c[consumer]][k]
            t += layout_path(table.mesh, src, dst, table.nodes[producer].outputs[o].shape).cost_s
        costliest_s = max(costliest_s, t)
    assert costliest_s * 1e6 < ceiling / 2

    monkeypatch.setattr(ilp_module._Model, "objective_ceiling", lambda self: highspy.kHighsInf)
    without = [ShardingIlp(table, merge_followers=False, exact_columns=0).could_fit(b)
               for b in budgets]
    assert with_ceiling == without


@pytest.mark.parametrize("seed", range(8))
def test_a_dive_stops_where_it_cannot_beat_a_known_plan(seed, monkeypatch):
    """Issue 15: a dive at a larger budget than one already solved is cut off
    at the best known fitting plan's objective less the MIP gap (a fix that
    reaches it fails as an infeasible one does), so the plan returned is never
    worse than the known one and no better than the optimum; the relaxation's
    objective bound is the ceiling again afterwards, and a dive whose root is
    already at the cutoff runs no LP."""
    rng = random.Random(5000 + seed)
    table = _random_table(rng, DeviceMesh((2, 2), alpha_s=[1e-6, 1e-5]))
    ilp = ShardingIlp(table, merge_followers=False, exact_columns=0)
    fastest = ilp.solve(None)
    peaks = [estimate_memory(table, dict(zip(table.nodes, combo)), timeline(table)).peak_bytes
             for combo in itertools.product(*(range(len(n)) for n in table.nodes.values()))]
    low = (min(peaks) + fastest.peak_memory_bytes) / 2
    try:
        known = ilp.solve(low)
    except InfeasibleBudgetError:
        return
    high = (low + fastest.peak_memory_bytes) / 2
    best_s, _ = _brute_force(table, high)
    sol = ilp.solve(high)
    assert best_s * (1 - 1e-9) <= sol.objective_s <= known.objective_s * (1 + 1e-9)
    model = ilp._budgeted
    if model is None or model.relaxed is None:
        return  # the fastest plan is also the leanest: nothing was dived
    assert model.relaxed.getOptionValue("objective_bound")[1] == model.objective_ceiling()
    root = float(model.relaxed.getInfo().objective_function_value)
    runs = []
    monkeypatch.setattr(ilp, "_run", lambda *a, **k: runs.append(1))
    assert ilp._dive(model, model.relaxed, np.zeros(model.lp.num_col_), root) is None
    assert not runs


def test_a_highs_scheduler_started_elsewhere_in_the_process_does_not_stop_the_solve():
    """HiGHS keeps one thread scheduler per process; one started by another
    highspy user with its default threads made every automap solve return
    "Not Set" (raised as a time limit) until the scheduler was reset."""
    import highspy

    highspy.Highs.resetGlobalScheduler(True)  # as in a fresh process
    other = highspy.Highs()
    other.setOptionValue("output_flag", False)
    other.setOptionValue("threads", 2)
    other.addVars(1, np.zeros(1), np.ones(1))
    other.run()
    assert other.getModelStatus() == highspy.HighsModelStatus.kOptimal
    table = _random_table(random.Random(0), DeviceMesh((4,)))
    assert ShardingIlp(table).solve(None).status == "Optimal"
