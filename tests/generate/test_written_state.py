"""State an op writes in place (a training batch norm's running statistics,
whose schema does not mark them) must reach the op as stored: a conversion
would make the op update a copy and lose the update. The planner never
chooses such a plan when another exists, and the generator refuses one
(a ResNet plan once lost ``running_mean`` this way on (4,))."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from automap import AutomapError, DeviceMesh
from automap.planner.search import plan
from forced_plans import forced_plan, output_is
from speeds import speeds

MESH = DeviceMesh((4,))


def _conv_bn():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
    x = torch.randn(4, 3, 8, 8)
    return model, (x,), lambda out: out.pow(2).mean()


def test_the_planner_keeps_running_statistics_as_stored():
    model, inputs, loss_fn = _conv_bn()
    for flops in (1e6, 1e9, 1e12):
        p = plan(model, inputs, MESH, loss_fn=loss_fn, **speeds(flops))
        stats = [e for e in p.edges
                 if p.nodes[e.consumer].op == "batch_norm" and e.input_index in (3, 4)]
        assert len(stats) == 2
        assert all(e.src == e.dst for e in stats), (flops, stats)


def test_the_generator_refuses_a_converted_running_statistic():
    model, inputs, loss_fn = _conv_bn()
    # Force the running mean stored split and the batch norm to read it whole:
    # the generator refuses the plan (planning simulates it, so planning fails).
    with pytest.raises(AutomapError, match="write would be lost"):
        forced_plan(model, inputs, loss_fn, MESH, params={},
                    ops={"b_model_1_running_mean": output_is("S0"),
                         "batch_norm": lambda ins, outs: ins[0] == "RRRR"})
