"""The one-line API on 2 gloo ranks (one spawn): typed errors with the fix in the
message, the default 1-D mesh, apply(plan, ...), rank-local inputs, inputs that
were one tensor when planning and differ when training, gradient
accumulation through the bucketed sync, and meta-device models initialised
shard by shard. A plan made and saved without a process group, applied on the
ranks with no example inputs (``automap.apply(plan, model)``)."""

from __future__ import annotations

import pytest

import automap
from api_workers import api_checks, apply_saved_plans
from automap.launch import run_on_gloo
from serial import build

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(400)
def test_api_on_two_ranks():
    results = run_on_gloo(api_checks, 2, timeout_s=300)
    for r in results:
        assert "torchrun --nproc-per-node 4" in r["mesh_error"]
        assert "DeviceMesh((2,))" in r["mesh_error"]
        assert "re-plan" in r["stale_error"]
        assert r["default_mesh"] == (2,)
        assert r["cluster_mesh"] == (2,)
        got, want = r["cluster_loss"]
        assert abs(got - want) <= 1e-5 * abs(want)
        parallel, serial = r["default_loss"]
        assert parallel == pytest.approx(serial, rel=1e-5)
        assert r["applied_loss"] == pytest.approx(serial, rel=1e-5)
        assert r["applied_without_inputs_loss"] == pytest.approx(serial, rel=1e-5)
        assert "pass example_inputs" in r["no_inputs_error"]
        assert r["local_loss"] == pytest.approx(serial, rel=1e-5)
        parallel, serial = r["gpt2_distinct_inputs"]
        assert parallel == pytest.approx(serial, rel=1e-5)
        assert r["buckets"] >= 1 and r["accumulated_grad_diff"] < 1e-5
        assert r["meta_same_under_plans"] and r["meta_initialised"] and r["meta_still_meta"]
        dp, megatron, reference = r["meta_losses"]
        assert dp == pytest.approx(reference, rel=1e-5)
        assert megatron == pytest.approx(reference, rel=1e-5)
    # Every rank initialised the meta model identically.
    assert results[0]["meta_losses"] == results[1]["meta_losses"]


@pytest.mark.timeout(400)
def test_apply_a_saved_plan_without_inputs(tmp_path):
    """automap.plan in this process (no process group), the plan saved as JSON; on
    2 ranks automap.apply(Plan.from_json(path), model) traces stand-ins of the
    recorded input shapes and dtypes (floats, and a Hugging Face model's integer
    ids as keyword arguments) and trains like the serial model."""
    paths = {}
    for name in ("mlp", "gpt2"):
        model, inputs, loss_fn = build(name)
        plan = automap.plan(model, inputs, automap.DeviceMesh((2,)), loss_fn=loss_fn,
                            flops_per_s=1e6)
        assert plan.inputs is not None
        paths[name] = str(tmp_path / f"{name}.json")
        plan.to_json(paths[name])
    results = run_on_gloo(apply_saved_plans, 2, paths, timeout_s=300)
    for r in results:
        for name in paths:
            got = r[name]
            assert got["bytes"] < got["full_bytes"], f"{name}: the plan shards nothing"
            for parallel, serial in zip(got["losses"], got["serial_losses"], strict=True):
                assert parallel == pytest.approx(serial, rel=1e-5), name
