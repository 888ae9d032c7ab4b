"""Run inside spawned gloo processes: ``automap.autoparallelize`` with a pipeline,
trained with the usual loop next to the serial model."""

from __future__ import annotations

import torch


def train_autoparallelized(rank: int, world: int, name: str, pipeline, microbatches: int,
                           schedule: str) -> dict:
    import automap
    import pipeline_plans as pp
    from pipeline_workers import STEPS, _serial
    from serial import ADAMW_EPS, max_diff
    from speeds import speeds

    model, args, kwargs, _ = pp.build_case(name, microbatches)
    module = automap.autoparallelize(model, kwargs or args, (world,), pipeline=pipeline,
                                     microbatches=microbatches, schedule=schedule,
                                     **speeds(1e6))
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.01, eps=ADAMW_EPS)
    losses = []
    for _ in range(STEPS):
        loss = module(*args, **kwargs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    serial_losses, _, serial_params = _serial(model, args, kwargs, STEPS)
    params = {k: v for k, v in module.module.full_state_dict().items() if k in serial_params}
    return {"type": type(module).__name__, "stages": len(module.plan.pipeline.stages),
            "rel_loss": max(abs(a - b) / abs(b) for a, b in zip(losses, serial_losses)),
            "rel_param": max_diff(params, serial_params)[0], "params": sorted(params)}
