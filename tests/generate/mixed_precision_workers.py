"""Gloo workers of the mixed-precision tests: a plan that splits the MLP's
matmuls (Megatron: fc1 by columns, fc2 by rows) against the serial model under
the same ``torch.autocast``, bf16 and fp16 with loss scaling."""

from __future__ import annotations

import copy

import torch

import automap
from automap.api import apply
from forced_plans import forced_plan
from serial import build

STEPS = 4
MEGATRON = {r"fc1\.weight": "S0R", r"fc1\.bias": "S0", r"fc2\.weight": "RS0"}


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)


#: Settings by test name: (mixed_precision, parameter specs, input specs).
SETTINGS = {
    "bf16": ("bf16", MEGATRON, None),
    "fp16": ("fp16", MEGATRON, None),
    # Data parallel, gradients all-reduced in bf16 buckets.
    "bf16_dp_reduce_bf16": (automap.MixedPrecision(torch.bfloat16, torch.bfloat16), {},
                            {"args_0": "S0R"}),
    # The loss upcasts the output first, as Hugging Face's do (``logits.float()``):
    # traced in float32 that was a no-op export records as a dtype assert.
    "bf16_float_loss": ("bf16", MEGATRON, None),
}


def parity(rank: int, world: int, name: str) -> dict:
    """Losses of STEPS steps and the first step's gradients, parallel and serial
    (the serial model under ``torch.autocast("cpu", dtype)``, fp32 weights)."""
    model, inputs, loss_fn = build("mlp")
    if name == "bf16_float_loss":
        loss_fn = (lambda inner: lambda out: inner(out.float()))(loss_fn)
    mesh = automap.DeviceMesh((world,))
    setting, params, input_specs = SETTINGS[name]
    _, plan = forced_plan(model, inputs, loss_fn, mesh, params=params, inputs=input_specs,
                          mixed_precision=setting)
    dtype = plan.mixed_precision.param_dtype
    serial, full = copy.deepcopy(model), copy.deepcopy(model)
    module = apply(plan, model, inputs, loss_fn=loss_fn)
    scaled = dtype == torch.float16
    parallel_scaler = automap.GradScaler("cpu", init_scale=2.0 ** 8, enabled=scaled)
    serial_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, enabled=scaled)
    opt_p, opt_s = _optimizer(module.parameters()), _optimizer(serial.parameters())
    out = {"losses": [], "serial_losses": [], "param_dtypes": sorted(
        {str(p.dtype) for p in module.parameters()}), "bucket_dtypes": set()}
    sync = module.gradient_sync
    launch = sync._launch

    def recording_launch(bucket):  # the dtype each bucket is all-reduced in
        launch(bucket)
        if bucket.flat is not None:
            out["bucket_dtypes"].add(str(bucket.flat.dtype))

    sync._launch = recording_launch
    for step in range(STEPS):
        loss = module(*inputs)
        parallel_scaler.scale(loss).backward()
        with torch.autocast("cpu", dtype):
            reference = loss_fn(serial(*inputs))
        serial_scaler.scale(reference).backward()
        if step == 0:
            # Normwise relative errors of the first gradients: the parallel ones
            # against the serial autocast ones, and those against float32's (the
            # low dtype's own error, which a parallel order of sums may match).
            loss_fn(full(*inputs)).backward()
            grads = module.full_state_dict(gradients=True)
            fulls = dict(full.named_parameters())
            scale = float(serial_scaler.get_scale()) if scaled else 1.0
            out["grad_rel_err"] = max(_rel(grads[n], p.grad) for n, p in serial.named_parameters())
            out["autocast_rel_err"] = max(_rel(p.grad / scale, fulls[n].grad)
                                          for n, p in serial.named_parameters())
        for scaler, opt in ((parallel_scaler, opt_p), (serial_scaler, opt_s)):
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        out["losses"].append(loss.item())
        out["serial_losses"].append(reference.item())
    out["measured_peak_bytes"] = _measured_step_peak(module, inputs, opt_p, parallel_scaler)
    out["predicted_peak_bytes"] = plan.predicted_peak_memory_bytes

    return out


def _measured_step_peak(module, inputs, opt, scaler) -> int:
    """Bytes live at the peak of a steady-state training step: what is held
    before it (parameter shards, optimizer state, inputs) plus the CPU
    allocator's peak during it (PyTorch profiler memory events); the smaller of
    two steps, as the trust tests measure: now and then gloo's worker thread
    frees a collective's buffer late (one CI run measured 170 KB over the
    simulated step on one rank of the bf16-reduce case; run alone, every case
    measures at its prediction)."""
    from model_zoo import allocation_peak_bytes

    peaks = []
    for _ in range(2):
        held = [*module.parameters(), *module.buffers(), *inputs]
        held += [t for state in opt.state.values() for t in state.values()
                 if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    profile_memory=True) as prof:
            scaler.scale(module(*inputs)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        peaks.append(sum(storages.values()) + allocation_peak_bytes(prof))
    return min(peaks)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def inf_on_one_rank(rank: int, world: int, scaler_kind: str) -> dict:
    """An inf in rank 0's shard of one gradient: whether each rank stepped."""
    model, inputs, loss_fn = build("mlp")
    mesh = automap.DeviceMesh((world,))
    _, plan = forced_plan(model, inputs, loss_fn, mesh, params=MEGATRON,
                          mixed_precision="fp16")
    module = apply(plan, model, inputs, loss_fn=loss_fn)
    scaler = (automap.GradScaler if scaler_kind == "automap" else torch.amp.GradScaler)(
        "cpu", init_scale=2.0 ** 8)
    opt = _optimizer(module.parameters())
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    scaler.scale(module(*inputs)).backward()
    if rank == 0:
        module.get_parameter("fc1.weight").grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    changed = any(not torch.equal(before[n], p) for n, p in module.named_parameters())
    return {"stepped": changed, "scale": float(scaler.get_scale())}


def wide_mlp():
    """Three 256-wide layers and a head on a batch of 256: oneDNN's bf16 matmuls
    at these shapes allocate several times their outputs in scratch."""
    torch.manual_seed(0)
    layers = [m for _ in range(3) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(256, 10))
    x, y = torch.randn(256, 256), torch.randint(0, 10, (256,))
    return model, (x,), lambda out: torch.nn.functional.cross_entropy(out, y)


def measured_plan_peak(rank: int, world: int, plan_path: str) -> int:
    """This rank's measured peak of a steady-state AdamW step of ``wide_mlp``
    under the plan saved at ``plan_path`` (no loss scaling: bf16)."""
    model, inputs, loss_fn = wide_mlp()
    module = apply(automap.Plan.from_json(plan_path), model, inputs, loss_fn=loss_fn)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    scaler = automap.GradScaler("cpu", enabled=False)
    for _ in range(2):  # the optimizer state exists before the measured steps
        module(*inputs).backward()
        opt.step()
        opt.zero_grad()
    return _measured_step_peak(module, inputs, opt, scaler)
