"""Inside spawned gloo processes for tests/generate/test_fsdp_gloo.py: the measured
peak of one training step under a plan, next to the plan's simulated peak."""

from __future__ import annotations

import torch
import torch.distributed as dist

from automap import DeviceMesh
from automap.generate.program import generate
from automap.planner.plan import Plan
from generate_workers import make_plan
from serial import build, call_module
from trust_workers import measure_training


def measure_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Per case (model, mesh dict, plan kind): this rank's measured peak of live
    tensor bytes in an AdamW step (``trust_workers.measure_training``) and the
    plan's simulated one."""
    from automap.trace.tracing import default_loss, trace

    out = []
    for case in cases:
        mesh = DeviceMesh.from_dict(case["mesh"])
        model, inputs, loss_fn = build(case["model"])
        traced = trace(model, inputs, loss_fn=loss_fn or default_loss)
        payload = [None]
        if rank == 0:
            payload = [make_plan(case["plan"], model, inputs, loss_fn, mesh).to_dict()]
        dist.broadcast_object_list(payload, src=0)
        plan = Plan.from_dict(payload[0])
        module = generate(traced, plan, model, mesh.process_groups())
        measured = _measure(module, inputs)
        out.append({"case": case, "peak_bytes": measured["peak_bytes"],
                    "simulated_bytes": plan.predicted_peak_memory_bytes,
                    "modelled_bytes": plan.solver.get("modelled_peak_bytes"),
                    "budget_bytes": plan.memory_budget_bytes, "code": module.code})
    return out


def _measure(module, inputs) -> dict:
    """``measure_training`` of AdamW steps of ``module`` on ``inputs``."""
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)

    def step() -> float:
        loss = call_module(module, inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def persistent() -> list:
        state = [t for s in opt.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor)]
        leaves = [t for t in (inputs if isinstance(inputs, (list, tuple)) else inputs.values())
                  if isinstance(t, torch.Tensor)]
        return [*module.parameters(), *module.buffers(), *leaves, *state]

    return measure_training(step, persistent, 0, 2)
