"""Loss scaling for fp16 training of a ParallelModule.

``torch.amp.GradScaler`` decides from the gradients it sees whether to skip the
optimizer step, and each rank sees only its own shards: a tensor-parallel shard
that overflows on one rank would make that rank skip the step while the others
take it, and the replicas drift apart. ``GradScaler`` here is the same scaler
whose unscale (called by ``unscale_`` or by ``step``) takes the maximum of the
found-inf flags over the process group, so every rank skips the same steps and
updates the scale alike."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf/NaN check agrees across the ranks of
    ``group`` (default: the world; outside a process group it is torch's). Takes
    torch's arguments (``device`` first, default ``"cuda"``; ``"cpu"`` on gloo) and
    is used exactly like it:
    ``scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()``."""

    def __init__(self, device: str = "cuda", *args: Any, group: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(device, *args, **kwargs)
        self.group = group

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        if not self._enabled or not dist.is_initialized():
            return
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        # One flag per device; every rank holds shards on the same kind of device.
        for flag in found.values():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
