"""The step-time model's parts and how they add up (issue 14, acceptance 4):
memory-bound nodes cost their bytes over the bandwidth, every kernel its
overhead, the optimizer step its shard's bytes, and the gradient buckets'
overlap with the backward never makes a step faster than its compute nor
slower than everything in sequence. No timing is measured here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from automap import DeviceMesh, DeviceProfile
from automap.checkpoint.chain import choice_of_plan
from automap.planner.search import plan_traced, reprice
from automap.planner.step_time import step_time
from automap.solve.gradient_buckets import deferred_gradients, gradient_buckets
from automap.solve.strategies import OPTIMIZER_STEP, build_strategy_table
from automap.trace.profiling import profile_traced
from automap.trace.tracing import trace
from forced_plans import BATCH, forced_plan

# Slow compute on fast links: data parallelism pays.
DEVICE = DeviceProfile(flops_per_s=1e9, memory_bandwidth_bytes_per_s=1e9, op_overhead_s=1e-5)
MESH = DeviceMesh((2,), alpha_s=1e-5, bandwidth_bytes_per_s=1e10)


class Deep(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = F.gelu(layer(x))
        return x


def _loss(out):
    return out.pow(2).mean()


@pytest.fixture(scope="module")
def deep():
    model, x = Deep(), torch.randn(32, 64)
    traced = trace(model, (x,), loss_fn=_loss)
    return model, x, traced, profile_traced(traced, "adamw")


def _strategy(node, ins, outs):
    return next(i for i in range(len(node)) if node.in_specs[i] == ins
                and node.out_specs[i] == outs)


def test_elementwise_nodes_cost_bytes_over_bandwidth_plus_kernels(deep):
    _, _, traced, profile = deep
    table = build_strategy_table(traced, profile, MESH, device=DEVICE)
    gelu = next(n for n in table.nodes.values() if n.op == "gelu")
    tensor_bytes = 32 * 64 * 4
    # Split over the batch: half of x and y forward; dy, x and dx backward.
    split = _strategy(gelu, ("S0R",), ("S0R",))
    assert gelu.compute_s[split] == pytest.approx(5 * tensor_bytes / 2 / 1e9 + 2 * 1e-5)
    whole = _strategy(gelu, ("RR",), ("RR",))
    assert gelu.compute_s[whole] == pytest.approx(5 * tensor_bytes / 1e9 + 2 * 1e-5)
    # The first linear layer: the roofline of its FLOPs and bytes; three kernels
    # (forward, weight and bias gradients: the model's input needs none).
    linear = next(n for n in table.nodes.values() if n.op == "linear")
    flops = profile.by_name[linear.name].fwd_flops + profile.by_name[linear.name].bwd_flops
    dp = _strategy(linear, ("S0R", "RR", "R"), ("S0R",))
    moved = (32 * 64 / 2 + 64 * 64 + 64 + 32 * 64 / 2) * 4
    expected = max(flops / 2 / 1e9, (2 * moved + (64 * 64 + 64) * 4) / 1e9) + 3 * 1e-5
    assert linear.compute_s[dp] == pytest.approx(expected)


def test_views_cost_their_kernels_only(deep):
    _, _, traced, profile = deep
    table = build_strategy_table(traced, profile, MESH, device=DEVICE)
    views = [n for n in table.nodes.values() if n.kind == "view" or n.op in ("t", "transpose")]
    for node in views:
        assert np.allclose(node.compute_s, 2e-5)  # forward and backward kernel, no bytes


@pytest.mark.parametrize("optimizer", ["sgd", "sgd_momentum", "adamw"])
def test_optimizer_step_priced_per_parameter_shard(deep, optimizer):
    _, _, traced, profile = deep
    table = build_strategy_table(traced, profile, MESH, device=DEVICE, optimizer=optimizer)
    weight = table.nodes[traced.parameters["layers.0.weight"].node]
    passes, kernels = OPTIMIZER_STEP[optimizer]
    whole = weight.out_specs.index(("RR",))
    half = weight.out_specs.index(("S0R",))
    assert weight.optimizer_s[whole] == pytest.approx(passes * 64 * 64 * 4 / 1e9 + kernels * 1e-5)
    assert weight.optimizer_s[half] == pytest.approx(passes * 64 * 32 * 4 / 1e9 + kernels * 1e-5)
    # It is part of the ILP's objective: a sharded parameter steps faster.
    assert weight.time_s[half] < weight.time_s[whole]


def test_overlapped_step_lies_between_compute_alone_and_everything_in_sequence(deep):
    model, x, traced, profile = deep
    _, dp = forced_plan(model, (x,), _loss, MESH, params={}, inputs={"args_0": BATCH},
                        device=DEVICE)
    t = dp.step_time
    assert t["gradient_sync_s"] > 0 and t["optimizer_s"] > 0 and t["buckets"] == 1
    compute_alone = t["forward_s"] + t["backward_s"] + t["optimizer_s"]
    assert compute_alone <= t["step_s"] <= t["sequential_s"]
    assert dp.predicted_step_s == t["step_s"]
    # One bucket, ready only when the backward reaches the first layer: nothing hides it.
    assert t["exposed_sync_s"] == pytest.approx(t["gradient_sync_s"])
    # Small buckets start while the backward still runs: part of the sync is hidden.
    table = build_strategy_table(traced, profile, MESH, device=DEVICE)
    choice = choice_of_plan(table, dp)
    small = step_time(profile, table, choice, bucket_bytes=(64 * 64 + 64) * 4)
    assert small.buckets == 4  # one per layer (weight and bias)
    assert small.gradient_sync_s > t["gradient_sync_s"]  # more latency, paid four times
    assert small.exposed_sync_s < small.gradient_sync_s
    assert small.forward_s + small.backward_s + small.optimizer_s <= small.step_s
    assert small.step_s <= small.sequential_s


def test_deferred_gradients_are_the_data_parallel_parameters(deep):
    model, x, traced, profile = deep
    _, dp = forced_plan(model, (x,), _loss, MESH, params={}, inputs={"args_0": BATCH},
                        device=DEVICE)
    table = build_strategy_table(traced, profile, MESH, device=DEVICE)
    deferred = deferred_gradients(table, choice_of_plan(table, dp))
    assert sorted(deferred) == sorted(s.node for s in traced.parameters.values())
    assert all(axes == (0,) for axes, _ in deferred.values())
    # A Megatron plan reduces no parameter gradient over the batch.
    _, megatron = forced_plan(model, (x,), _loss, MESH, params={
        r"layers\.0\.weight": "S0R", r"layers\.0\.bias": "S0", r"layers\.1\.weight": "RS0"},
        inputs={"args_0": "RR"}, device=DEVICE)
    choice = choice_of_plan(table, megatron)
    first = traced.parameters["layers.0.weight"].node
    assert first not in deferred_gradients(table, choice)


def test_reprice_under_other_speeds(deep):
    _, _, traced, profile = deep
    found = plan_traced(traced, profile, MESH, device=DEVICE)
    same = reprice(traced, profile, found, DEVICE)
    assert same.step_s == pytest.approx(found.predicted_step_s)
    faster = DeviceProfile(1e10, 1e10, 1e-6)
    again = reprice(traced, profile, found, faster)
    assert again.forward_s < same.forward_s and again.optimizer_s < same.optimizer_s


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_buckets_priced_are_the_buckets_generated(deep):
    """What runs is what was priced: the generated program's gradient buckets
    hold the parameters the step-time model defers, and as many buckets."""
    from automap.launch import run_on_gloo
    from planner_workers import generated_buckets

    model, x, traced, profile = deep
    _, dp = forced_plan(model, (x,), _loss, MESH, params={}, inputs={"args_0": BATCH},
                        device=DEVICE)
    table = build_strategy_table(traced, profile, MESH, device=DEVICE)
    choice = choice_of_plan(table, dp)
    bucket_bytes = (64 * 64 + 64) * 4  # a layer's weight and bias
    buckets = run_on_gloo(generated_buckets, 2, dp.to_dict(), bucket_bytes, timeout_s=240)[0]
    predicted, _ = gradient_buckets(table, choice, bucket_bytes=bucket_bytes)
    node_of = {s.node: name for name, s in traced.parameters.items()}
    assert [([node_of[p] for p in b.params], b.axes) for b in predicted] == buckets
    assert len(buckets) == step_time(profile, table, choice, bucket_bytes=bucket_bytes).buckets == 4
