"""Issue 19, point 1: ``Plan.placements()`` gives every parameter's DTensor
placements by the user's names, with no process group (the generated module's
``state_dict()`` holds the same: tests/api/test_checkpoint_dcp.py)."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.placement_types import _StridedShard

from automap import DeviceMesh
from automap.planner.search import plan as solve_plan
from automap.sharding.spec import to_dtensor_placements
from forced_plans import axis_1_outermost
from serial import build
from speeds import FAST


def test_placements_by_user_name_without_a_process_group():
    assert not dist.is_initialized()
    model, inputs, loss_fn = build("gpt2")
    loose = solve_plan(model, inputs, DeviceMesh((2, 2)), loss_fn=loss_fn, **FAST)
    plan = solve_plan(model, inputs, DeviceMesh((2, 2)), loss_fn=loss_fn, checkpointing="off",
                      memory_budget_bytes=0.6 * loose.predicted_peak_memory_bytes,
                      strategy_filter=axis_1_outermost, **FAST)
    exact = plan.placements(model)
    assert set(exact) == set(model.state_dict())  # every name, tied lm_head.weight too
    assert exact["lm_head.weight"] == exact["transformer.wte.weight"]
    for node in plan.nodes.values():
        if node.name == "p_model_transformer_h_0_mlp_c_proj_weight":
            assert exact["transformer.h.0.mlp.c_proj.weight"] == tuple(
                to_dtensor_placements(node.outputs[0], plan.mesh))
    strided = [n for n, ps in exact.items() if any(isinstance(p, _StridedShard) for p in ps)]
    assert "transformer.h.0.mlp.c_proj.weight" in strided, plan.placements(model)
    assert exact["transformer.h.0.ln_1.weight"] == (Replicate(), Replicate())
    # Without the model: the same names (GPT-2's are lowercase); each tied name its own.
    named = plan.placements()
    assert set(named) == set(exact)
    assert {k: v for k, v in named.items() if k != "lm_head.weight"} == \
        {k: v for k, v in exact.items() if k != "lm_head.weight"}
