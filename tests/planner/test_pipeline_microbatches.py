"""``microbatches="auto"`` (issue 18): the stage search prices every count of
microbatches from ``n`` to ``4 n`` that divides the batch, each on its own
one-microbatch trace, and keeps the fastest. Meta tensors and forged chains,
no process group."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import automap
from automap import DeviceMesh
from automap.errors import InvalidPipelineError
from automap.planner import pipeline_search
from automap.planner.microbatch import microbatch_counts
from automap.planner.pipeline_chain import Chain, Unit
from automap.planner.pipeline_search import Microbatched, search_pipeline
from pipeline_plans import DeepMLP, mean_square_loss

SPEEDS = dict(flops_per_s=1e10, memory_bandwidth_bytes_per_s=1e11, op_overhead_s=1e-7)


def test_microbatch_counts():
    assert microbatch_counts(16, 2, "1f1b") == [2, 4, 8]
    assert microbatch_counts(16, 4, "gpipe") == [4, 8, 16]
    assert microbatch_counts(6, 4, "1f1b") == [6]
    assert microbatch_counts(2, 4, "1f1b") == []  # fewer samples than stages
    # torch's interleaved schedule runs max(1, M // n) rounds that must divide M.
    assert microbatch_counts(24, 4, "interleaved") == [4, 6, 8, 12]
    assert microbatch_counts(18, 4, "1f1b") == [6, 9]
    assert microbatch_counts(18, 4, "interleaved") == [6]  # 9: 2 rounds


@pytest.mark.parametrize("options, match", [
    (dict(pipeline=2, microbatches="often"), "must be 'auto' or an integer"),
    (dict(pipeline=2, microbatches=2.0), "must be 'auto' or an integer"),
    (dict(pipeline=4, microbatches="auto"), "finds no count of microbatches for 4 stages"),
])
def test_bad_microbatches_are_refused_before_tracing(options, match):
    with torch.device("meta"):
        x = torch.randn(2, 4)
    with pytest.raises(InvalidPipelineError, match=match):
        automap.plan(torch.nn.Identity(), (x,), DeviceMesh((4,)), loss_fn=mean_square_loss,
                     **SPEEDS, **options)


def test_auto_without_a_batch_is_refused():
    with pytest.raises(InvalidPipelineError, match="share a batch dimension"):
        automap.plan(torch.nn.Identity(), (torch.tensor(1.0),), DeviceMesh((2,)),
                     loss_fn=mean_square_loss, pipeline=2, microbatches="auto", **SPEEDS)


def _forged(m: int, work_s: float, per_microbatch_s: float, units: int = 4) -> Chain:
    """A chain of ``units`` equal units for ``m`` microbatches of a batch whose
    whole work is ``work_s`` per unit: each microbatch costs its share plus a
    fixed ``per_microbatch_s`` (kernel launches, message latencies)."""
    t = work_s / m + per_microbatch_s
    return Chain([f"n{i}" for i in range(units)],
                 [Unit(i, i, 0, forward_s=t / 3, backward_s=2 * t / 3, saved_bytes=1e3 / m,
                       state={(f"p{i}", 0): (1e3, 0.0)}, out_bytes=1e3 / m,
                       out_grad_bytes=1e3 / m) for i in range(units)], {})


@pytest.fixture(scope="module")
def sub_plan():
    with torch.device("meta"):
        model, x = DeepMLP(64, 2), torch.randn(8, 64)
    return automap.plan(model, (x,), DeviceMesh((2,)), loss_fn=mean_square_loss, verify=False,
                        **SPEEDS)


def _search(monkeypatch, sub_plan, work_s: float, per_microbatch_s: float):
    """``search_pipeline`` over 2 stages of a (4,) mesh with 2, 4 or 8
    microbatches whose chains are forged (``_forged``), the submesh plan and
    the chain building stubbed."""
    monkeypatch.setattr(pipeline_search, "build_chain",
                        lambda traced, profile, *rest: _forged(profile, work_s,
                                                               per_microbatch_s))
    monkeypatch.setattr(pipeline_search, "choice_of_plan", lambda table, plan: None)
    monkeypatch.setattr(pipeline_search, "unit_count", lambda *args: 4)

    def prepare(m: int) -> Microbatched:
        return Microbatched(None, m, [], lambda submesh, budget: (sub_plan, None))

    return search_pipeline(prepare, DeviceMesh((4,)), None, [2],
                           microbatches=lambda n: microbatch_counts(8, n, "1f1b"),
                           schedule="1f1b", optimizer="adamw", stacks=[], intra_op=None,
                           explicit=True)


def test_auto_takes_more_microbatches_where_the_bubble_dominates(monkeypatch, sub_plan):
    found = _search(monkeypatch, sub_plan, work_s=1.0, per_microbatch_s=1e-4)
    assert found.pipeline.microbatches == 8
    tried = {c["microbatches"]: c["step_s"] for c in found.solver["pipeline_candidates"]}
    assert set(tried) == {2, 4, 8}
    assert tried[8] < tried[4] < tried[2]
    assert found.predicted_step_s == pytest.approx(tried[8])


def test_auto_takes_fewer_microbatches_where_their_overhead_dominates(monkeypatch, sub_plan):
    found = _search(monkeypatch, sub_plan, work_s=1e-3, per_microbatch_s=1.0)
    assert found.pipeline.microbatches == 2
    tried = {c["microbatches"]: c["step_s"] for c in found.solver["pipeline_candidates"]}
    assert tried[2] < tried[4] < tried[8]


@pytest.mark.parametrize("op_overhead_s, expected", [(1e-7, 8), (1e-1, 2)])
def test_auto_microbatches_end_to_end(op_overhead_s, expected):
    """The MLP in 2 stages on 4 devices: at a negligible cost per kernel the
    bubble decides (the most microbatches), at 0.1 s per kernel the kernels'
    count does (the fewest); every count is planned on its own trace."""
    with torch.device("meta"):
        model, x = DeepMLP(256, 4), torch.randn(64, 256)
    plan = automap.plan(model, (x,), DeviceMesh((4,)), loss_fn=mean_square_loss, pipeline=2,
                        microbatches="auto", **{**SPEEDS, "op_overhead_s": op_overhead_s})
    assert plan.pipeline.microbatches == expected
    tried = {c["microbatches"] for c in plan.solver["pipeline_candidates"]}
    assert tried == {2, 4, 8}
    again = automap.Plan.from_dict(plan.to_dict())
    assert again.pipeline.microbatches == expected


def test_once_per_step_costs_are_shared_by_the_microbatches():
    """A stage's submesh plan is chosen on a table whose parameter gradient
    all-reduces and optimizer steps (once per step) cost 1/M, its
    per-microbatch costs in full."""
    from automap.planner.per_microbatch import per_microbatch_table
    from automap.solve.strategies import ShardCounts, build_strategy_table
    from automap.trace.profiling import profile_traced
    from automap.trace.tracing import trace

    with torch.device("meta"):
        model, x = DeepMLP(64, 2), torch.randn(8, 64)
    traced = trace(model, (x,), loss_fn=mean_square_loss)
    mesh = DeviceMesh((2,), alpha_s=1e-5, bandwidth_bytes_per_s=1e9)
    table = build_strategy_table(traced, profile_traced(traced, "adamw"), mesh,
                                 flops_per_s=1e10, memory_bandwidth_bytes_per_s=1e11,
                                 op_overhead_s=1e-7)
    assert per_microbatch_table(table, 1) is table
    shared = per_microbatch_table(table, 4)
    shard_count = ShardCounts(mesh)
    reduced = 0
    for name, node in table.nodes.items():
        other = shared.nodes[name]
        assert other.in_specs == node.in_specs
        assert (np.array_equal(other.compute_s, node.compute_s)
                and np.array_equal(other.forward_comm_s, node.forward_comm_s))
        if node.optimizer_s is not None:
            assert np.allclose(other.optimizer_s, node.optimizer_s / 4)
        for s in range(len(node)):
            once = 0.0
            for k, axes in enumerate(node.reductions[s][2] if node.reductions else []):
                producer, o = node.inputs[k]
                if axes and table.nodes[producer].kind == "parameter":
                    local = table.nodes[producer].outputs[o].nbytes / shard_count(
                        node.in_specs[s][k])
                    once += mesh.all_reduce_cost_s(local, tuple(axes))
            reduced += once > 0
            assert other.backward_comm_s[s] == pytest.approx(
                node.backward_comm_s[s] - 0.75 * once)
    assert reduced > 0  # data-parallel strategies of both linears
