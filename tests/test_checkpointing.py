"""Single-device activation checkpointing: linearized stages priced from the
profile, rotor schedules within shrinking budgets (predicted memory; measured
memory needs the generator's checkpoint blocks, issue 6)."""

from __future__ import annotations

import logging
import warnings

import pytest

import model_zoo
from automap import InfeasibleBudgetError
from automap.checkpointing import build_chain, solve_checkpointing
from automap.profiling import profile_traced
from automap.tracing import trace

logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture(scope="module")
def chain():
    warnings.simplefilter("ignore")
    model, inputs, loss = model_zoo.gpt2("meta")
    traced = trace(model, inputs, loss_fn=loss)
    return build_chain(traced, profile_traced(traced), flops_per_s=1e12)


def test_chain_quantities_are_consistent(chain):
    n = len(chain.stages)
    assert n > 8
    assert all(len(v) == n for v in (chain.fwd_compute_s, chain.bwd_compute_s, chain.out_bytes,
                                     chain.saved_bytes, chain.fwd_tmp_bytes, chain.bwd_tmp_bytes))
    assert all(s >= o for s, o in zip(chain.saved_bytes, chain.out_bytes))
    assert sum(chain.bwd_compute_s) > sum(chain.fwd_compute_s) > 0


def test_smaller_budgets_trade_time_for_memory(chain):
    unlimited = solve_checkpointing(chain, 10**12)
    assert unlimited.recompute_time_s == 0
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
