"""Plans over several mesh axes priced as the collectives run (issue 14, point
5): the bytes each axis carries, and GPT-2 on the issue's 2x4 mesh (slow axis
0, fast axis 1) using both axes because per-axis all-reduces make it faster."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from automap.planner.search import plan
from automap.planner.traffic import collective_bytes_per_axis
from hierarchical_collectives import MESH, data_parallel, plans


def test_bytes_per_axis_of_a_data_parallel_linear():
    torch.manual_seed(0)
    # Slow compute: the batch is split over all 8 devices.
    p = plan(nn.Linear(1024, 1024, bias=False), (torch.randn(64, 1024),), MESH,
             strategy_filter=data_parallel, flops_per_s=1e9)
    assert p.nodes["linear"].inputs == ["S01R", "RR"]
    weight = 1024 * 1024 * 4
    # The weight gradient's all-reduce over both axes: reduce-scatter along axis 1
    # (3/4 of 4 MiB), all-reduce of the quarter along axis 0 (2 * 1/2 of 1 MiB),
    # all-gather along axis 1 (3/4 of 4 MiB); the loss's 4-byte sum is one ring.
    steps = MESH.collective_plan("all_reduce", weight, (0, 1)).steps
    assert [(s.kind, s.axes) for s in steps] == [
        ("reduce_scatter", [1]), ("all_reduce", [0]), ("all_gather", [1])]
    axis0, axis1 = collective_bytes_per_axis(p)
    loss = 2 * 7 / 8 * 4
    assert axis0 == pytest.approx(weight / 4 + loss)
    assert axis1 == pytest.approx(2 * 3 / 4 * weight + loss)


@pytest.mark.timeout(300)
def test_gpt2_uses_both_axes_when_the_model_says_it_is_faster():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = plans(layers=2, which=("planner's choice", "axis 0 idle"))
    best, idle = found["planner's choice"], found["axis 0 idle"]
    axis0, axis1 = collective_bytes_per_axis(best)
    assert axis0 > 10e6 and axis1 > 10e6
    assert collective_bytes_per_axis(idle)[0] == 0
    assert best.predicted_step_s < 0.95 * idle.predicted_step_s
