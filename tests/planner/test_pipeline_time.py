"""The pipeline's step-time model (``pipeline_partition.schedule_step_s``,
``price_bounds``, ``pipeline_search.reprice_pipeline``): what each term
prices, on hand-made chains and the GPT-2 test plan; no timing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from automap import DeviceMesh
from automap.cluster.device import DeviceProfile
from automap.planner.pipeline_chain import Chain, Unit
from automap.planner.pipeline_mesh import cut_mesh
from automap.planner.pipeline_partition import price_bounds, schedule_step_s, stage_sync_s


def _chain(times, grad_bytes=0.0, optimizer_s=0.0) -> Chain:
    units = [Unit(i, i, 0, forward_s=t / 3, backward_s=2 * t / 3, optimizer_s=optimizer_s,
                  sync={(f"p{i}", 0): ((0,), grad_bytes)} if grad_bytes else {},
                  out_bytes=1e3, out_grad_bytes=1e3)
             for i, t in enumerate(times)]
    return Chain([f"n{i}" for i in range(len(units))], units, {})


def test_a_device_per_rank_is_the_schedules_formula():
    assert schedule_step_s(6.0, 2.0, 4) == pytest.approx(6 + 3 * 2)
    assert schedule_step_s(6.0, 2.0, 1) == pytest.approx(6)


@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_every_microbatch_pays_the_slowest_stage(m):
    # One more microbatch: one more slowest stage (its ops, kernel overheads
    # and sends run once per microbatch).
    grown = schedule_step_s(6.0, 2.0, m + 1) - schedule_step_s(6.0, 2.0, m)
    assert grown == pytest.approx(2.0)


def test_shared_ranks_speed_up_in_the_bubbles_but_not_beyond_the_work():
    # Four stages of 1 s per microbatch, M = 4: 7 s with a device per rank.
    assert schedule_step_s(4.0, 1.0, 4, 1, 1.0, 4) == pytest.approx(7.0)
    # Ranks sharing cores 2x: the chain at twice the speed (3.5 s) is below
    # the work every rank does with all of them busy (4 x 1 s).
    assert schedule_step_s(4.0, 1.0, 4, 1, 2.0, 4) == pytest.approx(4.0)
    # Unbalanced stages: the chain's latency is above the mean work.
    assert schedule_step_s(5.0, 2.0, 4, 1, 2.0, 4) == pytest.approx(5.5)
    # Never below what one device per rank gives divided by the slowdown,
    # never above it.
    for total, worst, s in [(3.0, 1.0, 1.5), (10.0, 4.0, 5.0), (2.0, 2.0, 3.0)]:
        plain = schedule_step_s(total, worst, 8)
        shared = schedule_step_s(total, worst, 8, 1, s, 3)
        assert plain / s <= shared <= plain


def test_shared_ranks_change_the_order_of_two_pipelines():
    # A: 4 stages, unbalanced (0.5, 0.5, 0.5, 2 s); B: 2 stages of 1.5 s; M = 4.
    a = dict(sum_s=3.5, max_s=2.0, microbatches=4, submeshes=4)
    b = dict(sum_s=3.0, max_s=1.5, microbatches=4, submeshes=2)
    # A device per rank: A's bubbles behind its slow stage make it slower.
    assert schedule_step_s(**a) > schedule_step_s(**b)
    # Four ranks on a quarter of the cores each: A's idle ranks give their
    # share to the busy ones, and A does less work per rank.
    assert schedule_step_s(**a, shared_slowdown=4.0) < schedule_step_s(
        **b, shared_slowdown=4.0)


def test_the_step_adds_the_tail_and_the_tied_weights():
    # Two stages of 2 x 2 ranks: the stages' link is axis 0's, the gradients
    # are all-reduced over the submesh's axis (axis 1 of the whole mesh).
    mesh = DeviceMesh((2, 2), alpha_s=[1e-3, 1e-4], bandwidth_bytes_per_s=[1e6, 1e8])
    stages = cut_mesh(mesh, 2)
    chain = _chain(np.ones(4), grad_bytes=1e5, optimizer_s=0.05)
    part = price_bounds(chain, stages, [(0, 2), (2, 4)], [False, False], 4, "gpipe")
    send = 1e-3 + 1e3 / 1e6
    t = [2 + send, 2 + send]
    assert part.send_s == [pytest.approx(send)]
    # The slowest stage's optimizer and its two gradients in one bucket.
    bucket = stages.submesh.all_reduce_cost_s(2e5, (0,))
    assert part.tail_s == pytest.approx(2 * 0.05 + bucket)
    assert part.step_s == pytest.approx(sum(t) + 3 * max(t) + part.tail_s + part.tied_s)
    again = price_bounds(chain, stages, [(0, 2), (2, 4)], [True, False], 4, "gpipe")
    assert again.backward_s[0] == pytest.approx(part.backward_s[0] + 2 / 3)


def test_a_later_stage_syncs_its_gradients_while_earlier_stages_drain():
    """A stage syncs when its schedule ends, after its last backward; the
    backward of the stages before it still runs then, so only the sync that
    outlasts that drain adds to the step; the optimizer steps after the
    module's call, on every rank together (the max, not added to the sync)."""
    mesh = DeviceMesh((2, 2), alpha_s=[1e-3, 1e-4], bandwidth_bytes_per_s=[1e6, 1e8])
    stages = cut_mesh(mesh, 2)
    # Stage 0: two cheap units without gradients; stage 1: two with large ones.
    units = [Unit(i, i, 0, forward_s=0.1, backward_s=0.2, optimizer_s=0.01 * (i + 1),
                  sync={(f"p{i}", 0): ((0,), 5e7)} if i >= 2 else {},
                  out_bytes=1e3, out_grad_bytes=1e3) for i in range(4)]
    chain = Chain([f"n{i}" for i in range(4)], units, {})
    part = price_bounds(chain, stages, [(0, 2), (2, 4)], [False, False], 4, "1f1b")
    sync_1 = stage_sync_s(chain, stages, 2, 4)
    drain_1 = part.backward_s[0]  # stage 0's backward after stage 1's last one
    assert sync_1 > drain_1 > 0
    assert part.tail_s == pytest.approx(sync_1 - drain_1 + (0.03 + 0.04))
    # Ranks sharing their compute drain one at a time, up to the slowdown faster.
    shared = price_bounds(chain, stages, [(0, 2), (2, 4)], [False, False], 4, "1f1b",
                          shared_slowdown=2.0)
    assert shared.tail_s == pytest.approx(sync_1 - drain_1 / 2 + 0.07)
    # A drain longer than the sync hides it; stage 0 (no gradients) adds nothing.
    hidden = dataclasses.replace(chain, units=[
        dataclasses.replace(u, backward_s=20.0) if i < 2 else u for i, u in enumerate(units)])
    assert price_bounds(hidden, stages, [(0, 2), (2, 4)], [False, False], 4,
                        "1f1b").tail_s == pytest.approx(0.07)


def test_the_gradients_pay_the_latency_once_per_bucket():
    mesh = DeviceMesh((2, 2), alpha_s=[1e-3, 1e-3], bandwidth_bytes_per_s=[1e9, 1e9])
    stages = cut_mesh(mesh, 2)
    chain = _chain(np.ones(20), grad_bytes=1e5)
    tail = stage_sync_s(chain, stages, 0, 10)
    assert tail == pytest.approx(stages.submesh.all_reduce_cost_s(1e6, (0,)))
    assert tail < 10 * stages.submesh.all_reduce_cost_s(1e5, (0,)) / 2
    # Past a bucket's bytes, one more bucket.
    assert stage_sync_s(chain, stages, 0, 10, bucket_bytes=4e5) == pytest.approx(
        2 * stages.submesh.all_reduce_cost_s(4e5, (0,))
        + stages.submesh.all_reduce_cost_s(2e5, (0,)))


def test_repricing_a_plan_gives_its_prediction():
    import automap
    import model_zoo
    from automap.planner.microbatch import microbatch_inputs
    from automap.planner.pipeline_search import reprice_pipeline
    from automap.trace.profiling import profile_traced
    from automap.trace.tracing import trace

    model, inputs, loss = model_zoo.gpt2("meta")
    mesh = DeviceMesh((2, 2), alpha_s=[1e-5, 1e-6], bandwidth_bytes_per_s=[1e9, 1e11])
    speeds = dict(flops_per_s=1e10, memory_bandwidth_bytes_per_s=1e11, op_overhead_s=1e-7)
    plan = automap.plan(model, inputs, mesh, loss_fn=loss, pipeline=2, microbatches=2,
                        verify=False, **speeds)
    traced = trace(model, microbatch_inputs(inputs, 2), loss_fn=loss)
    profile, device = profile_traced(traced, "adamw"), DeviceProfile(**speeds)
    record = plan.pipeline
    again = reprice_pipeline(traced, profile, plan, device)
    assert again.step_s == pytest.approx(record.predicted_step_s, rel=1e-9)
    shared = reprice_pipeline(traced, profile, plan,
                              dataclasses.replace(device, shared_slowdown=3.0))
    assert shared.step_s <= again.step_s


def test_a_profile_keeps_its_slowdown():
    profile = DeviceProfile(1e10, 1e10, 1e-6, shared_slowdown=2.5)
    assert DeviceProfile(**profile.to_dict()) == profile
    assert DeviceProfile(1e10, 1e10, 1e-6, shared_slowdown=0.5).shared_slowdown == 1.0
