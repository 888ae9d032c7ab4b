"""The pipeline stage search (issue 18, planner side): argument checks before
any tracing, stages that cover the graph and partition the mesh, the choice
between pipeline and intra-op only by the cut axis's link, the DP against
brute force, and the plan record's round trip and validation. Meta tensors,
no process group."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch import nn

import automap
from automap import DeviceMesh, InvalidPlanError
from automap.errors import InvalidPipelineError
from automap.planner.pipeline_chain import Chain, Unit
from automap.planner.pipeline_mesh import cut_mesh, stage_counts
from automap.planner.pipeline_partition import best_partition, in_flight
from automap.planner.plan import Plan
from pipeline_plans import DeepMLP, forged_pipeline, mean_square_loss

SPEEDS = dict(flops_per_s=1e10, memory_bandwidth_bytes_per_s=1e11, op_overhead_s=1e-7)




def _mlp(width: int = 1024, batch: int = 8):
    with torch.device("meta"):
        return DeepMLP(width), (torch.randn(batch, width),)


class _Untraceable(nn.Module):
    def forward(self, x):
        raise AssertionError("traced before the pipeline arguments were checked")


def _computed(plan: Plan) -> list[str]:
    return [n.name for n in plan.nodes.values() if n.op != "placeholder" and n.kind != "output"]


def _check_stages(plan: Plan, stages: int, mesh: DeviceMesh) -> None:
    pipe = plan.pipeline
    assert pipe is not None and pipe.stage_count == stages
    order = _computed(plan)
    assert pipe.stages[0].first_node == order[0] and pipe.stages[-1].last_node == order[-1]
    for before, after in zip(pipe.stages, pipe.stages[1:]):
        assert order.index(after.first_node) == order.index(before.last_node) + 1
    ranks = [r for s in pipe.stages for r in s.ranks]
    assert sorted(ranks) == sorted(mesh.ranks)
    assert plan.mesh.ranks == pipe.stages[0].ranks
    assert plan.mesh.shape == tuple(pipe.submesh_shape)
    assert plan.predicted_step_s == pipe.predicted_step_s
    assert all(s.predicted_forward_s > 0 and s.predicted_backward_s > 0 for s in pipe.stages)


@pytest.mark.parametrize("options, match", [
    (dict(pipeline=2, microbatches=3), "does not divide the example batch of 8"),
    (dict(pipeline=2, microbatches=0), "microbatches must be .auto. or an integer >= 1"),
    (dict(pipeline=8), "need at least 8 devices"),
    (dict(pipeline=3), "do not cut the mesh"),
    (dict(pipeline="sometimes"), "pipeline must be 'off', 'auto' or a number"),
    (dict(pipeline=2, schedule="zigzag"), "schedule must be one of"),
    (dict(pipeline=2), "needs at least as many microbatches as stages"),
])
def test_bad_pipeline_arguments_are_refused_before_tracing(options, match):
    with torch.device("meta"):
        x = torch.randn(8, 4)
    with pytest.raises(InvalidPipelineError, match=match):
        automap.plan(_Untraceable(), (x,), DeviceMesh((4,)), loss_fn=mean_square_loss, **SPEEDS,
                     **options)


def test_more_stages_than_layers_is_refused():
    with torch.device("meta"):
        model, x = nn.Linear(16, 16), torch.randn(8, 16)
    with pytest.raises(InvalidPipelineError, match="splits into at most"):
        automap.plan(model, (x,), DeviceMesh((8,)), loss_fn=mean_square_loss, pipeline=8,
                     schedule="gpipe", **SPEEDS)


def test_a_stage_without_parameters_is_no_stage():
    """One Linear cut in 2 left the loss alone on the second stage: its rank had
    no parameter, and ``AdamW(module.parameters())`` failed there only."""
    with torch.device("meta"):
        model, x = nn.Linear(16, 16), torch.randn(8, 16)
    with pytest.raises(InvalidPipelineError, match="splits into at most 1 stages"):
        automap.plan(model, (x,), DeviceMesh((2,)), loss_fn=mean_square_loss, pipeline=2,
                     microbatches=2, **SPEEDS)


def test_a_pipeline_over_the_budget_is_refused():
    model, inputs = _mlp(256)
    with pytest.raises(automap.InfeasibleBudgetError, match="no pipeline of"):
        automap.plan(model, inputs, DeviceMesh((4,)), 1e4, loss_fn=mean_square_loss, pipeline=2,
                     microbatches=2, **SPEEDS)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_pipeline_budget_error_names_a_least_that_plans(schedule):
    """The least budget a pipeline's ``InfeasibleBudgetError`` names is the
    same from a 1-byte budget and from one just under it, and every budget
    from it up plans, no slower than a smaller one (before: None from 1 byte;
    GPipe at 3e6 B refused, naming 3.12e6, where 2e6 planned)."""
    model, inputs = _mlp(256, batch=256)
    options = dict(loss_fn=mean_square_loss, pipeline=2, microbatches=4, schedule=schedule,
                   **SPEEDS)
    with pytest.raises(automap.InfeasibleBudgetError) as tiny:
        automap.plan(model, inputs, DeviceMesh((4,)), 1.0, **options)
    least = tiny.value.smallest_feasible_budget_bytes
    assert least is not None and "smallest feasible budget" in str(tiny.value)
    with pytest.raises(automap.InfeasibleBudgetError) as under:
        automap.plan(model, inputs, DeviceMesh((4,)), 0.97 * least, **options)
    assert under.value.smallest_feasible_budget_bytes == least
    steps = []
    for budget in (least, 1.3 * least, 1.6 * least):
        plan = automap.plan(model, inputs, DeviceMesh((4,)), budget, **options)
        assert all(s.predicted_peak_memory_bytes <= budget for s in plan.pipeline.stages)
        steps.append(plan.predicted_step_s)
    # A larger budget is never slower here: where the fastest plan's simulated
    # stages do not fit, its leaner submesh plans compete (GPipe at 1.6x: 16.9
    # ms, the least's plan, where 1.3x gave 12.5 ms).
    assert steps == sorted(steps, reverse=True)


def test_the_least_named_is_the_simulated_peak_of_the_plan_found_there():
    """Where the partition model over-estimates the stages (recomputing ones:
    +12 and +18 % here), the least a pipeline error names is the simulated
    peak of the plan the search finds at the model's least, not the model's
    least itself: the trust GPT-2's interleaved pipeline named 47.5 MiB
    where every budget from 35.0 MiB planned."""
    import warnings

    from trust_workers import build

    model, inputs, loss_fn = build("gpt2")
    options = dict(loss_fn=loss_fn, pipeline=2, microbatches=4, schedule="interleaved",
                   flops_per_s=2e10, memory_bandwidth_bytes_per_s=1e10, op_overhead_s=2e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(automap.InfeasibleBudgetError) as tiny:
            automap.plan(model, inputs, DeviceMesh((4,)), 1.0, **options)
        least = tiny.value.smallest_feasible_budget_bytes
        assert least is not None
        plan = automap.plan(model, inputs, DeviceMesh((4,)), least, **options)
    peak = max(s.predicted_peak_memory_bytes for s in plan.pipeline.stages)
    assert least - 1 <= peak <= least


def _trust_gpt2_pipeline(budget: float, schedule: str, flops_per_s: float) -> automap.Plan:
    """The trust bench's GPT-2 in 2 stages on (4,), 4 microbatches."""
    import warnings

    from trust_workers import build

    model, inputs, loss_fn = build("gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return automap.plan(model, inputs, DeviceMesh((4,)), budget, loss_fn=loss_fn,
                            pipeline=2, microbatches=4, schedule=schedule,
                            flops_per_s=flops_per_s, memory_bandwidth_bytes_per_s=1e10,
                            op_overhead_s=2e-5)


def test_recomputing_chunks_are_modelled_as_their_simulated_steps():
    """A chunk's running microbatch holds the saved tensors of the nodes up to
    the running one, the gradients waiting and its transient (as the intra-op
    model), not all its saved tensors with its largest transient: the trust
    GPT-2's interleaved ranks at 40 MiB, their chunks recomputing, modelled
    +13.1 and +19.0 % over their simulated steps, and no split was found
    within the budget (the plan came from the least budget's search); the
    split's own shares of each rank's budget find it now."""
    plan = _trust_gpt2_pipeline(40 * 2**20, "interleaved", flops_per_s=2e10)
    assert any(s.recompute for s in plan.pipeline.stages)
    errors = [p["modelled_bytes"] / p["simulated_bytes"] - 1
              for p in plan.solver["pipeline_stage_peaks"]]
    # +2.6 and -0.9 %. Rank 1 was +14.8 % until stop 53: each state of the
    # schedule took the largest transient of the rank's chunks, the loss
    # chunk's microbatch in flight beside the recomputing chunk's backward,
    # which never run at once (now the chunk running then:
    # ``pipeline_order.held_while_running``). (+8.4 % until stop 51, when the
    # all-to-all before the loss held its send buffer beside the merged copy
    # of what it received; +7.6 % while the attention's head-merging reshapes
    # copied, which the model did not count.)
    assert max(abs(e) for e in errors) <= 0.03, errors
    assert plan.solver["pipeline_verify_rounds"] == 1


@pytest.mark.timeout(300)
def test_the_first_stage_is_modelled_as_its_attention_runs():
    """The trust GPT-2's attention gets its heads by all-to-alls from the
    projection's (batch, sequence, head) layout. Made contiguous in (batch,
    head, ...) order, they made attention's output so too, and the transpose
    and reshape that merge its heads copied it: 0.25 MiB per layer and
    microbatch no model counted (GPipe at 80 MiB: the first stage modelled
    71.11 MiB, simulated 73.11, -2.7 %). A conversion now keeps its input's
    memory order, as the serial model profiled: 71.11 against 71.11 MiB."""
    plan = _trust_gpt2_pipeline(80 * 2**20, "gpipe", flops_per_s=1e10)
    into_attention = [e for e in plan.edges if e.consumer.startswith("scaled_dot_product")
                      and any("all_to_all" in str(step) for step in e.steps)]
    assert into_attention, "no all-to-all into attention any more: pick another plan"
    first = plan.solver["pipeline_stage_peaks"][0]
    assert first["modelled_bytes"] / first["simulated_bytes"] - 1 == pytest.approx(0, abs=0.005)


def test_checkpointing_off_keeps_every_stage_from_recomputing():
    """``checkpointing="off"`` means the sharding alone must fit: no stage may
    recompute its forward, and the least budget named is the least without
    (a new-user sweep's 6-layer MLP, GPipe: "off" planned both stages
    recomputing at the least it named, 4,106,958 B)."""
    model, inputs = _mlp(256, batch=256)
    options = dict(loss_fn=mean_square_loss, pipeline=2, microbatches=4, schedule="gpipe",
                   **SPEEDS)
    least = {}
    for mode in ("off", "auto"):
        with pytest.raises(automap.InfeasibleBudgetError) as err:
            automap.plan(model, inputs, DeviceMesh((4,)), 1.0, checkpointing=mode, **options)
        least[mode] = err.value.smallest_feasible_budget_bytes
        # The error says what the search allowed its stages.
        assert ("without stages recomputing" in str(err.value)) == (mode == "off")
    assert least["auto"] < least["off"]
    plan = automap.plan(model, inputs, DeviceMesh((4,)), least["off"], checkpointing="off",
                        **options)
    assert not any(s.recompute for s in plan.pipeline.stages)
    with pytest.raises(automap.InfeasibleBudgetError):
        automap.plan(model, inputs, DeviceMesh((4,)), (least["auto"] + least["off"]) / 2,
                     checkpointing="off", **options)


def test_mesh_cuts():
    mesh = DeviceMesh((2, 4), alpha_s=[1e-5, 1e-6], bandwidth_bytes_per_s=[1e9, 1e11])
    assert stage_counts(mesh) == [1, 2, 4, 8]
    assert stage_counts(DeviceMesh((4, 3))) == [1, 2, 4, 12]
    two = cut_mesh(mesh, 2)
    assert two.stage_ranks == ((0, 1, 2, 3), (4, 5, 6, 7)) and two.submesh.shape == (4,)
    assert two.submesh.bandwidth_bytes_per_s == (1e11,)
    assert two.link_between(0, 1) == (1e-5, 1e9)
    four = cut_mesh(mesh, 4)
    assert four.stage_ranks == ((0, 1), (2, 3), (4, 5), (6, 7))
    # Within a node the fast axis, across nodes the slow one.
    assert [four.link_between(k, k + 1)[1] for k in range(3)] == [1e11, 1e9, 1e11]


def test_mlp_on_four_devices_in_two_stages():
    model, inputs = _mlp(256, batch=1024)
    mesh = DeviceMesh((4,))
    plan = automap.plan(model, inputs, mesh, loss_fn=mean_square_loss, pipeline=2, microbatches=4,
                        **SPEEDS)
    _check_stages(plan, 2, mesh)
    assert plan.pipeline.microbatches == 4 and plan.pipeline.schedule == "1f1b"
    assert plan.pipeline.intra_op_step_s is None  # an explicit count: not compared
    # Under GPipe stage 0 keeps all 4 microbatches' activations, under 1F1B 2.
    gpipe = automap.plan(model, inputs, mesh, loss_fn=mean_square_loss, pipeline=2, microbatches=4,
                         schedule="gpipe", **SPEEDS)
    assert gpipe.pipeline.schedule == "gpipe"
    assert gpipe.pipeline.stages[0].predicted_peak_memory_bytes > \
        plan.pipeline.stages[0].predicted_peak_memory_bytes


@pytest.fixture(scope="module")
def gpt2_plan():
    import model_zoo

    model, inputs, loss = model_zoo.gpt2("meta")
    mesh = DeviceMesh((2, 2), alpha_s=[1e-5, 1e-6], bandwidth_bytes_per_s=[1e9, 1e11])
    plan = automap.plan(model, inputs, mesh, loss_fn=loss, pipeline=2, microbatches=2,
                        **SPEEDS)
    return plan, mesh


def test_gpt2_in_two_stages_with_tied_weights(gpt2_plan):
    plan, mesh = gpt2_plan
    _check_stages(plan, 2, mesh)
    assert plan.pipeline.stages[0].ranks == (0, 1) and plan.pipeline.stages[1].ranks == (2, 3)
    # The embedding (stage 0) and the LM head (stage 1) share one weight.
    assert plan.pipeline.tied_s > 0


def test_pipeline_off_is_todays_plan():
    model, inputs = _mlp(64)
    mesh = DeviceMesh((2,))
    today = automap.plan(model, inputs, mesh, loss_fn=mean_square_loss, **SPEEDS)
    off = automap.plan(model, inputs, mesh, loss_fn=mean_square_loss, pipeline="off", **SPEEDS)
    assert off.pipeline is None
    assert off.predicted_step_s == today.predicted_step_s
    assert [vars(n) for n in off.nodes.values()] == [vars(n) for n in today.nodes.values()]


def test_auto_pipelines_across_a_slow_link_only():
    model, inputs = _mlp()
    chosen = {}
    for bandwidth in (1e7, 1e13):
        mesh = DeviceMesh((2, 2), alpha_s=[1e-5, 1e-6], bandwidth_bytes_per_s=[bandwidth, 1e11])
        plan = automap.plan(model, inputs, mesh, loss_fn=mean_square_loss, pipeline="auto",
                            microbatches=4, **SPEEDS)
        tried = {c["stages"] for c in plan.solver["pipeline_candidates"]}
        assert tried == {2, 4}
        chosen[bandwidth] = plan
    slow, fast = chosen[1e7], chosen[1e13]
    assert slow.pipeline is not None and slow.pipeline.stage_count >= 2
    assert slow.pipeline.intra_op_step_s > slow.predicted_step_s
    assert fast.pipeline is None and fast.mesh.shape == (2, 2)


def test_json_round_trip_and_explain(gpt2_plan, tmp_path):
    plan, _ = gpt2_plan
    path = tmp_path / "plan.json"
    plan.to_json(str(path))
    again = Plan.from_json(str(path))
    assert again.to_dict() == plan.to_dict()
    assert again.pipeline == plan.pipeline
    text = plan.explain()
    assert "pipeline plan: 2 stages of submesh (2,)" in text
    for stage in plan.pipeline.stages:
        assert f"{stage.first_node} .. {stage.last_node}" in text
    assert "forward ms" in text and "backward ms" in text



@pytest.mark.parametrize("edit, field", [
    (lambda p: p["stages"][1].update(ranks=[1, 3]), r"pipeline.stages\[1\].ranks"),
    (lambda p: p["stages"][1].update(ranks=[2]), r"pipeline.stages\[1\].ranks"),
    (lambda p: p["stages"][1].update(first_node=p["stages"][0]["first_node"]),
     r"pipeline.stages\[1\].first_node"),
    (lambda p: p["stages"][1].update(last_node=p["stages"][0]["last_node"]),
     r"pipeline.stages\[1\]"),
    (lambda p: p.update(schedule="zigzag"), "pipeline.schedule"),
    (lambda p: p.update(microbatches=0), "pipeline.microbatches"),
    (lambda p: p.update(send_s=[]), "pipeline.send_s"),
    (lambda p: p.update(submesh_shape=[4]), "pipeline.submesh_shape"),
])
def test_a_bad_pipeline_record_is_refused(gpt2_plan, edit, field):
    plan, _ = gpt2_plan
    with pytest.raises(InvalidPlanError, match=field):
        Plan.from_dict(forged_pipeline(plan, edit))


def _p2p_bytes(stage: int, stages: int) -> float:
    """1F1B's point-to-point buffers in a backward of ``_chain``'s stage: the
    output's gradient received (1e3 B) and the last input gradient waiting for
    its send (1e3 B); its outputs and inputs are saved (no send waits on them)."""
    return 1e3 * ((stage < stages - 1) + (stage > 0))


def _stepping_bytes(state: float, stage: int) -> float:
    """``_chain``'s stage in the optimizer step: its state and, after the first
    stage, the last microbatch's received input and its gradient (1e3 B each)."""
    return state + 2e3 * (stage > 0)


def _chain(times, saved, state) -> Chain:
    units = [Unit(i, i, 0, forward_s=t / 3, backward_s=2 * t / 3, saved_bytes=s,
                  state={(f"p{i}", 0): (b, 0.0)}, out_bytes=1e3, out_grad_bytes=1e3)
             for i, (t, s, b) in enumerate(zip(times, saved, state))]
    return Chain([f"n{i}" for i in range(len(units))], units, {})


@pytest.mark.parametrize("seed", range(6))
def test_partition_is_optimal_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    k, n, m = 7, 3, int(rng.integers(1, 4)) if seed % 2 else 1
    times, saved, state = rng.uniform(0.1, 1, k), rng.uniform(0, 10, k), rng.uniform(0, 10, k)
    budget = float(rng.uniform(20, 60))
    shared = 1.0 if seed < 3 else 3.0  # ranks sharing cores: another step reported
    stages = cut_mesh(DeviceMesh((n,), alpha_s=1e-3, bandwidth_bytes_per_s=1e6), n)
    found = best_partition(_chain(times, saved, state), stages, m, "1f1b", budget,
                           recompute=False, shared_slowdown=shared)
    best = np.inf
    for cuts in itertools.combinations(range(1, k), n - 1):
        bounds = list(zip((0, *cuts), (*cuts, k)))
        t, fits = [], True
        for s, (a, b) in enumerate(bounds):
            send = (1e-3 + 1e3 / 1e6) * ((s < n - 1) + (s > 0))
            t.append(times[a:b].sum() + send)
            peak = state[a:b].sum() + in_flight("1f1b", m, n, s) * saved[a:b].sum() \
                + _p2p_bytes(s, n)
            fits &= max(peak, _stepping_bytes(state[a:b].sum(), s)) <= budget
        if fits and sum(t) + (m - 1) * max(t) < best:
            best = sum(t) + (m - 1) * max(t)
            # Ranks sharing cores: the split of a device per rank, priced shared.
            reported = max(best / shared, m * sum(t) / n) if shared > 1 else best
    if not np.isfinite(best):
        assert found is None
        return
    assert found is not None and found.step_s == pytest.approx(reported)


@pytest.mark.parametrize("seed", range(4))
def test_least_budget_is_the_brute_force_least_of_the_largest_stage(seed):
    """``least_budget`` is the least over splits of the largest stage peak (a
    stage recomputing where that is leaner), to its tolerance, and the DP
    plans within it and not below."""
    from automap.planner.pipeline_partition import LEAST_TOLERANCE, least_budget

    rng = np.random.default_rng(seed)
    k, n, m = 7, 3, int(rng.integers(1, 5))
    times, saved, state = rng.uniform(0.1, 1, k), rng.uniform(0, 10, k), rng.uniform(0, 10, k)
    stages = cut_mesh(DeviceMesh((n,), alpha_s=1e-3, bandwidth_bytes_per_s=1e6), n)
    chain = _chain(times, saved, state)
    least = least_budget(chain, stages, m, "1f1b")

    def peak(s: int, a: int, b: int) -> float:
        flight = in_flight("1f1b", m, n, s)
        # Recomputing keeps each microbatch's input (1e3 B after the first
        # stage) and one microbatch's activations.
        held = state[a:b].sum() + min(flight * saved[a:b].sum(),
                                      flight * (1e3 if a else 0.0) + saved[a:b].sum()) \
            + _p2p_bytes(s, n)
        return max(held, _stepping_bytes(state[a:b].sum(), s))

    brute = min(max(peak(s, a, b) for s, (a, b) in enumerate(zip((0, *cuts), (*cuts, k))))
                for cuts in itertools.combinations(range(1, k), n - 1))
    assert brute <= least <= brute * (1 + LEAST_TOLERANCE)
    assert best_partition(chain, stages, m, "1f1b", least) is not None
    assert best_partition(chain, stages, m, "1f1b", brute * (1 - LEAST_TOLERANCE)) is None


def test_a_stage_recomputes_to_fit():
    stages = cut_mesh(DeviceMesh((2,)), 2)
    # Two units of 1e4 saved bytes per stage, four microbatches in flight: 8e4
    # plain; recomputed, four stage inputs of 1e3 and one microbatch's 2e4.
    chain = _chain(np.ones(4), np.full(4, 1e4), np.ones(4))
    assert best_partition(chain, stages, 4, "gpipe", 3e4, recompute=False) is None
    found = best_partition(chain, stages, 4, "gpipe", 3e4)
    assert found is not None and all(found.recompute)
    plain = best_partition(chain, stages, 4, "gpipe", None)
    assert not any(plain.recompute) and plain.step_s < found.step_s


def test_depth_reduced_stages_count_every_layer():
    """A depth-reduced plan (6 layers, 2 traced) splits the real layers: the
    last traced block stands for 5, and stages start and end in its repeats."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=64, n_head=4, vocab_size=256,
                                           n_positions=16))
        ids = torch.randint(0, 256, (4, 16))
    plan = automap.plan(model, {"input_ids": ids, "labels": ids}, DeviceMesh((4,)),
                        pipeline=4, microbatches=2, schedule="gpipe", reduce_depth=True,
                        **SPEEDS)
    stages = plan.pipeline.stages
    assert [(s.first_repeat, s.last_repeat) for s in stages] == [(0, 0), (1, 2), (3, 4),
                                                                  (0, 0)]
    assert stages[1].first_node == stages[2].first_node  # the same traced block
    again = Plan.from_dict(plan.to_dict())
    assert again.pipeline == plan.pipeline
    assert "#1" in plan.explain()


def test_schedule_orders():
    from automap.generate.pipeline_order import schedule_order

    def order(*args):
        return [(kind, i) for kind, i, _ in schedule_order(*args)]

    assert order("gpipe", 3, 2, 1) == [("F", 0), ("F", 1), ("F", 2),
                                       ("B", 0), ("B", 1), ("B", 2)]
    # 1F1B: stage k warms up with min(M, n - k) forwards, then alternates.
    assert order("1f1b", 4, 2, 0) == [("F", 0), ("F", 1), ("B", 0), ("F", 2),
                                      ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    assert order("1f1b", 3, 2, 1) == [("F", 0), ("B", 0), ("F", 1), ("B", 1),
                                      ("F", 2), ("B", 2)]


@pytest.fixture(scope="module")
def simulated_pipeline():
    model, inputs = _mlp(256, batch=256)
    plan = automap.plan(model, inputs, DeviceMesh((4,)), loss_fn=mean_square_loss, pipeline=2,
                        microbatches=4, schedule="gpipe", **SPEEDS)
    return model, inputs, plan


def test_stage_peaks_are_the_simulated_steps(simulated_pipeline):
    from automap.api import first_microbatch
    from automap.generate.simulate_pipeline import simulate_stage
    from automap.planner.reserve import STAGE_HEADROOM, reserved
    from automap.trace.tracing import trace

    model, inputs, plan = simulated_pipeline
    assert plan.solver["simulated"] and plan.solver["pipeline_verify_rounds"] == 1
    traced = trace(model, first_microbatch(inputs, 4), loss_fn=mean_square_loss)
    stages = plan.pipeline.stages
    for stage in stages:
        assert stage.modelled_peak_memory_bytes is not None
        step = simulate_stage(traced, plan, stage.index)
        assert stage.predicted_peak_memory_bytes == reserved(step, STAGE_HEADROOM).peak_bytes
    assert plan.predicted_peak_memory_bytes == max(s.predicted_peak_memory_bytes
                                                   for s in stages)
    assert "simulated" in plan.memory_breakdown_at
    assert Plan.from_dict(plan.to_dict()).pipeline == plan.pipeline
    unverified = automap.plan(model, inputs, DeviceMesh((4,)), loss_fn=mean_square_loss, pipeline=2,
                              microbatches=4, schedule="gpipe", verify=False, **SPEEDS)
    assert all(s.modelled_peak_memory_bytes is None for s in unverified.pipeline.stages)


@pytest.mark.parametrize("schedule,stages,budget", [
    ("gpipe", 4, None), ("1f1b", 4, None), ("gpipe", 2, 1.9e6), ("1f1b", 2, 1.9e6),
    ("interleaved", 2, None)])
def test_the_stage_model_holds_what_the_simulated_stage_holds(schedule, stages, budget):
    """The partition model's stage peaks against the simulated stages (256-wide
    MLP, 4 microbatches on (4,)): the whole batch on every rank, the received
    inputs no node counts, the outputs waiting for their sends, the gradients
    received and sent, the accumulating gradients. Without them the stages
    simulated up to 28.7 % over the model (GPipe, 4 stages). Gradients exist
    only after a stage's first backward, where one microbatch fewer may be in
    flight. Interleaved: a
    rank's chunks hold together what torch's order has them hold at once,
    one chunk's transients and one optimizer temporary (summed per chunk at
    each one's most in flight, 14-17 % over)."""
    with torch.device("meta"):
        model, inputs = DeepMLP(256), (torch.randn(256, 256),)
    plan = automap.plan(model, inputs, DeviceMesh((4,)), budget, loss_fn=mean_square_loss,
                        pipeline=stages, microbatches=4, schedule=schedule, **SPEEDS)
    peaks = plan.solver["pipeline_stage_peaks"]
    assert len(peaks) == stages
    errors = [p["modelled_bytes"] / p["simulated_bytes"] - 1 for p in peaks]
    assert max(abs(e) for e in errors) <= 0.07, errors
    # No stage over by more than 1 %: parameter gradients are counted only
    # after a stage's first backward (GPipe's 4 stages were 3.6-6.2 % over).
    assert max(errors) <= 0.01, errors



@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_stage_peaking_in_its_gradient_sync_is_modelled(schedule):
    """Data parallel inside each stage (fast FLOPs: the 2-way submesh
    replicates its 3 layers), the first stage peaks after its last backward,
    while every gradient's bucket copy waits for its all-reduce. The stage
    model holds the chunk's synced gradients once more then; without them the
    stage modelled 6.3 % under its simulated step."""
    with torch.device("meta"):
        model, inputs = DeepMLP(256), (torch.randn(256, 256),)
    plan = automap.plan(model, inputs, DeviceMesh((4,)), loss_fn=mean_square_loss,
                        pipeline=2, microbatches=4, schedule=schedule,
                        flops_per_s=1e12, memory_bandwidth_bytes_per_s=1e15,
                        op_overhead_s=1e-12)
    errors = [p["modelled_bytes"] / p["simulated_bytes"] - 1
              for p in plan.solver["pipeline_stage_peaks"]]
    assert max(abs(e) for e in errors) <= 0.005, errors

def test_a_budget_below_the_simulated_peak_is_planned_again_or_named(simulated_pipeline):
    """Under a budget just below the unconstrained plan's simulated worst stage,
    the planner returns a plan whose simulated stages fit, or names a budget at
    which it does."""
    model, inputs, plan = simulated_pipeline
    budget = 0.97 * plan.predicted_peak_memory_bytes
    options = dict(loss_fn=mean_square_loss, pipeline=2, microbatches=4, schedule="gpipe", **SPEEDS)
    try:
        fitted = automap.plan(model, inputs, DeviceMesh((4,)), budget, **options)
    except automap.InfeasibleBudgetError as err:
        named = err.smallest_feasible_budget_bytes
        assert named is not None and named > budget
        fitted, budget = automap.plan(model, inputs, DeviceMesh((4,)), named, **options), named
    assert all(s.predicted_peak_memory_bytes <= budget for s in fitted.pipeline.stages)
