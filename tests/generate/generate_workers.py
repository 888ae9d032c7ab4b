"""Functions run inside spawned gloo processes by the generator's tests: train
the parallel module of a plan next to the serial model and report the numbers."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from automap import DeviceMesh, ShardingSpec
from automap.generate.program import generate
from automap.planner.plan import Plan
from automap.planner.search import plan as solve_plan
from forced_plans import BATCH, forced_plan
from serial import (
    ADAMW_EPS,
    GRAD_FLOOR,
    STEPS,
    build,
    call_module,
    make_optimizer,
    max_diff,
    relu_margin,
    serial_run,
)
from speeds import FAST, speeds

#: Small buckets, so that data-parallel gradients go in several of them.
BUCKET_BYTES = 4096
COLLECTIVE_NAMES = ("all_reduce_sum", "reduce_scatter_dim", "all_gather_dim", "split_dim",
                    "all_to_all_dims", "identity_all_reduce_grad", "vocab_parallel_embedding",
                    "take_shard", "loss_denominator", "mean_over_group", "gather_shard")


def make_plan(kind: str, model, inputs, loss_fn, mesh: DeviceMesh) -> Plan:
    """The solver's plan (``solver``: A100-class FLOP/s; ``solver_slow``: FLOP/s so
    slow that splitting compute pays) or a forced one (see ``FORCED``)."""
    if kind == "solver":
        return solve_plan(model, inputs, mesh, loss_fn=loss_fn, **FAST)
    if kind == "solver_slow":
        return solve_plan(model, inputs, mesh, loss_fn=loss_fn, **speeds(1e6))
    if kind == "fsdp_budget":
        # Within 60 % of the data-parallel plan's peak, on a CPU-like device (the
        # optimizer step moves its state at 1 GB/s: on a shard it is 4x faster),
        # the plan stores parameters split over the batch's axes (gather_shard).
        dp_kind = "dp_tokens" if isinstance(inputs, dict) else "dp"
        dp = forced_plan(model, inputs, loss_fn, mesh, **FORCED[dp_kind](mesh))[1]
        return solve_plan(model, inputs, mesh, 0.6 * dp.predicted_peak_memory_bytes,
                          loss_fn=loss_fn, flops_per_s=1e9, memory_bandwidth_bytes_per_s=1e9,
                          op_overhead_s=1e-6)
    return forced_plan(model, inputs, loss_fn, mesh, **FORCED[kind](mesh))[1]


FORCED = {
    # Parameters replicated, the batch split over every axis.
    "dp": lambda mesh: {"params": {}, "inputs": {"args_0": BATCH}},
    "dp_tokens": lambda mesh: {"params": {}, "inputs": {"input_ids": BATCH, "labels": BATCH}},
    # Megatron: column-parallel then row-parallel linear, input replicated.
    "megatron": lambda mesh: {"params": {r"fc1\.weight": "S0R", r"fc1\.bias": "S0",
                                         r"fc2\.weight": "RS0"}, "inputs": {"args_0": "RR"}},
    # Column-parallel, then the batch split: the activation changes its split dim
    # (an all-to-all).
    "reshard": lambda mesh: {"params": {r"fc1\.weight": "S0R", r"fc1\.bias": "S0"},
                             "inputs": {"args_0": "RR"},
                             "ops": {"gelu": lambda ins, outs: outs[0] == "RS0",
                                     "linear_1": lambda ins, outs: ins[:2] == ("S0R", "RR")}},
    # 2-D: batch on axis 0, Megatron on axis 1.
    "2d": lambda mesh: {"params": {r"fc1\.weight": "S1R", r"fc1\.bias": "S1",
                                   r"fc2\.weight": "RS1"}, "inputs": {"args_0": "S0R"},
                        "ops": {"linear": lambda ins, outs: ins[:2] == ("S0R", "S1R"),
                                "linear_1": lambda ins, outs: ins[:2] == ("S0S1", "RS1")}},
    # Vocab-parallel (tied) embedding and LM head.
    "vocab": lambda mesh: {"params": {r"wte\.weight": "S0R"},
                           "ops": {"embedding": lambda ins, outs: ins[0] == "S0R"}},
    # Attention split by heads (q/k/v column-parallel, projection row-parallel).
    "heads": lambda mesh: {
        "params": {r"^(q|k|v)\.weight": "S0R", r"^(q|k|v)\.bias": "S0",
                   r"^proj\.weight": "RS0"}, "inputs": {"args_0": "RRR"},
        "ops": {"scaled_dot_product_attention": lambda ins, outs: ins[0] == "RS0RR"}},
    # Attention split by batch (axis 0) and heads (axis 1).
    "batch_heads": lambda mesh: {
        "params": {r"^(q|k|v)\.weight": "S1R", r"^(q|k|v)\.bias": "S1",
                   r"^proj\.weight": "RS1"}, "inputs": {"args_0": "S0RR"},
        "ops": {"scaled_dot_product_attention": lambda ins, outs: ins[0] == "S0S1RR",
                **{f"linear{i}": lambda ins, outs: ins[:2] == ("S0RR", "S1R")
                   for i in ("", "_1", "_2")}}},
    # Sharded data parallelism (FSDP/ZeRO-3): parameters stored split over the
    # batch's axes, read whole by every linear (gathered; gradients reduce-scattered).
    "fsdp": lambda mesh: {
        "params": {r"fc\d\.weight": _dp_axes("S{}R", mesh), r"fc\d\.bias": _dp_axes("S{}", mesh),
                   r"head\.weight": _dp_axes("RS{}", mesh)},
        "inputs": {"args_0": BATCH},
        "ops": {f"linear{i}": _reads_whole_weight for i in ("", "_1", "_2")}},
    # Hybrid: parameters split over axis 0 only, the batch over both axes (the
    # gradient reduce-scattered over axis 0, all-reduced over axis 1 on the shard).
    "fsdp_hybrid": lambda mesh: {
        "params": {r"fc\d\.weight": "S0R", r"fc\d\.bias": "S0", r"head\.weight": "RS0"},
        "inputs": {"args_0": BATCH},
        "ops": {f"linear{i}": _reads_whole_weight for i in ("", "_1", "_2")}},
}


def _dp_axes(pattern: str, mesh) -> str:
    return pattern.format("".join(str(a) for a in range(mesh.ndim)))


def _reads_whole_weight(ins, outs) -> bool:
    return ins[0] != "RR" and ins[1] == "RR"


def expected_parameter_bytes(traced, plan: Plan) -> int:
    total = 0
    for state in traced.parameters.values():
        if state.canonical != state.name:
            continue
        spec = ShardingSpec.parse(plan.nodes[state.node].outputs[0])
        total += math.prod(spec.local_shape(list(state.shape), plan.mesh)) * state.dtype.itemsize
    return total


_GROUPS: dict = {}


def train_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """For each case (model, mesh dict, plan kind): STEPS steps of SGD and of AdamW
    on the parallel module and (rank 0) on the serial model."""
    from automap.trace.tracing import default_loss, trace

    results = []
    for case in cases:
        start = time.perf_counter()
        mesh = DeviceMesh.from_dict(case["mesh"])
        key = (mesh.shape, mesh.ranks)
        if key not in _GROUPS:
            _GROUPS[key] = mesh.process_groups()
        groups = _GROUPS[key]
        model, inputs, loss_fn = build(case["model"])
        if case.get("dtype") == "float64":
            model = model.double()
            inputs = pytree.tree_map_only(
                torch.Tensor, lambda t: t.double() if t.is_floating_point() else t, inputs)
        traced = trace(model, inputs, loss_fn=loss_fn or default_loss)
        payload = [None]
        if rank == 0:
            payload = [make_plan(case["plan"], model, inputs, loss_fn, mesh).to_dict()]
        dist.broadcast_object_list(payload, src=0)
        plan = Plan.from_dict(payload[0])
        out = {"case": case, "expected_bytes": expected_parameter_bytes(traced, plan)}
        for opt_kind in ("sgd", "adamw"):
            module = generate(traced, plan, model, groups,
                              grad_bucket_bytes=case.get("bucket_bytes", BUCKET_BYTES))
            out["bytes"] = module.local_parameter_bytes()
            eps = case.get("adamw_eps", ADAMW_EPS)
            opt = make_optimizer(opt_kind, module.parameters(), eps)
            losses, grads = [], None
            for _ in range(STEPS):
                loss = call_module(module, inputs)
                loss.backward()
                if grads is None:
                    grads = module.full_state_dict(gradients=True)
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
            full = module.full_state_dict()
            out["buckets"] = len(module.gradient_sync.buckets)
            if rank == 0:
                out[opt_kind] = _compare_serial(model, inputs, loss_fn, opt_kind, eps, losses,
                                                full, grads)
                out["code"] = module.code
        out["seconds"] = time.perf_counter() - start
        results.append(out)
    return results


def _compare_serial(model, inputs, loss_fn, opt_kind, eps, losses, full, grads) -> dict:
    serial_losses, serial_grads, state, relu_in = serial_run(model, inputs, loss_fn,
                                                              opt_kind, eps)
    rel_loss = max(abs(a - b) / abs(b) for a, b in zip(losses, serial_losses))
    worst, worst_abs, worst_name = max_diff(full, state)
    worst_grad, _, worst_grad_name = max_diff(grads, serial_grads, floor=GRAD_FLOOR)
    # How well conditioned the comparison is: how far fp32 rounding alone moves
    # the serial model (fp32 against fp64), and how near its ReLU inputs come to
    # the kink relative to that rounding.
    _, _, state64, relu_in64 = serial_run(model, inputs, loss_fn, opt_kind, eps, torch.float64)
    _, noise_abs, _ = max_diff(state, state64)
    dtype = next(model.parameters()).dtype
    return {"losses": losses, "serial_losses": serial_losses, "max_rel_loss": rel_loss,
            "max_rel_param": worst, "max_abs_param": worst_abs, "worst_param": worst_name,
            "max_rel_grad": worst_grad, "worst_grad": worst_grad_name, "compared": len(full),
            "grads_compared": len(grads), "fp32_noise_abs_param": noise_abs,
            "relu_margin": relu_margin(relu_in, relu_in64, dtype)}
