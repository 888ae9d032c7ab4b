"""Interleaved 1F1B (issue 18, virtual stages), the planner side: torch's
order of a rank's chunk operations and the in-flight microbatches read from
it, the partition DP over ``n * v`` round-robin chunks against brute force,
the schedule's smaller bubble, typed errors for what torch's schedule cannot
run, and a searched plan whose per-rank peaks are the simulated ones. Meta
tensors, no process group."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch import nn

import automap
from automap import DeviceMesh, InvalidPlanError
from automap.errors import InvalidPipelineError
from automap.generate.pipeline_order import (
    held_at_once,
    held_while_running,
    in_flight_counts,
    schedule_order,
)
from automap.planner.pipeline_chain import Chain, Unit
from automap.planner.pipeline_mesh import cut_mesh
from automap.planner.pipeline_partition import best_partition, schedule_step_s
from automap.planner.plan import Plan
from pipeline_plans import DeepMLP, forged_pipeline, mean_square_loss

SPEEDS = dict(flops_per_s=1e10, memory_bandwidth_bytes_per_s=1e11, op_overhead_s=1e-7)
ALPHA_S, BANDWIDTH = 1e-3, 1e6




def _chain(times, saved, state, out_bytes: float = 1e3) -> Chain:
    units = [Unit(i, i, 0, forward_s=t / 3, backward_s=2 * t / 3, saved_bytes=s,
                  state={(f"p{i}", 0): (b, 0.0)}, out_bytes=out_bytes,
                  out_grad_bytes=out_bytes)
             for i, (t, s, b) in enumerate(zip(times, saved, state))]
    return Chain([f"n{i}" for i in range(len(units))], units, {})


@pytest.mark.parametrize("m, n, v", [(4, 2, 2), (2, 2, 2), (8, 4, 2), (6, 2, 3), (3, 4, 2)])
def test_interleaved_order_is_torchs(m, n, v):
    """Every chunk of a rank runs each microbatch's forward then its backward,
    and the order is the one torch's ScheduleInterleaved1F1B computes."""
    from torch.distributed.pipelining import ScheduleInterleaved1F1B
    from torch.distributed.pipelining.schedules import _ComputationType

    class _Stage:  # what the schedule's order computation reads of its stages
        group_size, group_rank = n, 0

    schedule = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    schedule.pp_group_size, schedule.n_local_stages = n, v
    schedule._n_microbatches = m
    schedule.number_of_rounds = max(1, m // n)
    schedule.microbatches_per_round = m // schedule.number_of_rounds
    for k in range(n):
        ours = schedule_order("interleaved", m, n, k, v)
        theirs = [("F" if a.computation_type == _ComputationType.FORWARD else "B",
                   a.microbatch_index, a.stage_index)
                  for a in schedule._calculate_single_rank_operations(k) if a is not None]
        assert ours == theirs
        chunks = {j for _, _, j in ours}
        assert chunks == {k + n * i for i in range(v)}
        for j in chunks:
            seen = [(kind, i) for kind, i, c in ours if c == j]
            assert sorted(seen) == sorted([("F", i) for i in range(m)]
                                          + [("B", i) for i in range(m)])
            assert all(seen.index(("F", i)) < seen.index(("B", i)) for i in range(m))


@pytest.mark.parametrize("m, n, v", [(8, 2, 3), (8, 4, 2), (4, 2, 2), (6, 2, 3)])
def test_held_at_once_dominates_every_state_of_the_step(m, n, v):
    """Each state of a rank's step (per chunk, microbatches in flight and
    backwards done) is at most one of the holdings, and each holding is a
    state the step reaches."""
    holdings = held_at_once("interleaved", m, n, v)
    for k in range(n):
        mine = list(range(k, n * v, n))
        flight, done, states = dict.fromkeys(mine, 0), dict.fromkeys(mine, 0), set()
        for kind, _, chunk in schedule_order("interleaved", m, n, k, v):
            flight[chunk] += 1 if kind == "F" else -1
            done[chunk] += kind == "B"
            state = (tuple(flight[c] for c in mine), tuple(done[c] for c in mine))
            states.add(state)
            assert any(all(a >= b for a, b in zip(f + d, state[0] + state[1]))
                       for f, d in holdings[k])
        assert set(holdings[k]) <= states
    if (m, n, v) == (8, 2, 3):  # chunks 1, 3, 5 at most 4, 2 and 1, never 7 together
        assert max(sum(f) for f, _ in holdings[1]) == 5


@pytest.mark.parametrize("m, n, v", [(8, 2, 3), (8, 4, 2), (4, 2, 2), (6, 2, 3)])
def test_held_while_running_dominates_each_operation_with_its_chunk(m, n, v):
    """While each operation runs (a forward's state after it, a backward's
    before it), some holding with that chunk running, as far into its
    backwards, holds at least as much; each holding is such a state."""
    for k, holdings in enumerate(held_while_running("interleaved", m, n, v)):
        mine = list(range(k, n * v, n))
        flight, done, states = dict.fromkeys(mine, 0), dict.fromkeys(mine, 0), set()
        for kind, _, chunk in schedule_order("interleaved", m, n, k, v):
            runs = mine.index(chunk)
            before = (tuple(flight[c] for c in mine), tuple(done[c] for c in mine), runs)
            flight[chunk] += 1 if kind == "F" else -1
            done[chunk] += kind == "B"
            after = (tuple(flight[c] for c in mine), tuple(done[c] for c in mine), runs)
            states.add(before if kind == "B" else after)
        for f, d, runs in states:
            assert any(r == runs and (d2[runs] == 0) == (d[runs] == 0)
                       and all(a >= b for a, b in zip(f2 + d2, f + d))
                       for f2, d2, r in holdings), (f, d, runs)
        assert set(holdings) <= states


def test_in_flight_counts():
    assert in_flight_counts("1f1b", 4, 2) == [2, 1]
    assert in_flight_counts("gpipe", 4, 2) == [4, 4]
    # Interleaved: the rank's first chunk warms up longest.
    assert in_flight_counts("interleaved", 4, 2, 2) == [4, 3, 2, 1]


def _rank_peaks(bounds, state, saved, m, n, v, grad=1.0):
    """The exact rank-level peak of a split of ``_chain`` units: while each
    operation torch's order runs, every chunk's state, in-flight activations
    and waiting input gradients, plus the running chunk's output gradient
    received (no transients in these chains; the last chunk receives none)."""
    peaks = []
    for r, holdings in enumerate(held_while_running("interleaved", m, n, v)):
        mine = [(j, bounds[j]) for j in range(r, n * v, n)]
        peaks.append(max(
            sum(state[a:b].sum() + flight[i] * saved[a:b].sum() + (j > 0) * done[i] * grad
                for i, (j, (a, b)) in enumerate(mine))
            + grad * (mine[runs][0] < n * v - 1)
            for flight, done, runs in holdings))
    return peaks


@pytest.mark.parametrize("seed", range(8))
def test_interleaved_partition_is_optimal_against_brute_force(seed):
    """Against every split: the one found fits its ranks' exact peaks and
    reports them; nothing beats it that fits each chunk's most in flight
    (the model before holdings); nothing faster fits the exact peaks."""
    rng = np.random.default_rng(seed)
    k, n, v = 8, 2, 2
    m = int(rng.choice([2, 4]))
    times, saved, state = rng.uniform(0.1, 1, k), rng.uniform(0, 10, k), rng.uniform(0, 10, k)
    budget = float(rng.uniform(40, 100))  # most seeds fit, some tightly
    stages = cut_mesh(DeviceMesh((n,), alpha_s=ALPHA_S, bandwidth_bytes_per_s=BANDWIDTH), n)
    found = best_partition(_chain(times, saved, state, out_bytes=1.0), stages, m,
                           "interleaved", budget, recompute=False, virtual=v)
    flight = in_flight_counts("interleaved", m, n, v)
    chunks = n * v
    weighted = [state.sum() / chunks + f * saved.sum() / chunks for f in flight]
    shares = [[1 / v] * chunks, [w / sum(weighted[j % n::n]) for j, w in enumerate(weighted)]]
    summed_best = exact_best = np.inf
    for cuts in itertools.combinations(range(1, k), chunks - 1):
        bounds = list(zip((0, *cuts), (*cuts, k)))
        t = []
        for j, (a, b) in enumerate(bounds):
            send = (ALPHA_S + 1.0 / BANDWIDTH) * ((j < chunks - 1) + (j > 0))
            t.append(times[a:b].sum() + send)
        step = sum(t) / v + (m * v - 1) * max(t)
        # Each chunk at its most in flight, with its M input gradients and the
        # output gradient it receives, within its share of its rank's budget.
        peaks = [state[a:b].sum() + flight[j] * saved[a:b].sum() + (j > 0) * m
                 + (j < chunks - 1) for j, (a, b) in enumerate(bounds)]
        if any(all(p <= budget * share[j] for j, p in enumerate(peaks)) for share in shares):
            summed_best = min(summed_best, step)
        if max(_rank_peaks(bounds, state, saved, m, n, v)) <= budget:
            exact_best = min(exact_best, step)
    if found is None:
        assert not np.isfinite(summed_best)
        return
    assert found.virtual == v and len(found.bounds) == chunks
    exact = _rank_peaks(found.bounds, state, saved, m, n, v)
    assert found.peak_bytes == pytest.approx([exact[j % n] for j in range(chunks)])
    assert max(exact) <= budget * (1 + 1e-9)
    assert exact_best * (1 - 1e-9) <= found.step_s <= summed_best * (1 + 1e-9)


def test_a_ranks_first_chunk_may_take_more_than_an_equal_share(monkeypatch):
    """4 equal units on 2 ranks x 2 chunks, 4 microbatches: chunk 0 keeps at
    most 4 in flight and chunk 2 (same rank) 2, but never 6 together: rank 0
    holds 2 + 2 of state and 5 microbatches of 1 at most (3 + 2 or 4 + 1).
    Within 9 an equal share (4.5 per chunk) refuses chunk 0's 4 + 2; the
    holdings the schedule reaches take it; the sum of each chunk's most in
    flight (10 on rank 0) would not."""
    from automap.planner import pipeline_partition

    stages = cut_mesh(DeviceMesh((2,)), 2)
    chain = _chain(np.ones(4), np.ones(4), np.full(4, 2.0), out_bytes=0.0)
    assert in_flight_counts("interleaved", 4, 2, 2) == [4, 3, 2, 1]
    found = best_partition(chain, stages, 4, "interleaved", 9.0, recompute=False, virtual=2)
    assert found is not None and found.bounds == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert found.peak_bytes == pytest.approx([9.0, 7.0, 9.0, 7.0])  # per rank
    real = pipeline_partition.holding_sets
    # Each chunk at its most in flight, at either share, finds nothing.
    for kept in (0, 1):
        monkeypatch.setattr(pipeline_partition, "holding_sets",
                            lambda *args, kept=kept: [real(*args)[kept]])
        assert best_partition(chain, stages, 4, "interleaved", 9.0, recompute=False,
                              virtual=2) is None


def test_interleaving_shrinks_the_bubble():
    """Equal chunks of time c, no sends: 1F1B's step is (M + n - 1) v c, the
    interleaved one (M v + n - 1) c."""
    n, m, v = 4, 8, 2
    stages = cut_mesh(DeviceMesh((n,)), n)
    chain = _chain(np.ones(n * v), np.zeros(n * v), np.zeros(n * v), out_bytes=0.0)
    plain = best_partition(chain, stages, m, "1f1b", None)
    inter = best_partition(chain, stages, m, "interleaved", None, virtual=v)
    assert plain.step_s == pytest.approx((m + n - 1) * v)
    assert inter.step_s == pytest.approx(m * v + n - 1)
    assert inter.step_s < plain.step_s
    assert schedule_step_s(3.0, 1.0, 5, 1) == pytest.approx(3 + 4)  # 1F1B's formula


class _Untraceable(nn.Module):
    def forward(self, x):
        raise AssertionError("traced before the pipeline arguments were checked")


def test_microbatches_torch_cannot_interleave_are_refused_before_tracing():
    with torch.device("meta"):
        x = torch.randn(10, 4)
    # 5 microbatches on 2 stages: torch's 2 rounds do not divide them.
    with pytest.raises(InvalidPipelineError, match="cannot run 5 microbatches on 2 stages"):
        automap.plan(_Untraceable(), (x,), DeviceMesh((4,)), loss_fn=mean_square_loss, pipeline=2,
                     microbatches=5, schedule="interleaved", **SPEEDS)


def test_too_few_units_for_the_chunks_is_refused():
    with torch.device("meta"):
        model, x = nn.Linear(16, 16), torch.randn(8, 16)
    # Three units (the linear and the loss's two ops): fewer than 2 stages x 2 chunks.
    with pytest.raises(InvalidPipelineError, match="interleaved 1F1B needs at least 2"):
        automap.plan(model, (x,), DeviceMesh((4,)), loss_fn=mean_square_loss, pipeline=2,
                     microbatches=2, schedule="interleaved", **SPEEDS)


@pytest.fixture(scope="module")
def interleaved_plan():
    with torch.device("meta"):
        model, x = DeepMLP(256), torch.randn(256, 256)
    options = dict(loss_fn=mean_square_loss, pipeline=2, microbatches=4, **SPEEDS)
    plan = automap.plan(model, (x,), DeviceMesh((4,)), schedule="interleaved", **options)
    plain = automap.plan(model, (x,), DeviceMesh((4,)), schedule="1f1b", **options)
    return model, (x,), plan, plain


def test_interleaved_plan_round_robins_chunks(interleaved_plan):
    _, _, plan, plain = interleaved_plan
    pipe = plan.pipeline
    assert pipe.schedule == "interleaved" and pipe.virtual_stages == 2
    assert pipe.stage_count == 2 and pipe.chunk_count == 4
    assert [s.ranks for s in pipe.stages] == [(0, 1), (2, 3), (0, 1), (2, 3)]
    assert [s.index for s in pipe.chunks_of_rank(2)] == [1, 3]
    assert len(pipe.send_s) == 3
    assert plan.predicted_step_s < plain.predicted_step_s
    again = Plan.from_dict(plan.to_dict())
    assert again.pipeline == pipe
    text = plan.explain()
    assert "(interleaved, 2 chunks per rank)" in text and "chunk" in text


def test_interleaved_rank_peaks_are_the_simulated_steps(interleaved_plan):
    from automap.api import first_microbatch
    from automap.generate.simulate_pipeline import simulate_stage
    from automap.planner.reserve import STAGE_HEADROOM, reserved
    from automap.trace.tracing import trace

    model, inputs, plan, _ = interleaved_plan
    assert plan.solver["simulated"]
    traced = trace(model, first_microbatch(inputs, 4), loss_fn=mean_square_loss)
    pipe = plan.pipeline
    for r in range(pipe.stage_count):
        peak = reserved(simulate_stage(traced, plan, r), STAGE_HEADROOM).peak_bytes
        assert {s.predicted_peak_memory_bytes for s in pipe.stages[r::pipe.stage_count]} \
            == {peak}
    assert plan.predicted_peak_memory_bytes == max(s.predicted_peak_memory_bytes
                                                   for s in pipe.stages)



@pytest.mark.parametrize("edit, field", [
    (lambda p: p.update(virtual_stages=3), "pipeline.virtual_stages"),
    (lambda p: p.update(virtual_stages=1), "pipeline.virtual_stages"),
    (lambda p: p.update(schedule="1f1b"), "pipeline.virtual_stages"),
    (lambda p: p["stages"][2].update(ranks=[2, 3]), r"pipeline.stages\[2\].ranks"),
])
def test_a_bad_interleaved_record_is_refused(interleaved_plan, edit, field):
    _, _, plan, _ = interleaved_plan
    with pytest.raises(InvalidPlanError, match=field):
        Plan.from_dict(forged_pipeline(plan, edit))
