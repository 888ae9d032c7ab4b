"""What the trust bench (benches/trust.py) and its test subset run inside spawned
gloo processes: the bench's models, and one rank's measured training step under
a saved plan (peak memory from real allocations, step time)."""

from __future__ import annotations

import logging
import statistics
import time

import torch
from torch import nn
from torch.utils import _pytree as pytree

from automap.trace.allocator_events import allocation_peak_bytes
from automap.trace.profiling import IMPL_KEYWORDS

logging.getLogger("transformers").setLevel(logging.ERROR)


class MLP(nn.Module):
    def __init__(self, width: int = 512, depth: int = 4, classes: int = 16) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.body(x))


def build(name: str):
    """``(model, inputs, loss_fn)`` of a bench model on the CPU, seeded, fp32, no
    dropout (``measure_plan`` trains it on another device from there)."""
    torch.manual_seed(0)
    if name == "mlp":
        model = MLP()
        # A batch whose activations weigh (16 MiB per rank unconstrained): with
        # 64 rows the unconstrained plan was already the leanest, every budget one.
        x, y = torch.randn(1024, 512), torch.randint(0, 16, (1024,))
        return model, (x,), lambda out: nn.functional.cross_entropy(out, y)
    if name == "mlp_state":
        # Eight rows: its step peaks in the optimizer's step (parameters, their
        # gradients and AdamW's state, 16 MiB replicated), where the kernels'
        # temporaries decide (``optimizer_impl``).
        model = MLP()
        x, y = torch.randn(8, 512), torch.randint(0, 16, (8,))
        return model, (x,), lambda out: nn.functional.cross_entropy(out, y)
    if name == "gpt2":
        import model_zoo
        from automap.trace.tracing import default_loss

        model = model_zoo.dropout_free_gpt2_lm(4, 256, 4, 2048, 128)
        ids = torch.randint(0, 2048, (16, 128))
        return model, {"input_ids": ids, "labels": ids}, default_loss
    if name == "resnet":
        import model_zoo

        model = model_zoo.ResNet(width=16)
        x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
        return model, (x,), lambda out: nn.functional.cross_entropy(out, y)
    raise ValueError(f"unknown bench model {name!r}")


def _call(module, inputs):
    return module(**inputs) if isinstance(inputs, dict) else module(*inputs)


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            key = t.untyped_storage()._cdata
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def _allocation_peak_bytes(prof) -> int:
    """The most bytes the CPU allocator held during the profiled region beyond what
    it held when the region began, from the allocator's own running total that
    every profiler allocation event carries (``profile_memory=True``). The total is
    kept by the allocator whatever thread frees a tensor; the profiler loses the
    events of frees on some threads (gloo's workers drop tensors a collective held),
    so summing the events' sizes overcounts."""
    return allocation_peak_bytes(prof.profiler.kineto_results, "cpu")


def measure_plan(rank: int, world: int, name: str, plan_path: str, timed_steps: int = 0,
                 device: str | None = None, optimizer_impl: str | None = None) -> dict:
    """This rank's steady-state AdamW step under the plan saved at ``plan_path``
    (``measure_training``), on ``device`` (default: the backend's, CUDA under
    NCCL; gloo ranks can share a GPU, their collectives staged through the host),
    AdamW stepping with ``optimizer_impl``'s kernels (default: the plan's)."""
    from automap.api import apply
    from automap.planner.plan import Plan

    if device is None and torch.distributed.get_backend() == "nccl":
        device = "cuda"
    dev = torch.device(device or "cpu")
    if dev.type == "cuda":
        dev = torch.device("cuda", dev.index or 0)
        torch.cuda.set_device(dev)
    # Traced where the model is (the CPU; a closure's labels become the graph's
    # constants, which the generated module holds on ``dev``), trained on ``dev``.
    model, example_inputs, loss_fn = build(name)
    plan = Plan.from_json(plan_path)
    module = apply(plan, model, example_inputs, loss_fn=loss_fn, device=dev)
    inputs = pytree.tree_map_only(torch.Tensor, lambda t: t.to(dev), example_inputs)
    # The kernels the plan sized the step's temporaries for (torch's default on
    # this device where it says "auto" or nothing).
    impl = optimizer_impl or plan.cost_constants.get("optimizer_impl", "auto")
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, **IMPL_KEYWORDS.get(impl, {}))

    def step() -> float:
        loss = _call(module, inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def persistent() -> list:
        state = pytree.tree_leaves(opt.state_dict()["state"])
        return [*module.parameters(), *module.buffers(), *pytree.tree_leaves(inputs), *state]

    measured = measure_training(step, persistent, timed_steps)
    return {"rank": rank, **measured}


def measure_training(step, persistent, timed_steps: int = 0, warmup_steps: int = 1,
                     extra_live_bytes=None) -> dict:
    """One rank's steady-state training step: ``step()`` runs one (forward, backward,
    optimizer step, gradients set to None) and returns the loss; ``persistent()`` lists
    the tensors live between steps (parameters, buffers, inputs, optimizer state; each
    storage counted once), ``extra_live_bytes()`` what else stays allocated between
    steps that no tensor shows (e.g. DDP's gradient buckets). After ``warmup_steps`` steps
    (the first creates the optimizer state): the peak of live tensor bytes of one step
    (the persistent bytes plus the peak of the allocator's events during it: CPU
    profiler memory events, or ``torch.cuda.max_memory_allocated`` on a GPU), its loss,
    and the wall times of ``timed_steps`` further steps, each started together on
    every rank (a barrier), with their median."""
    for _ in range(warmup_steps):
        step()
    tensors = persistent()
    live = _storage_bytes(tensors) + (extra_live_bytes() if extra_live_bytes else 0)
    allocated_before = None
    if any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in tensors):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        # What the allocator holds beyond the live tensors (cuBLAS's workspace,
        # say) is in the peak too: reported to tell the two apart.
        allocated_before = torch.cuda.memory_allocated()
        loss = step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    profile_memory=True) as prof:
            loss = step()
        peak = live + _allocation_peak_bytes(prof)
    times = []
    for _ in range(timed_steps):
        torch.distributed.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"peak_bytes": int(peak), "live_before_bytes": live, "loss": loss,
            "allocated_before_bytes": allocated_before,
            "step_s": statistics.median(times) if times else None, "step_times_s": times}


def measure_plans(rank: int, world: int, jobs: list[tuple[str, str]], timed_steps: int = 0,
                  device: str | None = None, optimizer_impl: str | None = None
                  ) -> dict[str, dict]:
    """``measure_plan`` for each (model name, plan path), by path."""
    return {path: measure_plan(rank, world, name, path, timed_steps, device, optimizer_impl)
            for name, path in jobs}
