"""Mixed precision in planning (one process): the traced graph computes in the
low dtype with float32 parameters, the planner prices that dtype, the Plan
records the setting (older records without it still load) and refuses a graph
traced with another setting; bad settings are typed errors."""

from __future__ import annotations

import json

import pytest
import torch

import automap
from automap.errors import InvalidArgumentError, InvalidPlanError, StalePlanError
from automap.planner.plan import Plan
from automap.planner.search import parameter_dtype
from automap.planner.validate import content_fingerprint
from automap.trace.profiling import profile_traced
from automap.trace.tracing import trace
from serial import build
from speeds import speeds


@pytest.fixture(scope="module")
def planned():
    model, inputs, loss_fn = build("mlp")
    mesh = automap.DeviceMesh((2,))
    plans = {setting: automap.plan(model, inputs, mesh, loss_fn=loss_fn,
                                   mixed_precision=setting, **speeds(1e9))
             for setting in (None, "bf16")}
    return model, inputs, loss_fn, plans


def test_the_graph_computes_in_the_low_dtype_with_fp32_parameters():
    model, inputs, loss_fn = build("mlp")
    traced = trace(model, inputs, loss_fn=loss_fn, mixed_precision="bf16")
    assert traced.mixed_precision == automap.MixedPrecision(torch.bfloat16, torch.float32)
    assert {s.dtype for s in traced.parameters.values()} == {torch.float32}
    linears = [n for n in traced.nodes.values() if n.op == "aten.linear.default"]
    assert linears and all(n.outputs[0].dtype == torch.bfloat16 for n in linears)
    # Autocast's casts are graph nodes: each parameter and the input once.
    casts = [n for n in traced.nodes.values() if n.op == "aten._to_copy.default"]
    assert len(casts) == len(traced.parameters) + 2  # + the input, + the logits to fp32
    assert parameter_dtype(traced) == torch.bfloat16  # the FLOP rate is measured in bf16


def test_the_plan_records_prices_and_checks_the_setting(planned):
    model, inputs, loss_fn, plans = planned
    full, low = plans[None], plans["bf16"]
    assert full.mixed_precision is None and "mixed_precision" not in full.to_dict()
    assert low.mixed_precision == automap.MixedPrecision(torch.bfloat16)
    again = Plan.from_dict(json.loads(low.to_json()))
    assert again.mixed_precision == low.mixed_precision
    # The low dtype's bytes are priced: a matmul's output is half the bytes.
    profiles = {k: profile_traced(trace(model, inputs, loss_fn=loss_fn, mixed_precision=k))
                for k in (None, "bf16")}
    outs = {k: [n.fwd_out_bytes for n in p.nodes if n.op == "aten.linear.default"]
            for k, p in profiles.items()}
    assert outs["bf16"] and [2 * b for b in outs["bf16"]] == outs[None]
    traced_full = trace(model, inputs, loss_fn=loss_fn)
    with pytest.raises(StalePlanError, match="mixed precision bfloat16"):
        low.check_matches(traced_full)
    traced_low = trace(model, inputs, loss_fn=loss_fn, mixed_precision="bf16")
    with pytest.raises(StalePlanError, match="full precision"):
        full.check_matches(traced_low)
    low.check_matches(traced_low)


def test_a_bad_recorded_setting_is_refused(planned):
    data = planned[3]["bf16"].to_dict()
    data["mixed_precision"]["param_dtype"] = "float32"
    data["content_fingerprint"] = content_fingerprint(data)
    with pytest.raises(InvalidPlanError, match="mixed_precision"):
        Plan.from_dict(data)


@pytest.mark.parametrize("bad", ["int8", "bfloat16", torch.bfloat16, 16])
def test_bad_settings_are_typed_errors(bad):
    model, inputs, loss_fn = build("mlp")
    with pytest.raises(InvalidArgumentError, match="mixed_precision must be"):
        trace(model, inputs, loss_fn=loss_fn, mixed_precision=bad)
    with pytest.raises(InvalidArgumentError, match="param_dtype"):
        automap.MixedPrecision(torch.float32)
    with pytest.raises(InvalidArgumentError, match="reduce_dtype"):
        automap.MixedPrecision(torch.float16, torch.int32)


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16])
def test_data_parallel_gradients_are_priced_as_buckets_in_the_reduce_dtype(reduce_dtype):
    # The generator buckets a parameter's gradient through its cast (summed
    # before the cast's backward, in reduce_dtype, beside the backward): the
    # step time prices that bucket, not an in-graph all-reduce of the bf16
    # gradient of the cast.
    from forced_plans import BATCH, forced_plan

    model, inputs, loss_fn = build("mlp")
    mesh = automap.DeviceMesh((2,))
    setting = automap.MixedPrecision(torch.bfloat16, reduce_dtype)
    _, plan = forced_plan(model, inputs, loss_fn, mesh, params={}, inputs={"args_0": BATCH},
                          mixed_precision=setting)
    parts = plan.step_time
    params_bytes = sum(p.numel() for p in model.parameters()) * reduce_dtype.itemsize
    assert parts["buckets"] == 1  # the MLP's gradients fit one 25 MiB bucket
    assert parts["gradient_sync_s"] == pytest.approx(mesh.all_reduce_cost_s(params_bytes, (0,)))
    # The bytes per axis count the bucket too: the float32 plan's bytes, scaled
    # to the reduce dtype.
    from automap.planner.traffic import collective_bytes_per_axis

    _, full = forced_plan(model, inputs, loss_fn, mesh, params={}, inputs={"args_0": BATCH})
    assert collective_bytes_per_axis(plan)[0] == pytest.approx(
        collective_bytes_per_axis(full)[0] * reduce_dtype.itemsize / 4, rel=1e-4)


@pytest.mark.parametrize("rnn", [torch.nn.GRU, torch.nn.LSTM])
def test_a_recurrent_op_autocast_decomposes_runs_in_one_dtype(rnn):
    """Autocast casts a GRU's or LSTM's weights inside the op's decomposition
    (its inner linears), not its input or state: those casts in front of the
    whole op mixed bf16 weights with a float32 input, and the generated module
    failed at its first call (found by a sweep as a new user). The op keeps one
    dtype, and the graph gives eager autocast's loss (to bf16's tolerance)."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn, self.fc = rnn(6, 8, batch_first=True), torch.nn.Linear(8, 1)

        def forward(self, x):
            return self.fc(self.rnn(x)[0][:, -1]).pow(2).mean()

    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 5, 6)
    traced = trace(model, (x,), loss_fn=lambda out: out, mixed_precision="bf16")
    gm = traced.exported.graph_module
    for node in gm.graph.nodes:
        if node.op == "call_function" and any(k in str(node.target) for k in ("gru", "lstm")):
            dtypes = {a.meta["val"].dtype for a in node.all_input_nodes
                      if a.meta["val"].dtype.is_floating_point}
            assert len(dtypes) == 1, (node, dtypes)
    ours = traced.exported.module()(x).item()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            eager = model(x).item()
    except RuntimeError as err:  # oneDNN without bf16 RNN kernels (an AVX2-only CPU)
        if "primitive descriptor" not in str(err):
            raise
        pytest.skip(f"eager autocast cannot run a bf16 {rnn.__name__} on this CPU: {err}")
    assert ours == pytest.approx(eager, rel=3e-2)
