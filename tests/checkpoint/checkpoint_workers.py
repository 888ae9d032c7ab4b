"""Functions run inside spawned gloo processes by the checkpointing tests: a
plan checkpointed within a budget runs next to the same plan without
checkpoints; both report losses, gradients and the measured activation peak."""

from __future__ import annotations

import copy
import dataclasses
import logging

import torch
from torch import nn

from automap import DeviceMesh, InfeasibleBudgetError
from automap.generate.program import generate
from automap.planner.search import plan as solve_plan
from model_zoo import allocation_peak_bytes
from serial import call_module
from speeds import speeds

logging.getLogger("transformers").setLevel(logging.ERROR)


def build(name: str):
    """``(model, inputs, loss_fn)`` of the models whose memory is measured: a
    GPT-2-small-ish Hugging Face model (short sequence, narrow) and a
    ResNet-style convnet, both without dropout."""
    torch.manual_seed(0)
    if name == "gpt2":
        import model_zoo
        from automap.trace.tracing import default_loss

        model = model_zoo.dropout_free_gpt2_lm(6, 128, 4, 512, 128)
        ids = torch.randint(0, 512, (8, 128))
        return model, {"input_ids": ids, "labels": ids}, default_loss
    if name == "resnet":
        import model_zoo

        model = model_zoo.ResNet(width=16)
        x = torch.randn(8, 3, 32, 32)
        y = torch.randint(0, 10, (8,))
        return model, (x,), lambda out: nn.functional.cross_entropy(out, y)
    raise ValueError(name)


def activation_peak_bytes(module, inputs) -> tuple[float, int]:
    """Loss, and the peak of tensor bytes allocated beyond what was live before
    one forward and backward (parameters, their gradient buffers, inputs): the
    activations, their gradients and temporaries. Measured from the CPU
    allocator's events in the PyTorch profiler: the least of two steps, since
    gloo now and then frees a buffer late on one rank (open in issue 14; the
    trust bench shows it), and this test is about the plan's own memory."""
    call_module(module, inputs).backward()  # gradient buffers exist from here on
    module.zero_grad(set_to_none=False)
    peaks = []
    for _ in range(2):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    profile_memory=True) as prof:
            loss = call_module(module, inputs)
            loss.backward()
            del loss
        peaks.append(allocation_peak_bytes(prof))
        module.zero_grad(set_to_none=False)
    peak = min(peaks)
    loss = call_module(module, inputs)
    loss.backward()
    return loss.item(), peak


def checkpoint_case(rank: int, world: int, name: str, fraction: float) -> dict:
    """Plan ``name`` on a (world,) mesh with checkpointing only, once within
    an unlimited budget, then within the budget ``fraction`` of the way from
    the least that fits to what no checkpointing needs; run the checkpointed
    plan and the same plan without checkpoints; measure."""
    import torch.distributed as dist

    model, inputs, loss_fn = build(name)
    mesh = DeviceMesh((world,))
    # Slow devices: on more than one, splitting the batch pays.
    options = {"loss_fn": loss_fn, "checkpointing": "only", **speeds(1e9)}
    roomy = solve_plan(model, inputs, mesh, 2**40, **options)
    assert roomy.checkpoint is None  # it fits without checkpoints
    try:
        solve_plan(model, inputs, mesh, 1.0, **options)
    except InfeasibleBudgetError as err:
        least = err.smallest_feasible_budget_bytes
    # ``fraction`` of the way from the least budget that fits to the unconstrained peak.
    budget = int(least + fraction * (roomy.predicted_peak_memory_bytes - least))
    tight = solve_plan(model, inputs, mesh, budget, **options)
    plain = dataclasses.replace(tight, checkpoint=None)

    from automap.trace.tracing import trace

    traced = trace(model, inputs, loss_fn=loss_fn)
    groups = mesh.process_groups()
    out = {"budget_bytes": budget,
           "activation_budget_bytes": tight.checkpoint.activation_budget_bytes,
           "predicted_bytes": tight.checkpoint.predicted_activation_peak_bytes,
           "predicted_full_bytes": roomy.predicted_peak_memory_bytes,
           "blocks": tight.checkpoint.block_count(), "stages": len(tight.checkpoint.stages),
           "recompute_s": tight.checkpoint.recompute_s,
           "sharded_nodes": sum(any(s != "R" * len(s) for s in n.outputs)
                                for n in tight.nodes.values())}
    results, state = {}, {}
    for label, p in (("checkpointed", tight), ("plain", plain)):
        module = generate(traced, p, copy.deepcopy(model), groups)
        loss, peak = activation_peak_bytes(module, inputs)
        grads = module.full_state_dict(gradients=True)
        results[label] = (loss, peak, grads)
        state[label] = {k: v for k, v in module.full_state_dict().items()
                        if k not in grads}  # buffers: updated once per step either way
        if label == "checkpointed":
            out["code_has_checkpoint"] = "torch.utils.checkpoint.checkpoint" in module.code
            # What the activation peak comes on top of: parameter shards, their
            # gradient buffers, buffers and the inputs.
            held = [*module.parameters(), *(p.grad for p in module.parameters()
                                            if p.grad is not None), *module.buffers(),
                    *(t for t in torch.utils._pytree.tree_leaves(inputs)
                      if isinstance(t, torch.Tensor))]
            out["held_bytes"] = sum(t.untyped_storage().nbytes() for t in held)
    (loss_c, peak_c, grads_c), (loss_p, peak_p, grads_p) = results["checkpointed"], results["plain"]
    out["measured_bytes"], out["measured_plain_bytes"] = peak_c, peak_p
    out["loss_rel"] = abs(loss_c - loss_p) / abs(loss_p)
    out["grad_rel"] = max(
        float((grads_c[k] - grads_p[k]).abs().max() / grads_p[k].abs().max().clamp_min(1e-4))
        for k in grads_p)
    out["buffers_equal"] = all(torch.equal(state["checkpointed"][k], state["plain"][k])
                               for k in state["plain"])
    dist.barrier()
    return out


def nested_case(rank: int, world: int, name: str) -> dict:
    """Hand-made nested checkpoint blocks (three levels) on a plan of ``name``
    over a (world,) mesh: the generated regions nest, and training matches the
    plan without checkpoints."""
    model, inputs, loss_fn = build(name)
    mesh = DeviceMesh((world,))
    # Megatron's MLP split (column- then row-parallel): collectives inside the
    # regions, which a data-parallel plan no longer has (it buckets every
    # gradient outside the graph).
    from forced_plans import forced_plan

    _, plan = forced_plan(model, inputs, loss_fn, mesh, params={
        r"mlp\.c_fc\.weight": "RS0", r"mlp\.c_fc\.bias": "S0", r"mlp\.c_proj\.weight": "S0R"})

    from automap.checkpoint.record import CheckpointPlan
    from automap.solve.linearize import linearize
    from automap.trace.tracing import trace

    traced = trace(model, inputs, loss_fn=loss_fn)
    stages = linearize(traced)
    last = len(stages) - 1

    def block(lo, hi, children=()):
        return {"start_stage": lo, "end_stage": hi, "children": list(children)}

    nested = [block(0, 0), block(1, last - 2, [block(2, 4, [block(3, 3)]), block(6, 7)])]
    record = CheckpointPlan(stages=stages, blocks=nested, activation_budget_bytes=0,
                            persistent_bytes=0, predicted_activation_peak_bytes=0,
                            recompute_s=0.0, ilp_budget_bytes=None)
    checkpointed = dataclasses.replace(plan, checkpoint=record)
    plain = dataclasses.replace(plan, checkpoint=None)
    groups = mesh.process_groups()
    out, runs = {}, {}
    for label, p in (("checkpointed", checkpointed), ("plain", plain)):
        module = generate(traced, p, copy.deepcopy(model), groups)
        losses = []
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            loss = call_module(module, inputs)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        runs[label] = (losses, module.full_state_dict())
        if label == "checkpointed":
            outer = [m for n, m in module.named_children() if n.startswith("checkpoint_")]
            out["top_level_regions"] = len(outer)
            out["depth"] = _depth(module)
            out["collective_in_region"] = any(
                "all_reduce" in m.code or "all_gather" in m.code or "reduce_scatter" in m.code
                for m in module.modules() if m is not module and hasattr(m, "code"))
    (lc, sc), (lp, sp) = runs["checkpointed"], runs["plain"]
    out["loss_rel"] = max(abs(a - b) / abs(b) for a, b in zip(lc, lp))
    out["param_abs"] = max(float((sc[k] - sp[k]).abs().max()) for k in sp)
    return out


def _depth(module) -> int:
    children = [m for n, m in module.named_children() if n.startswith("checkpoint_")]
    return 1 + max((_depth(m) for m in children), default=0) if children else 0
