"""Functions run inside spawned gloo processes by the API tests."""

from __future__ import annotations

import copy

import torch

from automap import DeviceMesh
from automap.api import apply, autoparallelize
from automap.errors import AutomapError, InvalidMeshError, StalePlanError
from automap.planner.plan import Plan
from automap.planner.search import plan as solve_plan
from forced_plans import forced_plan
from serial import build
from speeds import FAST


def _saved_and_loaded(plan) -> Plan:
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "plan.json")
        plan.to_json(path)
        return Plan.from_json(path)


def _raises(fn, error) -> str:
    try:
        fn()
    except error as exc:
        return str(exc)
    return ""


def api_checks(rank: int, world: int) -> dict:
    import model_zoo

    out: dict = {}
    model, inputs, loss_fn = build("mlp")
    serial_loss = loss_fn(copy.deepcopy(model)(*inputs)).item()

    # A mesh of another size than the world.
    out["mesh_error"] = _raises(
        lambda: autoparallelize(model, inputs, mesh=(world * 2,), loss_fn=loss_fn),
        InvalidMeshError)

    # Default mesh: 1-D over the world; the plan solved on rank 0.
    module = autoparallelize(model, inputs, loss_fn=loss_fn, flops_per_s=1e6)
    out["default_mesh"] = module.plan.mesh.shape
    out["default_loss"] = (module(*inputs).item(), serial_loss)

    # A cluster instead of a mesh: its best mesh of the world's size.
    from automap import Cluster

    cluster = Cluster.from_dict({"version": 1, "devices": world, "tiers": [
        {"group_size": world, "alpha_s": 1e-5, "bandwidth_bytes_per_s": 1e10}]})
    module = autoparallelize(model, inputs, mesh=cluster, loss_fn=loss_fn, flops_per_s=1e6)
    out["cluster_mesh"] = module.plan.mesh.shape
    out["cluster_loss"] = (module(*inputs).item(), serial_loss)

    # A plan of another graph, or of a model changed since planning.
    other, other_inputs, other_loss = build("mlp")
    other.fc2 = torch.nn.Linear(256, 256, bias=False)
    mesh = DeviceMesh((world,))
    plan = solve_plan(model, inputs, mesh, loss_fn=loss_fn, **FAST)
    out["stale_error"] = _raises(lambda: apply(plan, other, other_inputs, loss_fn=other_loss),
                                 StalePlanError)
    out["applied_loss"] = apply(plan, model, inputs, loss_fn=loss_fn)(*inputs).item()
    # A saved plan records its inputs' shapes: apply(plan, model) needs no inputs.
    saved = _saved_and_loaded(plan)
    out["applied_without_inputs_loss"] = apply(saved, model, loss_fn=loss_fn)(*inputs).item()
    saved.inputs = None
    out["no_inputs_error"] = _raises(lambda: apply(saved, model, loss_fn=loss_fn),
                                     AutomapError)

    # Rank-local inputs under data parallelism.
    _, dp = forced_plan(model, inputs, loss_fn, mesh, params={}, inputs={"args_0": "S0R"})
    local = apply(dp, model, inputs, loss_fn=loss_fn, local_inputs=True)
    x = inputs[0].chunk(world)[rank]
    out["local_loss"] = local(x).item()

    # Gradient accumulation over two backward calls, with the bucketed sync.
    global_module = apply(dp, model, inputs, loss_fn=loss_fn)
    serial = copy.deepcopy(model)
    for _ in range(2):
        global_module(*inputs).backward()
        loss_fn(serial(*inputs)).backward()
    grads = global_module.full_state_dict(gradients=True)
    out["accumulated_grad_diff"] = max(
        float((grads[n] - p.grad).abs().max() / p.grad.abs().max())
        for n, p in serial.named_parameters())
    out["buckets"] = len(global_module.gradient_sync.buckets)

    # Inputs that were one tensor when planning (input_ids=labels=ids) and differ when
    # training; labels with ignored (-100) positions.
    gpt2, gpt2_inputs, _ = build("gpt2")
    reference = copy.deepcopy(gpt2)
    gpt2_module = autoparallelize(gpt2, gpt2_inputs, flops_per_s=1e6)
    ids = torch.randint(0, 256, gpt2_inputs["input_ids"].shape,
                        generator=torch.Generator().manual_seed(3))
    labels = gpt2_inputs["labels"].clone()
    labels[:, :5] = -100
    out["gpt2_distinct_inputs"] = (
        gpt2_module(input_ids=ids, labels=labels).item(),
        reference(input_ids=ids, labels=labels, use_cache=False).loss.item())

    # A model built on meta: initialised shard by shard, the same under any plan.
    with torch.device("meta"):
        meta_model, meta_x = model_zoo.MLP(), torch.empty(inputs[0].shape)
    meta_model.drop.p = 0.0

    def square(out):
        return out.pow(2).mean()

    full_and_loss = []
    for params in ({}, {r"fc1\.weight": "S0R", r"fc2\.weight": "RS0"}):
        p = forced_plan(meta_model, (meta_x,), square, mesh, params=params)[1]
        m = apply(p, meta_model, (meta_x,), loss_fn=square, seed=7)
        full_and_loss.append((m.full_state_dict(), m(*inputs).item()))
    (full_dp, loss_dp), (full_mt, loss_mt) = full_and_loss
    out["meta_same_under_plans"] = all(torch.equal(full_dp[n], full_mt[n]) for n in full_dp)
    out["meta_initialised"] = all(float(t.std()) > 0 for n, t in full_dp.items()
                                  if n.endswith("weight"))
    reference = copy.deepcopy(model)
    reference.load_state_dict(full_dp)
    out["meta_losses"] = (loss_dp, loss_mt, square(reference(*inputs)).item())
    out["meta_still_meta"] = all(p.device.type == "meta" for p in meta_model.parameters())
    return out


def apply_saved_plans(rank: int, world: int, paths: dict) -> dict:
    """For each model name, the plan saved at ``paths[name]`` (made by
    ``automap.plan`` outside any process group): ``automap.apply(plan, model)`` with
    no example inputs, then STEPS SGD steps; their losses and the serial model's."""
    import automap
    from serial import STEPS, call_module, make_optimizer, serial_run

    out = {}
    for name, path in paths.items():
        model, inputs, loss_fn = build(name)
        serial_losses = serial_run(model, inputs, loss_fn, "sgd", eps=None)[0]
        module = automap.apply(Plan.from_json(path), model, loss_fn=loss_fn)
        opt = make_optimizer("sgd", module.parameters())
        losses = []
        for _ in range(STEPS):
            loss = call_module(module, inputs)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        out[name] = {"losses": losses, "serial_losses": serial_losses,
                     "bytes": module.local_parameter_bytes(),
                     "full_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    return out


def fail_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank one fails on purpose")
    return rank


def leave_a_collective_in_flight(rank: int, world: int) -> int:
    """Return while an asynchronous all-reduce may still run, its tensor and
    work dropped: the launcher's exit must not depend on when gloo's threads
    release them."""
    import torch.distributed as dist

    work = dist.all_reduce(torch.ones(2_000_000), async_op=True)
    del work
    return rank


def stop_rank_one(rank: int, world: int) -> int:
    import os
    import signal

    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    return rank


def draw_a_disabled_progress_bar(rank: int, world_size: int) -> int:
    """What torch.fx's Interpreter does on every run: a disabled tqdm bar."""
    from tqdm import tqdm

    with tqdm(total=1, disable=True) as bar:
        bar.update(1)
    return rank
