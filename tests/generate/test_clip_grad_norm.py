"""Gradient-norm clipping of a generated module is the serial model's: the norm
of the whole model (every shard once, a tied weight once across stages), the
same on every rank, and every gradient scaled alike. torch's
``clip_grad_norm_`` over ``module.parameters()`` takes each rank's shards for
the model (a new-user sweep: norms 0.448 and 0.425 on two ranks where the
serial one is 0.570, replicas drifting apart)."""

from __future__ import annotations

import math

import pytest
import torch

import automap
from automap import DeviceMesh, InvalidArgumentError
from automap.launch import run_on_gloo
from clip_workers import build, clip, serial

pytestmark = pytest.mark.multiprocess

#: A slow device on fast links: the MLP's weights are sharded.
SLOW = dict(flops_per_s=1e6, memory_bandwidth_bytes_per_s=1e15, op_overhead_s=1e-12)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clip")
    mlp, inputs = build("mlp")
    sharded = automap.plan(mlp, inputs, DeviceMesh((2, 2)), loss_fn=lambda loss: loss, **SLOW)
    assert any(str(p) != "(Replicate(), Replicate())"
               for p in sharded.placements(mlp).values()), "the test needs sharded weights"
    sharded.to_json(folder / "mlp.json")
    gpt, inputs = build("gpt")
    piped = automap.plan(gpt, inputs, DeviceMesh((4,)), loss_fn=lambda loss: loss, pipeline=2,
                         microbatches=2, schedule="gpipe", **SLOW)
    piped.to_json(folder / "gpt.json")
    cases = [("mlp", str(folder / "mlp.json"), 0.05, 2.0),
             ("mlp", str(folder / "mlp.json"), 0.05, math.inf),
             ("mlp", str(folder / "mlp.json"), 1e9, 2.0),
             ("gpt", str(folder / "gpt.json"), 0.05, 2.0)]
    return cases, run_on_gloo(clip, 4, cases, timeout_s=300)


@pytest.mark.timeout(600)
def test_every_rank_clips_by_the_serial_models_norm(runs):
    cases, results = runs
    for i, (name, _, max_norm, norm_type) in enumerate(cases):
        expected, grads = serial(name, max_norm, norm_type)
        norms = [r[i][0] for r in results]
        assert all(abs(n - expected) <= 1e-12 * expected for n in norms), (cases[i], norms,
                                                                           expected)
        clipped = results[0][i][1]
        if clipped is not None:
            assert clipped.keys() == grads.keys()
            for key, value in grads.items():
                torch.testing.assert_close(clipped[key], value, rtol=1e-12, atol=1e-15)


@pytest.mark.timeout(60)
def test_bad_clip_arguments_are_typed():
    from automap.generate.grad_norm import check_norm_arguments

    for max_norm, norm_type in ((-1.0, 2.0), (1.0, 0.0), ("a", 2.0), (float("nan"), 2.0)):
        with pytest.raises(InvalidArgumentError):
            check_norm_arguments(max_norm, norm_type)
