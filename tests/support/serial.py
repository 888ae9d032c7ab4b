"""The serial side of parity tests, shared by the generator's and the API's
workers: the test models by name, the optimizers, and a serial training run
with everything the comparison needs (losses, first-step gradients, final state,
ReLU inputs to judge conditioning)."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

STEPS = 5


#: Gradients that are mathematically zero (an attention key bias's) are float
#: noise on both sides: relative differences are taken against at least this.
GRAD_FLOOR = 1e-4


def no_dropout(model: nn.Module) -> nn.Module:
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
    return no_dropout(model), inputs, loss_fn


#: AdamW's eps. Adam's update lr*m/(sqrt(v)+eps) has slope up to lr/eps in the
#: gradient where the gradient is near 0; a gradient element that is a nearly
#: cancelling sum carries rounding of ~1e-8 that differs with the order of the sum
#: (serial fp32, fp64 and a sharded plan all differ), so lr/eps = 1e3 (eps 1e-6)
#: made 1e-5 parameter differences in one step, and the serial fp32 run itself
#: ended 1.7e-6 to 4.8e-6 (ResNet: 1.6e-3) from fp64. lr/eps = 10 keeps it
#: within 3e-7 of fp64 for every model; Adam's step stays normalised for
#: gradient elements well above 1e-4.
ADAMW_EPS = 1e-4


def make_optimizer(kind: str, params, eps: float = ADAMW_EPS):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, eps=eps)


def call_module(module, inputs):
    if isinstance(inputs, dict):
        return module(**inputs)
    return module(*inputs)


def max_diff(full: dict, reference: dict, floor: float = 1e-12) -> tuple[float, float, str]:
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


def serial_run(model, inputs, loss_fn, opt_kind, eps, dtype=None):
    """STEPS optimizer steps of a copy of ``model`` in ``dtype``: losses, first-step
    gradients, the final parameters and buffers, and every ReLU input on the way."""
    from automap.trace import hf_compat
    from automap.trace.tracing import default_loss, split_inputs

    dtype = dtype or next(model.parameters()).dtype
    serial = copy.deepcopy(model).to(dtype)
    args, kwargs = split_inputs(inputs)
    args, kwargs = pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, (args, kwargs))
    if hf_compat.is_hf_model(serial):
        kwargs = {**hf_compat.call_kwargs(serial), **kwargs}
    opt = make_optimizer(opt_kind, serial.parameters(), eps)
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


def relu_margin(inputs: list, inputs64: list, dtype: torch.dtype) -> float:
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
