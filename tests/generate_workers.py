"""Functions run inside spawned gloo processes by the generator's tests: train
the parallel module of a plan next to the serial model and report the numbers."""

from __future__ import annotations

import copy
import math
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from automap import DeviceMesh, ShardingSpec
from automap.generate import generate
from automap.plan import Plan
from automap.planner import plan as solve_plan
from forced_plans import BATCH, forced_plan

STEPS = 5
#: Small buckets, so that data-parallel gradients go in several of them.
BUCKET_BYTES = 4096
#: Gradients that are mathematically zero (an attention key bias's) are float
#: noise on both sides: relative differences are taken against at least this.
GRAD_FLOOR = 1e-4
COLLECTIVE_NAMES = ("all_reduce_sum", "reduce_scatter_dim", "all_gather_dim", "split_dim",
                    "all_to_all_dims", "identity_all_reduce_grad", "vocab_parallel_embedding",
                    "take_shard", "loss_denominator")


def _no_dropout(model: nn.Module) -> nn.Module:
    # Dropout draws different random numbers on a shard: equality needs it off.
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def build(name: str):
    import model_zoo
    import planning_models

    torch.manual_seed(0)
    if name == "gpt2":
        model, inputs, loss_fn = model_zoo.gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    elif name == "resnet":
        # 16x16 images: a quarter of the ReLU inputs of 32x32 ones, so that none
        # comes within a few rounding errors of the kink (``relu_margin``).
        model = model_zoo.ResNet()
        x = torch.randn(model_zoo.BATCH, 3, 16, 16)
        y = torch.randint(0, 10, (model_zoo.BATCH,))
        return model, (x,), lambda out: torch.nn.functional.cross_entropy(out, y)
    elif name == "block":
        model = planning_models.GPT2Block(32, 4)
        x = torch.randn(4, 8, 32)
        return model, (x,), lambda out: out.pow(2).mean()
    else:
        model, inputs, loss_fn = getattr(model_zoo, name)()
    return _no_dropout(model), inputs, loss_fn


def make_plan(kind: str, model, inputs, loss_fn, mesh: DeviceMesh) -> Plan:
    """The solver's plan (``solver``: A100-class FLOP/s; ``solver_slow``: FLOP/s so
    slow that splitting compute pays) or a forced one (see ``FORCED``)."""
    if kind == "solver":
        return solve_plan(model, inputs, mesh, loss_fn=loss_fn)
    if kind == "solver_slow":
        return solve_plan(model, inputs, mesh, loss_fn=loss_fn, flops_per_s=1e6)
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
}


#: AdamW's eps. Adam's update lr*m/(sqrt(v)+eps) has slope up to lr/eps in the
#: gradient where the gradient is near 0; a gradient element that is a nearly
#: cancelling sum carries rounding of ~1e-8 that differs with the order of the sum
#: (serial fp32, fp64 and a sharded plan all differ), so lr/eps = 1e3 (eps 1e-6)
#: made 1e-5 parameter differences in one step, and the serial fp32 run itself
#: ended 1.7e-6 to 4.8e-6 (ResNet: 1.6e-3) from fp64. lr/eps = 10 keeps it
#: within 3e-7 of fp64 for every model; Adam's step stays normalised for
#: gradient elements well above 1e-4.
ADAMW_EPS = 1e-4


def _optimizer(kind: str, params, eps: float = ADAMW_EPS):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, eps=eps)


def _call(module, inputs):
    if isinstance(inputs, dict):
        return module(**inputs)
    return module(*inputs)


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
    from automap.tracing import default_loss, trace

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
            opt = _optimizer(opt_kind, module.parameters(), eps)
            losses, grads = [], None
            for _ in range(STEPS):
                loss = _call(module, inputs)
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


def _max_diff(full: dict, reference: dict, floor: float = 1e-12) -> tuple[float, float, str]:
    """Largest difference over tensors: (relative to the tensor's largest entry, at
    least ``floor``; absolute; the worst tensor's name)."""
    worst, worst_abs, worst_name = 0.0, 0.0, ""
    for name, value in full.items():
        ref = reference[name].detach()
        if not ref.is_floating_point():
            diff = abs_diff = float((value != ref).any())
        else:
            abs_diff = float((value - ref).abs().max())
            diff = abs_diff / float(ref.abs().max().clamp_min(floor))
        worst_abs = max(worst_abs, abs_diff)
        if diff > worst:
            worst, worst_name = diff, name
    return worst, worst_abs, worst_name


class _ReluInputs(TorchDispatchMode):
    """Records a copy (in float64) of every ReLU's input, in call order."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.relu.default, torch.ops.aten.relu_.default):
            self.inputs.append(args[0].detach().to(torch.float64, copy=True))
        return func(*args, **(kwargs or {}))


def _serial_run(model, inputs, loss_fn, opt_kind, eps, dtype=None):
    """STEPS optimizer steps of a copy of ``model`` in ``dtype``: losses, first-step
    gradients, the final parameters and buffers, and every ReLU input on the way."""
    from automap import hf_compat
    from automap.tracing import default_loss, split_inputs

    dtype = dtype or next(model.parameters()).dtype
    serial = copy.deepcopy(model).to(dtype)
    args, kwargs = split_inputs(inputs)
    args, kwargs = pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, (args, kwargs))
    if hf_compat.is_hf_model(serial):
        kwargs = {**hf_compat.call_kwargs(serial), **kwargs}
    opt = _optimizer(opt_kind, serial.parameters(), eps)
    losses, grads = [], None
    with _ReluInputs() as relu:
        for _ in range(STEPS):
            loss = (loss_fn or default_loss)(serial(*args, **kwargs))
            loss.backward()
            if grads is None:
                grads = {n: p.grad.clone() for n, p in serial.named_parameters()
                         if p.grad is not None}
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    state = {n: t.detach()
             for n, t in [*serial.named_parameters(), *serial.named_buffers()]}
    return losses, grads, state, relu.inputs


def _relu_margin(inputs: list, inputs64: list, dtype: torch.dtype) -> float:
    """How far from ReLU's kink the run stays, in units of rounding: the least,
    over every ReLU call of every step, of its inputs' smallest |x| (float64 run)
    over the root mean square of what rounding moved them by (fp32 run against
    float64). Within a few of these units, another order of the same sums (a
    sharded plan's) may flip an input's sign, and a gradient jumps by a whole
    term. inf for float64 models (nothing to compare)."""
    if dtype == torch.float64 or not inputs:
        return math.inf
    return min(float(b.abs().min() / (a - b).pow(2).mean().sqrt().clamp_min(1e-30))
               for a, b in zip(inputs, inputs64, strict=True))


def _compare_serial(model, inputs, loss_fn, opt_kind, eps, losses, full, grads) -> dict:
    serial_losses, serial_grads, state, relu_in = _serial_run(model, inputs, loss_fn,
                                                              opt_kind, eps)
    rel_loss = max(abs(a - b) / abs(b) for a, b in zip(losses, serial_losses))
    worst, worst_abs, worst_name = _max_diff(full, state)
    worst_grad, _, worst_grad_name = _max_diff(grads, serial_grads, floor=GRAD_FLOOR)
    # How well conditioned the comparison is: how far fp32 rounding alone moves
    # the serial model (fp32 against fp64), and how near its ReLU inputs come to
    # the kink relative to that rounding.
    _, _, state64, relu_in64 = _serial_run(model, inputs, loss_fn, opt_kind, eps, torch.float64)
    _, noise_abs, _ = _max_diff(state, state64)
    dtype = next(model.parameters()).dtype
    return {"losses": losses, "serial_losses": serial_losses, "max_rel_loss": rel_loss,
            "max_rel_param": worst, "max_abs_param": worst_abs, "worst_param": worst_name,
            "max_rel_grad": worst_grad, "worst_grad": worst_grad_name, "compared": len(full),
            "grads_compared": len(grads), "fp32_noise_abs_param": noise_abs,
            "relu_margin": _relu_margin(relu_in, relu_in64, dtype)}
