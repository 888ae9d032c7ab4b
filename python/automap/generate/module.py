"""The generated module: an fx GraphModule holding this rank's shards under the
user's parameter names, so ``module.parameters()`` feeds any optimizer as is."""

from __future__ import annotations

import torch
from torch import fx, nn

from automap.generate.state import StateShard
from automap.sharding.layout import layout_path
from automap.sharding.redistribute import redistribute


class ParallelModule(fx.GraphModule):
    """One rank's part of a parallel training step; ``print(module.code)`` shows it.

    Called like the traced model (same positional and keyword inputs); returns the
    traced graph's outputs (the loss), replicated on every rank. The train/eval mode
    of the model when it was traced is part of the graph (dropout, batch norm):
    generate an eval module from a model traced in eval mode. Data-parallel gradient
    all-reduces run outside the graph, in ``gradient_sync`` (bucketed, asynchronous,
    finished when ``backward()`` returns)."""

    plan: object
    groups: object
    shards: dict[str, StateShard]

    def full_state_dict(self, gradients: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter and buffer gathered whole (collective: every rank of the
        mesh calls it), by the user's names; for checkpoints and checks.
        ``gradients``: the parameters' gradients instead (those that have one)."""
        out = {}
        with torch.no_grad():
            for name, shard in self.shards.items():
                if shard.kind == "constant" or (gradients and shard.kind != "parameter"):
                    continue
                local = self.get_parameter(name) if shard.kind == "parameter" else \
                    self.get_buffer(name)
                if gradients:
                    local = local.grad
                    if local is None:
                        continue
                whole = "R" * len(shard.global_shape)
                path = layout_path(self.plan.mesh, shard.spec, whole, list(shard.global_shape),
                                   local.dtype.itemsize)
                out[name] = redistribute(local.detach(), path, self.groups).clone()
        return out

    def local_parameter_bytes(self) -> int:
        """Bytes of the parameter shards this rank holds."""
        return sum(p.numel() * p.element_size() for p in self.parameters())


def register_state(root: nn.Module, name: str, value: torch.Tensor, kind: str,
                   requires_grad: bool) -> None:
    """Put ``value`` at the dotted ``name`` of ``root``, creating empty modules on the way."""
    *path, leaf = name.split(".")
    module = root
    for atom in path:
        if not hasattr(module, atom):
            module.add_module(atom, nn.Module())
        module = getattr(module, atom)
    if kind == "parameter":
        module.register_parameter(leaf, nn.Parameter(value, requires_grad=requires_grad))
    else:
        module.register_buffer(leaf, value, persistent=kind == "buffer")
