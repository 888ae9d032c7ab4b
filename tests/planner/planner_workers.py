"""Gloo workers of the planner tests (spawned: module level, importable)."""

from __future__ import annotations

import torch

from test_step_time import Deep, _loss


def generated_buckets(rank: int, world: int, plan_dict: dict, bucket_bytes: int) -> list:
    """The generated module's gradient buckets: (parameter names, axes) each."""
    from automap.generate.program import generate
    from automap.planner.plan import Plan
    from automap.trace.tracing import trace

    torch.manual_seed(0)
    model, x = Deep(), torch.randn(32, 64)
    plan = Plan.from_dict(plan_dict)
    module = generate(trace(model, (x,), loss_fn=_loss), plan, model,
                      plan.mesh.process_groups(), grad_bucket_bytes=bucket_bytes)
    names = {id(p): n for n, p in module.named_parameters()}
    return [([names[id(p)] for p in b.params], tuple(b.group.axes))
            for b in module.gradient_sync.buckets]
