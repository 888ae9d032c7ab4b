"""Parameter sharding: each rank holds only its shard of every parameter,
buffer and lifted constant, in the spec its placeholder has in the plan.

Shards are cut from the full tensor when the model has weights. A model built
on the meta device is initialised one module at a time: the module's own
tensors are materialised (seeded identically on every rank), initialised by the
module's ``reset_parameters`` (or the Hugging Face model's ``_init_weights``),
cut, and returned to meta, so the whole model never exists on one rank."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import nn

from automap.errors import AutomapError
from automap.sharding.spec import ShardingSpec


@dataclass(frozen=True)
class StateShard:
    """Where one state tensor lives in the generated module."""

    name: str  # attribute path in the module (the user's fully qualified name)
    kind: str  # "parameter", "buffer" or "constant"
    spec: str
    global_shape: tuple[int, ...]


def local_bounds(spec: str, shape, mesh, rank: int) -> tuple[tuple[int, int], ...]:
    return tuple(tuple(b) for b in ShardingSpec.parse(spec).local_slices(list(shape), mesh, rank))


def cut(full: torch.Tensor, spec: str, mesh, rank: int) -> torch.Tensor:
    """This rank's block of ``full`` under ``spec``, as a new tensor."""
    bounds = local_bounds(spec, full.shape, mesh, rank)
    return full[tuple(slice(a, b) for a, b in bounds)].detach().clone().contiguous()


def full_tensors(model: nn.Module, traced, names: list[str], seed: int) -> dict[str, torch.Tensor]:
    """The full value of each named parameter/buffer/constant, materialising modules
    built on meta one at a time (see the module docstring)."""
    out: dict[str, torch.Tensor] = {}
    by_module: dict[str, list[str]] = {}
    for name in names:
        value = _lookup(model, traced, name)
        if value.device.type != "meta":
            out[name] = value.detach()
        else:
            by_module.setdefault(name.rpartition(".")[0], []).append(name)
    for module_path, members in by_module.items():
        module = model.get_submodule(module_path)
        for name, value in _materialise(model, module, module_path, seed).items():
            if name in members:
                out[name] = value
    return out


def _lookup(model: nn.Module, traced, name: str) -> torch.Tensor:
    if name in traced.constants:
        node = traced.constants[name].node
        target = traced.exported.graph_signature.inputs_to_lifted_tensor_constants[node]
        return traced.exported.constants[target]
    try:
        return model.get_parameter(name)
    except AttributeError:
        return model.get_buffer(name)


def _materialise(model: nn.Module, module: nn.Module, path: str, seed: int) -> dict:
    """Full initial values of ``module``'s own tensors; the module stays on meta."""
    init = getattr(module, "reset_parameters", None)
    hf_init = getattr(model, "_init_weights", None)
    if init is None and hf_init is None:
        raise AutomapError(
            f"module {path or type(model).__name__} ({type(module).__name__}) was built on the "
            "meta device and has no reset_parameters() to initialise it shard by shard; build "
            "it with weights, or give it a reset_parameters() method")
    module.to_empty(device="cpu", recurse=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + zlib.crc32(path.encode()))
        with torch.no_grad():
            init() if init is not None else hf_init(module)
    prefix = f"{path}." if path else ""
    values = {prefix + n: t.detach().clone()
              for n, t in [*module.named_parameters(recurse=False),
                           *module.named_buffers(recurse=False)]}
    module._apply(lambda t: t.to("meta"), recurse=False)
    return values
