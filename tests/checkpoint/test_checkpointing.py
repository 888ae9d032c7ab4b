"""Single-device activation checkpointing: linearized stages priced from the
profile, rotor schedules within shrinking budgets (predicted memory; measured
memory needs the generator's checkpoint blocks, issue 6)."""

from __future__ import annotations

import logging
import warnings

import pytest

import model_zoo
from automap import InfeasibleBudgetError
from automap.checkpoint.chain import build_chain, solve_checkpointing
from automap.trace.profiling import profile_traced
from automap.trace.tracing import trace

logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture(scope="module")
def chain():
    warnings.simplefilter("ignore")
    model, inputs, loss = model_zoo.gpt2("meta")
    traced = trace(model, inputs, loss_fn=loss)
    return build_chain(traced, profile_traced(traced), flops_per_s=1e12)


def test_chain_quantities_are_consistent(chain):
    n = len(chain.stages)
    assert n > 4  # a stage per cut whose tensor the next stage keeps
    assert all(len(v) == n for v in (chain.fwd_compute_s, chain.bwd_compute_s, chain.out_bytes,
                                     chain.saved_bytes, chain.fwd_tmp_bytes,
                                     chain.save_fwd_tmp_bytes, chain.bwd_tmp_bytes))
    assert all(s >= o for s, o in zip(chain.saved_bytes, chain.out_bytes))
    assert sum(chain.bwd_compute_s) > sum(chain.fwd_compute_s) > 0


def test_smaller_budgets_trade_time_for_memory(chain):
    unlimited = solve_checkpointing(chain, 10**12)
    assert not unlimited.blocks and unlimited.recompute_time_s < 1e-9 * unlimited.predicted_time_s
    peak = unlimited.peak_memory_bytes
    previous = 0.0
    for fraction in (0.8, 0.65, 0.5):
        budget = int(peak * fraction)
        try:
            schedule = solve_checkpointing(chain, budget)
        except InfeasibleBudgetError:
            break
        assert schedule.peak_memory_bytes <= budget
        assert schedule.recompute_time_s >= previous and schedule.blocks
        previous = schedule.recompute_time_s
    assert previous > 0


def test_infeasible_budget_names_the_least(chain):
    with pytest.raises(InfeasibleBudgetError) as err:
        solve_checkpointing(chain, 1000)
    least = err.value.smallest_feasible_budget_bytes
    assert least > 1000
    assert solve_checkpointing(chain, least).peak_memory_bytes <= least


def _gpt2_on(mesh_shape, **options):
    from automap import DeviceMesh
    from automap.planner.search import plan_traced
    from automap.solve.strategies import build_strategy_table

    warnings.simplefilter("ignore")
    model, inputs, loss = model_zoo.gpt2("meta")
    traced = trace(model, inputs, loss_fn=loss)
    profile = profile_traced(traced)
    mesh = DeviceMesh(mesh_shape, backend="gloo")  # CPU plans, also where a GPU is in view
    plan = plan_traced(traced, profile, mesh, flops_per_s=1e9, **options)
    table = build_strategy_table(traced, profile, mesh, flops_per_s=1e9)
    return traced, profile, table, plan


def test_chain_of_a_parallel_plan_prices_its_communication():
    """The stages' compute and communication add up to the plan's step time
    (conversions to the replicated outputs aside); forwards carry collectives."""
    from automap.checkpoint.chain import chain_of_plan, choice_of_plan

    traced, profile, table, plan = _gpt2_on((4,))
    chain = chain_of_plan(traced, profile, table, choice_of_plan(table, plan))
    comm = sum(chain.fwd_comm_s) + sum(chain.bwd_comm_s)
    total = sum(chain.fwd_compute_s) + sum(chain.bwd_compute_s) + comm
    assert comm > 0 and sum(chain.fwd_comm_s) > 0
    # The chain is the forward and backward: the optimizer step is not in it.
    step_s = plan.predicted_step_s - plan.step_time["optimizer_s"]
    assert abs(total - step_s) <= 0.02 * step_s
    assert abs(sum(chain.fwd_compute_s) + sum(chain.bwd_compute_s)
               - plan.predicted_compute_s) <= 1e-9 + 1e-6 * plan.predicted_compute_s
    # Sharded: each device holds less than the whole model's activations.
    one = build_chain(traced, profile, flops_per_s=1e9)
    assert sum(chain.saved_bytes) < sum(one.saved_bytes)
    assert chain.persistent_bytes < one.persistent_bytes


def test_plan_records_checkpoint_blocks_and_timeline(tmp_path):
    """A budget below what keeping every activation needs: the plan carries the
    stages, nested-able blocks and the memory timeline, survives JSON, and
    explain() shows them; its peak is within the budget."""
    from automap.planner.plan import Plan

    traced, profile, table, roomy = _gpt2_on((1,), memory_budget_bytes=2**40,
                                             checkpointing="only")
    assert roomy.checkpoint is None  # it fits as it is: nothing to checkpoint
    state = roomy.memory_breakdown["parameters"] + roomy.memory_breakdown["optimizer_state"]
    budget = int(state + 0.75 * (roomy.predicted_peak_memory_bytes - state))
    from automap.planner.search import plan_traced

    tight = plan_traced(traced, profile, roomy.mesh, budget, flops_per_s=1e9)
    assert tight.checkpoint.block_count() > 0 and tight.checkpoint.recompute_s > 0
    assert tight.predicted_peak_memory_bytes <= budget
    assert max(m for _, _, m in tight.checkpoint.timeline) \
        == tight.checkpoint.predicted_activation_peak_bytes
    path = tmp_path / "plan.json"
    tight.to_json(str(path))
    again = Plan.from_json(str(path))
    assert again.checkpoint == tight.checkpoint
    text = again.explain()
    assert "checkpoint stages" in text and "predicted memory timeline" in text
    with pytest.raises(ValueError):
        plan_traced(traced, profile, roomy.mesh, budget, checkpointing="sometimes")


def test_two_stage_beats_either_stage_alone():
    """Issue 6, acceptance 5 (benches/two_stage.py): estimated step times."""
    from two_stage import compare

    (row,) = compare((0.85,))
    print({k: v for k, v in row.items() if k != "two_stage_plan"})
    assert row["two_stage"] < row["ilp_alone"]
    assert row["two_stage"] < row["checkpointing_alone_dp"]
    assert row["two_stage"] <= row["checkpointing_alone_fastest"]


def test_coarsening_merges_neighbours_and_keeps_totals(chain):
    """Long chains (a depth-reduced 96-layer plan has ~1500 stages) are merged
    to at most MAX_STAGES for the rotor DP, whose time grows as L^3."""
    from automap.checkpoint.chain import coarsen

    for limit in (3, 5, len(chain.stages) - 1):
        merged = coarsen(chain, limit)
        assert len(merged) == limit
        assert [n for s in merged.stages for n in s] == [n for s in chain.stages for n in s]
        assert sum(merged.fwd_compute_s) == pytest.approx(sum(chain.fwd_compute_s))
        assert sum(merged.saved_bytes) == sum(chain.saved_bytes)
        assert merged.out_bytes[-1] == chain.out_bytes[-1]
        assert all(s >= o for s, o in zip(merged.saved_bytes, merged.out_bytes))
        assert solve_checkpointing(merged, 10**12).recompute_time_s == 0
    assert coarsen(chain, 10**6) is chain
