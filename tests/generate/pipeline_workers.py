"""Functions run inside spawned gloo processes by the pipeline runtime's tests:
train a pipelined module next to the serial model (float64, full batch) and
report the differences each rank sees on its own stage."""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist

from automap.generate.pipeline import generate_pipeline
from automap.planner.plan import Plan
from generate_workers import COLLECTIVE_NAMES
from serial import ADAMW_EPS, GRAD_FLOOR, max_diff

STEPS = 3


def _serial(model, args, kwargs, steps: int):
    """Losses, first-step gradients and final parameters of the serial model on
    the whole batch (AdamW, as the parallel run)."""
    serial = copy.deepcopy(model)
    opt = torch.optim.AdamW(serial.parameters(), lr=1e-3, weight_decay=0.01, eps=ADAMW_EPS)
    losses, grads = [], None
    for _ in range(steps):
        out = serial(*args, **kwargs)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in serial.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads, dict(serial.named_parameters())


def train_pipelined(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """For each case (model name, plan dict): STEPS AdamW steps of the pipelined
    module against the serial model; this rank's largest relative errors."""
    from automap.trace.tracing import default_loss, trace
    from pipeline_plans import build_case

    results = []
    built: dict[str, tuple] = {}  # per model: built, traced and run serially once
    for case in cases:
        start = time.perf_counter()
        plan = Plan.from_dict(case["plan"])
        for k in case.get("recompute", ()):
            # StageRecord.recompute comes with the planner's stage search; set here
            # (read duck-typed by the runtime) until the record has the field.
            object.__setattr__(plan.pipeline.stages[k], "recompute", True)
        key = (case["model"], plan.pipeline.microbatches)
        if key not in built:
            model, args, kwargs, micro = build_case(*key)
            traced = trace(model, micro, loss_fn=default_loss)
            built[key] = (model, args, kwargs, traced, _serial(model, args, kwargs, STEPS))
        model, args, kwargs, traced, serial = built[key]
        module = generate_pipeline(traced, plan, model, grad_bucket_bytes=case.get("bucket"))
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.01, eps=ADAMW_EPS)
        losses, grads = [], None
        for _ in range(STEPS):
            loss = module(*args, **kwargs)
            loss.backward()
            if grads is None:
                grads = {}  # every chunk this rank runs (interleaved: several)
                for chunk in module.chunks:
                    grads.update(chunk.full_state_dict(gradients=True))
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        params = {}
        for chunk in module.chunks:
            params.update(chunk.full_state_dict())
        serial_losses, serial_grads, serial_params = serial
        params = {k: v for k, v in params.items() if k in serial_params}
        rel_loss = max(abs(a - b) / abs(b) for a, b in zip(losses, serial_losses))
        rel_grad, _, worst_grad = max_diff(grads, serial_grads, floor=GRAD_FLOOR)
        rel_param, _, worst_param = max_diff(params, serial_params)
        results.append({
            "case": {k: v for k, v in case.items() if k != "plan"}, "rank": rank,
            "stage": module.stage.index, "chunks": [b.index for b in module.built],
            "losses": losses, "serial_losses": serial_losses,
            "rel_loss": rel_loss, "rel_grad": rel_grad, "worst_grad": worst_grad,
            "rel_param": rel_param, "worst_param": worst_param, "grads": sorted(grads),
            "collectives": sorted(c for c in COLLECTIVE_NAMES
                                  if any(c in chunk.code for chunk in module.chunks)),
            "buckets": sum(len(chunk.gradient_sync.buckets) for chunk in module.chunks),
            "seconds": time.perf_counter() - start})
        dist.barrier()
    return results


def misuse(rank: int, world: int, plan_dict: dict) -> list[str]:
    """A pipelined module from ``automap.apply`` (the whole batch as example
    inputs), used wrongly: a scaled loss's backward, inputs of another batch
    size, gradients reset between the forward and ``backward()`` (set to None
    or zeroed); and its loss under no_grad."""
    import automap
    from automap.errors import InputMismatchError, PipelineError
    from automap.generate.pipeline import PipelineModule
    from pipeline_plans import build_case

    plan = Plan.from_dict(plan_dict)
    model, args, kwargs, _ = build_case("mlp", plan.pipeline.microbatches)
    module = automap.apply(plan, model, args)
    seen = [] if isinstance(module, PipelineModule) else ["not a PipelineModule"]
    loss = module(*args, **kwargs)
    try:
        (2 * loss).backward()
    except PipelineError:
        seen.append("scaled backward")
    try:
        module(args[0][:3], args[1][:3])
    except InputMismatchError:
        seen.append("batch size")
    for set_to_none in (True, False):  # zero_grad between the forward and backward()
        loss = module(*args, **kwargs)
        for p in module.parameters():
            if p.grad is not None:
                p.grad = None if set_to_none else p.grad.zero_()
        try:
            loss.backward()
        except PipelineError:
            seen.append("gradients reset")
    twice = module(*args, **kwargs) + module(*args, **kwargs)  # accumulating: no false alarm
    twice.backward()
    with torch.no_grad():
        evaluated = module(*args, **kwargs)
    seen.append(f"eval {evaluated.item():.12f} train {loss.item():.12f}")
    return seen
