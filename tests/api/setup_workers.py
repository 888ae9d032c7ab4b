"""Functions run inside spawned gloo processes by the setup-error tests."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

import automap
from automap.errors import AutomapError
from serial import build


def _outcome(fn) -> dict:
    start = time.perf_counter()
    try:
        fn()
    except AutomapError as exc:
        return {"class": type(exc).__name__, "message": str(exc),
                "least": getattr(exc, "smallest_feasible_budget_bytes", None),
                "seconds": time.perf_counter() - start}
    return {"class": None, "seconds": time.perf_counter() - start}


def errors_reach_every_rank(rank: int, world: int) -> dict:
    model, inputs, loss_fn = build("mlp")
    out = {}
    # A bad argument on rank 1 only: every rank raises rank 1's error.
    budget = -1.0 if rank == 1 else None
    out["argument"] = _outcome(lambda: automap.autoparallelize(
        model, inputs, memory_budget_bytes=budget, loss_fn=loss_fn, flops_per_s=1e6))
    # A planning error on the leader (a budget no plan fits): every rank raises it,
    # with the smallest feasible budget.
    out["planning"] = _outcome(lambda: automap.autoparallelize(
        model, inputs, memory_budget_bytes=1000, loss_fn=loss_fn, flops_per_s=1e6))
    # An option automap.plan does not take: refused on every rank before tracing.
    out["unknown_option"] = _outcome(lambda: automap.autoparallelize(
        model, inputs, loss_fn=loss_fn, flops_per_s=1e6, nonsense_option=1))
    # No optimizer state (optimizer=None) plans and trains.
    module = automap.autoparallelize(model, inputs, loss_fn=loss_fn, optimizer=None,
                                     flops_per_s=1e6)
    out["no_optimizer_loss"] = module(*inputs).item()
    # Inputs of another batch size than planned: a typed error before any collective.
    bigger = torch.cat([inputs[0], inputs[0]])
    out["batch"] = _outcome(lambda: module(bigger))
    out["dtype"] = _outcome(lambda: module(inputs[0].double()))
    out["extra"] = _outcome(lambda: module(inputs[0], inputs[0]))
    out["keyword"] = _outcome(lambda: module(inputs[0], mask=inputs[0]))
    # An input that requires a gradient (the program returns none for inputs);
    # without autograd it is only data.
    wanting = inputs[0].clone().requires_grad_()
    out["requires_grad"] = _outcome(lambda: module(wanting))
    with torch.no_grad():
        out["no_grad_loss"] = module(wanting).item()
    # The mode the graph was traced in cannot be switched: eval() would silently run
    # the training graph; train() (the traced mode) is a no-op.
    out["eval"] = _outcome(module.eval)
    out["training"] = module.train().training
    # A cast of the state: the program runs in the traced dtypes (float32 here).
    out["cast"] = _outcome(module.double)
    out["cast_to"] = _outcome(lambda: module.to(torch.float16))
    out["moved"] = module.to("cpu").float() is module  # no cast, or a move: torch's
    out["still_trains"] = module(*inputs).item()
    return out


def stopped_rank(rank: int, world: int, timeout_s: float) -> dict:
    """Rank 1 stops (SIGSTOP) before a setup; rank 0 must get a DistributedError
    within the timeout, then wakes rank 1 (SIGCONT), whose own setup then fails
    the same way because rank 0 has left."""
    model, inputs, loss_fn = build("mlp")
    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid())
    # One setup that works (with time for tracing on a busy machine), so the
    # setup channel exists before the stop.
    automap.autoparallelize(model, inputs, loss_fn=loss_fn, flops_per_s=1e6,
                            setup_timeout_s=120)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    out = _outcome(lambda: automap.autoparallelize(
        model, inputs, loss_fn=loss_fn, flops_per_s=1e6, setup_timeout_s=timeout_s))
    if rank == 0:
        os.kill(pids[1], signal.SIGCONT)
    return out
