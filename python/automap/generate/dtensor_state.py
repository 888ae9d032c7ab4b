"""The parallel module's state as DTensors, for sharded checkpoints.

The generated graph runs on plain local shards; a checkpoint wants each tensor
whole in meaning but sharded in storage. Here every shard becomes a DTensor view
(``DTensor.from_local``, sharing the shard's storage) on a torch ``DeviceMesh`` of
the plan's mesh, with the placements of its spec (``to_dtensor_placements``), so
``torch.distributed.checkpoint`` saves each rank's blocks, and loading into these
views writes straight into the module's shards, whatever the saving plan was.
The optimizer's per-parameter state maps the same way (``get_state_dict``)."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from automap.errors import InvalidArgumentError
from automap.generate.state import StateShard, cut
from automap.sharding.spec import to_dtensor_placements


def torch_mesh(module: Any) -> Any:
    """The module's mesh as a ``torch.distributed.device_mesh.DeviceMesh`` (ranks
    laid out as automap's mesh, so coordinates agree), made once and cached on
    the module. Collective the first time: every rank of the mesh calls it."""
    mesh = getattr(module, "_torch_mesh", None)
    if mesh is None:
        device = next((t.device for t in [*module.parameters(), *module.buffers()]),
                      torch.device("cpu"))
        mesh = module.plan.mesh.to_torch(device.type)
        module._torch_mesh = mesh
    return mesh


def placements(module: Any, name: str) -> tuple:
    """The DTensor placements of state ``name`` (a canonical shard name)."""
    cache = module.__dict__.setdefault("_placements", {})
    if name not in cache:
        cache[name] = tuple(to_dtensor_placements(module.shards[name].spec, module.plan.mesh))
    return cache[name]


def as_dtensor(module: Any, name: str, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's block of state ``name``, or a tensor of that shape such
    as optimizer state) as a DTensor view sharing its storage."""
    from torch.distributed.tensor import DTensor

    shard = module.shards[name]
    shape = torch.Size(shard.global_shape)
    return DTensor.from_local(local.detach(), torch_mesh(module), placements(module, name),
                              run_check=False, shape=shape, stride=_contiguous_stride(shape))


def canonical(module: Any, key: str) -> str | None:
    """The shard name a state-dict key stands for (tied names share one), else None."""
    if key in module.shards:
        return key
    return getattr(module, "aliases", {}).get(key)


def to_local(module: Any, key: str, value: Any) -> Any:
    """The plain local shard of state ``key`` from ``value``: a DTensor (in the
    module's placements: its local tensor; in others: gathered whole, then cut,
    collective over the DTensor's mesh) or a whole tensor (cut); anything else
    unchanged."""
    from torch.distributed.tensor import DTensor

    name = canonical(module, key)
    if name is None or not isinstance(value, torch.Tensor):
        return value
    shard: StateShard = module.shards[name]
    if isinstance(value, DTensor):
        if value.device_mesh == torch_mesh(module) and \
                tuple(value.placements) == placements(module, name):
            return value.to_local()
        value = value.full_tensor()
    if tuple(value.shape) != tuple(shard.global_shape):
        raise InvalidArgumentError(
            f"state_dict[{key!r}]: a plain tensor of shape {list(value.shape)}; the "
            f"parallel module takes the whole tensor (shape {list(shard.global_shape)}) or "
            f"a DTensor (e.g. from module.state_dict()), not a rank's shard")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return cut(value, shard.spec, module.plan.mesh, rank)


def get_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer | None = None
                   ) -> tuple[dict, dict]:
    """``(model_state_dict, optimizer_state_dict)`` of a parallel module and its
    optimizer for ``torch.distributed.checkpoint``: torch's ``get_state_dict``
    (optimizer state by parameter name, created by a zero step with lr 0 if the
    optimizer has not stepped yet, so that a checkpoint can load into it), with
    every optimizer tensor shaped like its parameter's shard as a DTensor view of
    that parameter's placements. Scalars (Adam's ``step``) stay plain: every rank
    holds the same. Without ``optimizer`` the second dict is empty."""
    from torch.distributed.checkpoint.state_dict import get_state_dict as torch_get_state_dict

    if optimizer is None:
        return module.state_dict(), {}
    model_sd, torch_optim_sd = torch_get_state_dict(module, optimizer)
    optim_sd = cast(dict[str, Any], torch_optim_sd)
    # New dicts: the optimizer's state_dict() shares its per-parameter dicts.
    optim_sd["state"] = {key: {field: _optimizer_view(module, key, value)
                               for field, value in state.items()}
                         for key, state in optim_sd.get("state", {}).items()}
    return model_sd, optim_sd


def set_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                   model_state_dict: dict | None = None,
                   optim_state_dict: dict | None = None, strict: bool = True) -> None:
    """Load what ``get_state_dict`` returned (after ``dcp.load`` filled it, from a
    checkpoint of any plan) into the module and its optimizer. DTensors in other
    placements are gathered and cut (``to_local``); whole tensors are cut."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.checkpoint.state_dict import set_state_dict as torch_set_state_dict

    if optimizer is None:
        if model_state_dict is not None:
            module.load_state_dict(model_state_dict, strict=strict)
        return
    optim_sd = dict(optim_state_dict or {})
    if "state" in optim_sd:
        optim_sd["state"] = {key: {field: _optimizer_value(module, key, value)
                                   for field, value in state.items()}
                             for key, state in optim_sd["state"].items()}
    torch_set_state_dict(module, optimizer, model_state_dict=model_state_dict or {},
                         optim_state_dict=optim_sd, options=StateDictOptions(strict=strict))


def _optimizer_view(module: Any, key: str, value: Any) -> Any:
    """An optimizer state tensor shaped like its parameter's shard as a DTensor view."""
    name = canonical(module, key)
    if name is None or not isinstance(value, torch.Tensor) or \
            value.shape != module.get_parameter(name).shape:
        return value
    return as_dtensor(module, name, value)


def _optimizer_value(module: Any, key: str, value: Any) -> Any:
    """An optimizer state value as the optimizer of this rank's shard takes it:
    DTensors and whole tensors of the parameter's shape become the local block;
    scalars (``step``) and the state of unknown names stay as they are."""
    from torch.distributed.tensor import DTensor

    name = canonical(module, key)
    if name is None or not isinstance(value, torch.Tensor):
        return value
    whole = tuple(value.shape) == tuple(module.shards[name].global_shape) and value.dim() > 0
    return to_local(module, key, value) if isinstance(value, DTensor) or whole else value


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= size
    return tuple(reversed(stride))
