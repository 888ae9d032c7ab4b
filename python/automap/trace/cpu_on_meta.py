"""Meta tensors standing for CPU ones (the profiled step, ``trace/profiling.py``,
and the simulated one, ``generate/simulate.py``): the kernels a CPU step would
run. Every op's meta kernel gives the CPU kernel's shapes and strides, but
scaled-dot-product attention picks its kernel by device inside its composite
(no dispatch the simulation sees): on meta it always decomposes into the math
path, whose intermediates the CPU's flash kernel does not allocate (13-20 KiB
per layer on the tests' ViT, Llama and GPT-2). The program's attention calls go
to ``cpu_attention`` instead, which asks the CPU's own choice of empty CPU
tensors of the same layout (their pages are never touched) and runs that
kernel. And a checkpoint region's recomputation forks the CPU generator around
itself for CPU tensors, not for meta ones (``checkpoints_as_on_cpu``): one
generator state (5 KB) per region.

Convolutions (their output's memory format is the backend's: ConvNeXt's
depthwise ones peaked 43 % lower on meta) and recurrent layers (their CPU
composite runs other kernels) choose more than that: a graph with one of
``DEVICE_CHOSEN`` is simulated on FakeTensors (``runs_as_on_cpu``)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.utils.checkpoint as checkpoint_module
from torch import fx, nn
from torch.utils._python_dispatch import _disable_current_modes

_aten = torch.ops.aten
ATTENTION_OPS = (_aten.scaled_dot_product_attention.default,
              torch.nn.functional.scaled_dot_product_attention)
#: ``torch.nn.attention.SDPBackend.FLASH_ATTENTION``'s value.
_FLASH = 1
_choices: dict[tuple, int] = {}
#: Ops whose kernels on meta are not the CPU's beyond what is mended here.
DEVICE_CHOSEN = frozenset({
    "convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "conv_tbc", "_convolution_mode",
    "lstm", "gru", "rnn_tanh", "rnn_relu"})


def runs_as_on_cpu(graph: fx.Graph) -> bool:
    """Whether ``graph``'s ops run on meta tensors as on the CPU (none of ``DEVICE_CHOSEN``)."""
    return not any(n.op == "call_function" and str(n.target).split(".")[:2][-1] in DEVICE_CHOSEN
                   for n in graph.nodes)


def step_on_meta(device: torch.device, graph: fx.Graph, optimizer,
                 optimizer_impl: str = "auto") -> bool:
    """Whether a step of ``graph`` for ``device`` runs on meta tensors: a CPU's,
    with ops that run there as on the CPU and an optimizer named by automap
    (one of the user's own may make fused kernels, which torch refuses on meta),
    not fused."""
    return device.type == "cpu" and runs_as_on_cpu(graph) and optimizer_impl != "fused" and \
        (optimizer is None or isinstance(optimizer, str))


def run_cpu_kernels(module: nn.Module) -> None:
    """Point the attention calls of ``module``'s graphs (its checkpoint regions'
    too, which run again in the backward) at ``cpu_attention``."""
    for sub in module.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        calls = [n for n in sub.graph.nodes
                 if n.op == "call_function" and n.target in ATTENTION_OPS]
        for node in calls:
            node.target = cpu_attention
        if calls:
            sub.recompile()


def cpu_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                  scale=None, enable_gqa=False):
    """``scaled_dot_product_attention`` on meta tensors by the CPU's kernel."""
    sdpa = _aten.scaled_dot_product_attention.default
    if not query.is_meta:
        return sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                    enable_gqa=enable_gqa)
    # As the composite does first: unbatched inputs get a batch dim, their mask
    # one up to four dims.
    unbatched = query.dim() == 3
    if unbatched:
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        while attn_mask is not None and attn_mask.dim() < 4:
            attn_mask = attn_mask.unsqueeze(0)
    tensors = (query, key, value) + ((attn_mask,) if attn_mask is not None else ())
    asked = (tuple((tuple(t.shape), t.stride(), t.dtype, t.requires_grad) for t in tensors),
             float(dropout_p), bool(is_causal), scale, bool(enable_gqa),
             torch.is_grad_enabled())
    choice = _choices.get(asked)
    if choice is None:
        with _disable_current_modes():  # nothing the step allocates
            on_cpu = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                          requires_grad=t.requires_grad) for t in tensors]
            mask = on_cpu[3] if attn_mask is not None else None
            choice = _choices[asked] = int(torch._fused_sdp_choice(
                *on_cpu[:3], mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa))
    if choice != _FLASH:
        out = sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                   enable_gqa=enable_gqa)
        return out.squeeze(0) if unbatched else out
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # As the composite does before the kernel: an additive mask.
        neg_inf = torch.scalar_tensor(-math.inf, dtype=query.dtype, device=query.device)
        zero = torch.scalar_tensor(0.0, dtype=query.dtype, device=query.device)
        attn_mask = torch.where(attn_mask, zero, neg_inf)
        del neg_inf, zero  # freed before the kernel runs, as there
    out = _aten._scaled_dot_product_flash_attention_for_cpu.default(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
    return out.squeeze(0) if unbatched else out


@contextlib.contextmanager
def checkpoints_as_on_cpu() -> Iterator[None]:
    """Checkpoint regions take meta tensors for CPU ones: no device of their
    own, so the default device type's (whose generator, uninitialised, is not
    forked), and the CPU generator forked around each recomputation."""
    infer = checkpoint_module._infer_device_type

    def as_on_cpu(*args):
        kind = infer(*args)
        return checkpoint_module.DefaultDeviceType.get_device_type() if kind == "meta" else kind

    checkpoint_module._infer_device_type = as_on_cpu
    try:
        yield
    finally:
        checkpoint_module._infer_device_type = infer
