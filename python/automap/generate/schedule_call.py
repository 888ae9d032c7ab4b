"""One call of a ``torch.distributed.pipelining`` schedule on microbatches the
caller has split (automap splits the batch itself, with its own checks and
loss weights).

torch's schedules take pre-split microbatches in ``step(arg_mbs=...)`` and
``eval(arg_mbs=...)`` only in recent releases; before, ``step`` split whole-batch
inputs itself and passed any other keyword to the model (torch 2.11 fed
``arg_mbs`` to the first stage's forward). There the schedule's own loop,
``_step_microbatches``, is called as those releases' ``step`` calls it."""

from __future__ import annotations

import inspect
from typing import Any


def run_schedule(schedule: Any, arg_mbs: list | None, target_mbs: list, losses: list, *,
                 backward: bool) -> None:
    """Forward (and with ``backward`` the backward) of every microbatch through
    ``schedule``; the last stage's losses are appended to ``losses``."""
    if "arg_mbs" in inspect.signature(schedule.step).parameters:
        if backward:
            schedule.step(arg_mbs=arg_mbs, target_mbs=target_mbs, losses=losses,
                          return_outputs=False)
        else:
            schedule.eval(arg_mbs=arg_mbs, target_mbs=target_mbs, losses=losses)
        return
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    had_backward = schedule._has_backward
    schedule._has_backward = had_backward and backward
    try:
        for stage in stages:
            stage.has_backward = schedule._has_backward
            stage.clear_runtime_states()
        loop = schedule._step_microbatches
        extra = {"return_outputs": False} if "return_outputs" in \
            inspect.signature(loop).parameters else {}
        loop(arg_mbs, None, target_mbs, losses, **extra)
    finally:
        schedule._has_backward = had_backward
