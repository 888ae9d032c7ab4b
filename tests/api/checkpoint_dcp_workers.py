"""Run inside spawned gloo processes by test_checkpoint_dcp.py: train under one
plan, save a sharded checkpoint with torch.distributed.checkpoint, load it under
other plans and train on."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import automap
from automap import DeviceMesh
from automap.generate.program import generate
from automap.planner.plan import Plan
from automap.planner.search import plan as solve_plan
from automap.trace.tracing import default_loss, trace
from forced_plans import axis_1_outermost, forced_plan
from serial import build, call_module, make_optimizer, no_dropout
from speeds import FAST, speeds

#: Steps before the checkpoint, and after it.
BEFORE, AFTER = 2, 2


def plans(model, inputs, loss_fn) -> dict[str, Plan]:
    """The saving plan (2,2) under a tight budget (it splits the MLP weights over
    both axes, axis 1 outermost: ``S10R``, ``RS10``), the same mesh's unconstrained
    plan (replicated), and a (4,) plan that splits compute (vocab-parallel
    embedding, Megatron layers)."""
    loose = solve_plan(model, inputs, DeviceMesh((2, 2)), loss_fn=loss_fn, **FAST)
    tight = solve_plan(model, inputs, DeviceMesh((2, 2)), loss_fn=loss_fn, checkpointing="off",
                       memory_budget_bytes=0.6 * loose.predicted_peak_memory_bytes,
                       strategy_filter=axis_1_outermost, **FAST)
    flat = solve_plan(model, inputs, DeviceMesh((4,)), loss_fn=loss_fn, **speeds(1e6))
    return {"save_2x2_tight": tight, "load_2x2_loose": loose, "load_4": flat}


def _groups(cache: dict, mesh: DeviceMesh):
    key = (mesh.shape, mesh.ranks)
    if key not in cache:
        cache[key] = mesh.process_groups()
    return cache[key]


def _train(module, opt, inputs, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = call_module(module, inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def save_and_reload(rank: int, world: int, directory: str) -> dict:
    model, inputs, loss_fn = build("gpt2")
    traced = trace(model, inputs, loss_fn=loss_fn or default_loss)
    payload = [None]
    if rank == 0:
        payload = [{k: p.to_dict() for k, p in plans(model, inputs, loss_fn).items()}]
    dist.broadcast_object_list(payload, src=0)
    made = {k: Plan.from_dict(d) for k, d in payload[0].items()}
    cache: dict = {}
    out: dict = {"specs": {k: sorted({n.outputs[0] for n in p.nodes.values()
                                      if n.kind == "parameter"}) for k, p in made.items()}}

    # Train BEFORE steps under the saving plan and save, with no gather.
    plan = made["save_2x2_tight"]
    module = generate(traced, plan, model, _groups(cache, plan.mesh))
    opt = make_optimizer("adamw", module.parameters())
    out["losses_before"] = _train(module, opt, inputs, BEFORE)
    model_sd, optim_sd = automap.get_state_dict(module, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    saved = module.full_state_dict()
    out["state_dict_types"] = sorted({type(v).__name__ for v in module.state_dict().values()})
    out["placements"] = {k: [str(p) for p in v.placements] for k, v in model_sd.items()}
    out["plan_placements"] = {k: [str(p) for p in v] for k, v in plan.placements(model).items()}
    # The uninterrupted run goes on from here.
    out["losses_uninterrupted"] = _train(module, opt, inputs, AFTER)
    uninterrupted = module.full_state_dict()  # collective
    out["full_uninterrupted"] = uninterrupted if rank == 0 else None

    # Load into fresh modules of other plans (their weights start from the model's
    # initial ones, so equality below comes from the checkpoint).
    out["loaded"] = {}
    for name in ("load_4", "load_2x2_loose", "save_2x2_tight"):
        plan = made[name]
        fresh = generate(traced, plan, model, _groups(cache, plan.mesh))
        fresh_opt = make_optimizer("adamw", fresh.parameters())
        model_sd, optim_sd = automap.get_state_dict(fresh, fresh_opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
        automap.set_state_dict(fresh, fresh_opt, model_state_dict=model_sd,
                               optim_state_dict=optim_sd)
        full = fresh.full_state_dict()
        record = {
            "placements_match_plan": {k: tuple(v.placements) for k, v in model_sd.items()}
            == plan.placements(model),
            "max_weight_diff": max(float((full[k] - saved[k]).abs().max()) for k in saved),
            "steps": sorted({float(s["step"]) for s in fresh_opt.state.values()}),
            "losses_after": _train(fresh, fresh_opt, inputs, AFTER),
        }
        final = fresh.full_state_dict()
        record["max_final_diff"] = max(
            float((final[k] - uninterrupted[k]).abs().max()) for k in final)
        out["loaded"][name] = record

    # Other ways in: the saving module's DTensors into another plan's module (other
    # placements: gathered, then cut) and whole tensors, as a serial model's state
    # dict has them (cut).
    other = generate(traced, made["load_2x2_loose"], model, _groups(cache, plan.mesh))
    other.load_state_dict(module.state_dict())
    out["from_other_placements"] = _max_diff(other.full_state_dict(), uninterrupted)
    whole = {**uninterrupted, **{a: uninterrupted[c] for a, c in module.aliases.items()}}
    flat = generate(traced, made["load_4"], model, _groups(cache, made["load_4"].mesh))
    flat.load_state_dict(whole)
    out["from_whole"] = _max_diff(flat.full_state_dict(), uninterrupted)
    try:
        flat.load_state_dict({k: v[:1] for k, v in whole.items()})
    except automap.InvalidArgumentError as e:
        out["shard_refused"] = str(e)
    return out


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def mlp():
    """An MLP whose dims divide by 2 but not all by 4 (12, 24, 10)."""
    import model_zoo

    torch.manual_seed(0)
    model = no_dropout(model_zoo.MLP(d_in=12, hidden=24, d_out=10))
    x, y = torch.randn(8, 12), torch.randint(0, 10, (8,))
    return model, (x,), lambda out: torch.nn.functional.cross_entropy(out, y)


def permuted_mesh(rank: int, world: int, directory: str) -> dict:
    """Save under a forced plan on a (2,2) mesh of permuted ranks (every weight
    split, over both axes in both orders), load under the solver's (4,) plan."""
    model, inputs, loss_fn = mlp()
    traced = trace(model, inputs, loss_fn=loss_fn)
    mesh = DeviceMesh((2, 2), ranks=[3, 1, 0, 2])
    payload = [None]
    if rank == 0:
        saving = forced_plan(model, inputs, loss_fn, mesh, params={
            r"fc1\.weight": "S10R", r"fc1\.bias": "S10", r"fc2\.weight": "RS01",
            r"head\.weight": "S1S0"})[1]
        loading = solve_plan(model, inputs, DeviceMesh((4,)), loss_fn=loss_fn, **speeds(1e6))
        payload = [[saving.to_dict(), loading.to_dict()]]
    dist.broadcast_object_list(payload, src=0)
    saving, loading = (Plan.from_dict(d) for d in payload[0])
    cache: dict = {}
    module = generate(traced, saving, model, _groups(cache, saving.mesh))
    opt = make_optimizer("adamw", module.parameters())
    out = {"losses_before": _train(module, opt, inputs, BEFORE),
           "specs": {n.name: n.outputs[0] for n in saving.nodes.values()
                     if n.kind == "parameter"}}
    model_sd, optim_sd = automap.get_state_dict(module, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    saved = module.full_state_dict()
    out["losses_uninterrupted"] = _train(module, opt, inputs, AFTER)
    fresh = generate(traced, loading, model, _groups(cache, loading.mesh))
    fresh_opt = make_optimizer("adamw", fresh.parameters())
    model_sd, optim_sd = automap.get_state_dict(fresh, fresh_opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    automap.set_state_dict(fresh, fresh_opt, model_state_dict=model_sd,
                           optim_state_dict=optim_sd)
    out["max_weight_diff"] = _max_diff(fresh.full_state_dict(), saved)
    out["losses_after"] = _train(fresh, fresh_opt, inputs, AFTER)
    return out
