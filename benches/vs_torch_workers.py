"""What the comparison with PyTorch's own data parallelism (benches/vs_torch.py, and
its test subset) runs inside spawned gloo processes: one GPT-2-style model and
global batch trained with AdamW under DDP, FSDP2 and automap, each measured by
``trust_workers.measure_training`` (peak of live tensor bytes per rank, step time)."""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from automap.solve.strategies import parameters_whole
from trust_workers import measure_training

logging.getLogger("transformers").setLevel(logging.ERROR)

#: automap with default options, and within a budget DDP cannot meet; the "_links"
#: runs plan the same on a mesh whose links were measured between idle ranks
#: (``automap.cluster.detect.measure_mesh`` without load) instead of after a
#: step's share of compute, as ``autoparallelize`` measures them.
#: "automap_dp" is a reference, not a verdict: the default options with every
#: parameter whole (data parallelism, what DDP runs), to tell the generated
#: program from the plan's choice.
RUNNERS = ("ddp", "fsdp2", "automap", "automap_budget", "automap_links",
           "automap_links_budget", "automap_dp")


@dataclass(frozen=True)
class Setup:
    """The model, the global batch and how each runner is measured."""

    layers: int = 4
    width: int = 256
    heads: int = 4
    vocab: int = 2048
    seq: int = 256
    batch: int = 16  # global: DDP and FSDP2 ranks each train on batch / world
    warmup_steps: int = 2  # DDP rebuilds its buckets in the second step
    timed_steps: int = 15
    #: automap's budget run plans within this fraction of DDP's measured peak
    #: (the largest rank's), so that DDP could not meet it.
    budget_fraction: float = 0.8
    lr: float = 1e-3


def build(setup: Setup):
    """The seeded model (transformers' GPT2LMHeadModel, dropout 0) and the global batch
    of token ids (the labels are the ids: the model shifts them)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=setup.layers, n_embd=setup.width, n_head=setup.heads,
                     vocab_size=setup.vocab, n_positions=setup.seq, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, setup.vocab, (setup.batch, setup.seq),
                        generator=torch.Generator().manual_seed(1))
    return model, ids


def _local_batch(ids: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's equal share of the global batch. Every rank's loss is the mean over
    as many tokens, so the mean of the ranks' losses and gradients (what DDP and FSDP2
    average) is the serial model's."""
    return ids.chunk(world)[rank].contiguous()


def _trainer(model, opt, inputs: dict):
    def step() -> float:
        loss = model(**inputs, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def _local(t):
    """A DTensor's local shard (FSDP2 parameters and their optimizer state)."""
    return t.to_local() if hasattr(t, "to_local") else t


def run_ddp(rank: int, world: int, setup: Setup):
    """DDP's training step and memory record."""
    from torch.nn.parallel import DistributedDataParallel

    model, ids = build(setup)
    local = _local_batch(ids, rank, world)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=setup.lr)

    def persistent():
        return [*model.parameters(), *model.buffers(), local,
                *pytree.tree_leaves(opt.state_dict()["state"])]

    def buckets_bytes() -> int:
        # The reducer's flat gradient buckets stay allocated between steps; no tensor
        # of the module shows them.
        sizes = ddp._get_ddp_logging_data().get("bucket_sizes", "")
        return sum(int(s) for s in str(sizes).split(",") if s.strip())

    step = _trainer(ddp, opt, {"input_ids": local, "labels": local})
    return step, measure_training(step, persistent, 0, setup.warmup_steps,
                                  extra_live_bytes=buckets_bytes)


def run_fsdp2(rank: int, world: int, setup: Setup):
    """FSDP2's (``fully_shard`` per block and on the root) step and memory record."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, ids = build(setup)
    local = _local_batch(ids, rank, world)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=setup.lr)

    def persistent():
        state = pytree.tree_leaves(opt.state_dict()["state"])
        return [_local(t) for t in [*model.parameters(), *model.buffers(), local, *state]]

    step = _trainer(model, opt, {"input_ids": local, "labels": local})
    return step, measure_training(step, persistent, 0, setup.warmup_steps)


def run_automap(rank: int, world: int, setup: Setup, budget_bytes: float | None, mesh=None,
                **plan_options):
    """automap's step and memory record with default options (the device's speeds
    measured on every rank at first use; ``mesh``: the 1-D mesh of the world with
    the default link model), within ``budget_bytes`` per rank when given; its inputs
    are the global batch, as ``autoparallelize`` takes them by default. The record
    holds the plan's predictions."""
    import automap

    model, ids = build(setup)
    inputs = {"input_ids": ids, "labels": ids}
    start = time.perf_counter()
    module = automap.autoparallelize(model, inputs, mesh=mesh or (world,),
                                     memory_budget_bytes=budget_bytes, **plan_options)
    setup_s = time.perf_counter() - start
    opt = torch.optim.AdamW(module.parameters(), lr=setup.lr)

    def step() -> float:
        loss = module(**inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def persistent():
        state = pytree.tree_leaves(opt.state_dict()["state"])
        return [*module.parameters(), *module.buffers(), *pytree.tree_leaves(inputs), *state]

    measured = measure_training(step, persistent, 0, setup.warmup_steps)
    plan = module.plan
    return step, {**measured, "setup_s": setup_s, "plan_kind": plan_kind(module),
                  "predicted_step_s": plan.predicted_step_s,
                  "predicted_peak_bytes": plan.predicted_peak_memory_bytes,
                  "budget_bytes": budget_bytes, "memory_binding": plan.memory_binding,
                  "checkpoint_blocks": plan.checkpoint.block_count() if plan.checkpoint else 0,
                  "device": dict(plan.cost_constants),
                  "links": {"alpha_s": plan.mesh.alpha_s,
                            "bandwidth_bytes_per_s": plan.mesh.bandwidth_bytes_per_s},
                  "local_parameter_bytes": module.local_parameter_bytes(),
                  # parameter reads gathered from their shard (FSDP/ZeRO-3, gather_shard)
                  "fsdp_gathers": module.code.count("gather_shard(")}


def plan_kind(module) -> str:
    """``"sharded"`` when the rank holds a shard of some parameter, else ``"data
    parallel"`` when some gradient is reduced across ranks, else ``"replicated"``."""
    from automap.sharding.spec import ShardingSpec

    shards = [s for s in module.shards.values() if s.kind == "parameter"]
    if any(not ShardingSpec.parse(s.spec).is_replicated for s in shards):
        return "sharded"
    if any(axes for node in module.plan.nodes.values() for axes in node.grad_reduce_axes):
        return "data parallel"
    return "replicated"


def _largest(value: float) -> float:
    """The largest of every rank's ``value``."""
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def compare(rank: int, world: int, setup: Setup, runners=RUNNERS) -> dict[str, dict]:
    """Each runner on this rank, as on every other rank: built and its memory measured
    in turn (``measure_training``; the budget runs plan within
    ``setup.budget_fraction`` of DDP's largest measured peak), then timed together:
    ``setup.timed_steps`` rounds of one step of each, every step started together on
    every rank, the order rotated each round, so that what else loads the machine
    meets every runner alike. By runner name, this rank's record with ``step_s``
    (median) and ``step_times_s``, and, the same on every rank, ``round_step_s`` (per
    round: the step's wall time, its slowest rank's) and ``round_cpu_s`` (per round:
    the CPU seconds of the step summed over the ranks)."""
    steps, out, measured = {}, {}, None
    for name in runners:
        mesh, budget = None, None
        if name.startswith("automap_links"):
            from automap.cluster.detect import measure_mesh
            from automap.sharding.mesh import DeviceMesh

            measured = measured or measure_mesh(DeviceMesh((world,)))
            mesh = measured
        if name.endswith("_budget"):
            budget = setup.budget_fraction * _largest(out["ddp"]["peak_bytes"])
        if name == "ddp":
            steps[name], out[name] = run_ddp(rank, world, setup)
        elif name == "fsdp2":
            steps[name], out[name] = run_fsdp2(rank, world, setup)
        elif name == "automap_dp":
            steps[name], out[name] = run_automap(rank, world, setup, budget, mesh,
                                                 strategy_filter=parameters_whole)
        elif name in RUNNERS:
            steps[name], out[name] = run_automap(rank, world, setup, budget, mesh)
        else:
            raise ValueError(f"unknown runner {name!r}; allowed: {RUNNERS}")
        out[name].update(round_step_s=[], round_cpu_s=[])
        dist.barrier()
    order = list(runners)
    for round_ in range(setup.timed_steps):
        wall, cpu = [], []
        for name in order[round_ % len(order):] + order[:round_ % len(order)]:
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            steps[name]()
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
            out[name]["step_times_s"].append(wall[-1])
        # Outside the timed steps: a step lasts until its slowest rank is done, and
        # its work is every rank's CPU time (all threads, gloo's included).
        slowest = torch.tensor(wall, dtype=torch.float64)
        work = torch.tensor(cpu, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        dist.all_reduce(work)
        for i, name in enumerate(order[round_ % len(order):] + order[:round_ % len(order)]):
            out[name]["round_step_s"].append(float(slowest[i]))
            out[name]["round_cpu_s"].append(float(work[i]))
    for record in out.values():
        times = record["step_times_s"]
        record["step_s"] = statistics.median(times) if times else None
    return out
