"""The step-time model against measured steps: one GPT-2-style model (4 layers,
width 256, vocab 2048, sequence 256, global batch 16) under at least 10
distinct plans (the solver's at several budgets on meshes (4,) and (2, 2),
and forced ones: data parallel, Megatron, fully replicated, sharded
parameters, 2-D) on 4 gloo ranks of this machine, AdamW.

1. ``detect_cluster`` on 4 ranks measures the links and the device profile,
   every rank at once (on a 2-core machine each rank gets half a core).
2. This process plans every case with that cluster's meshes and profile.
3. 4 ranks build every plan's module and time its training steps, the plans
   taking turns step by step (so that outside load drifting over the run
   hits every plan alike): a step's time is the slowest rank's; the median
   over the steps after warm-up is the measurement.

Printed: per plan, the prediction before (FLOPs over the FLOP rate, every
collective in sequence, no optimizer; the model this replaces) and after
(roofline per node, kernel overheads, optimizer step, gradient buckets
overlapping the backward), the measured median and both ratios; then the
Spearman rank correlation and the median predicted/measured ratio of each.

    PYTHONPATH=python python benches/step_time.py [--rounds 5] [--warmup 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "support"))

WORLD = 4
VOCAB, SEQ, HIDDEN, HEADS, LAYERS, BATCH = 2048, 256, 256, 4, 4, 16
#: The old model: compute is FLOPs over the FLOP rate alone (bandwidth and
#: kernel overhead out of the picture), nothing overlapped, no optimizer step.
UNBOUNDED_BYTES_PER_S, NO_OVERHEAD_S = 1e30, 1e-30
OLD_DEFAULT_FLOPS_PER_S = 100e12


def _model():
    from automap.cli.demo import TinyGPT2

    torch.manual_seed(0)
    return TinyGPT2(VOCAB, SEQ, HIDDEN, HEADS, LAYERS)


def _batch():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _detect(rank: int, world: int) -> dict | None:
    from automap.cluster.detect import detect_cluster

    cluster = detect_cluster(iters=3, measure_groups=2, quiet=True)
    return cluster.to_dict() if rank == 0 else None


def _replicated(ins, outs) -> bool:
    return all(set(spec) <= {"R"} for spec in (*ins, *outs))


def _cases(mesh_1d, mesh_2d, device, traced, profile):
    """(label, plan) of every case, distinct plans only."""
    from automap.errors import InfeasibleBudgetError
    from automap.planner.search import plan_traced
    from forced_plans import BATCH as SPLIT_BATCH
    from forced_plans import forced_plan

    model, inputs = _model(), _batch()
    options = {"device": device, "checkpointing": "off"}
    inputs_split = {"args_0": SPLIT_BATCH, "args_1": SPLIT_BATCH}
    column, row = r"\.(q|k|v|fc)\.", r"\.(proj|fc_proj)\.weight"

    def megatron(axis: int) -> dict:
        return {fr"{column}weight": f"S{axis}R", fr"{column}bias": f"S{axis}",
                row: f"RS{axis}"}

    ops = [n.name for n in traced.graph.nodes if n.op == "call_function"]
    cases = []

    def forced(label, mesh, **constraints):
        cases.append((label, forced_plan(model, inputs, None, mesh, **constraints,
                                         **options)[1]))

    def solved(label, mesh, budget=None, checkpointing="off"):
        cases.append((label, plan_traced(traced, profile, mesh, budget, device=device,
                                         checkpointing=checkpointing)))

    def smallest_budget(mesh) -> float:
        try:
            plan_traced(traced, profile, mesh, 1.0, device=device, checkpointing="off")
        except InfeasibleBudgetError as err:
            return float(err.smallest_feasible_budget_bytes)
        raise AssertionError("a 1-byte budget fitted")

    for shape, mesh in (("(4,)", mesh_1d), ("(2,2)", mesh_2d)):
        solved(f"solver {shape}", mesh)
        peak, least = cases[-1][1].predicted_peak_memory_bytes, smallest_budget(mesh)
        solved(f"solver {shape}, budget halfway", mesh, (peak + least) / 2)
        solved(f"solver {shape}, smallest budget", mesh, least * 1.01)
    solved("solver (4,), checkpointing", mesh_1d, smallest_budget(mesh_1d) * 0.85, "auto")
    forced("data parallel (4,)", mesh_1d, params={}, inputs=inputs_split)
    forced("data parallel (2,2)", mesh_2d, params={}, inputs={
        "args_0": "S01R", "args_1": "S01R"})
    forced("Megatron (4,)", mesh_1d, params=megatron(0), inputs={"args_0": "RR"})
    forced("2-D: batch x Megatron (2,2)", mesh_2d, params=megatron(1),
           inputs={"args_0": "S0R", "args_1": "S0R"})
    forced("sharded parameters, batch split (4,)", mesh_1d,
           params={r"ln_(\d|f)\.weight$": "S0", r"weight$": "S0R", r"bias$": "S0"},
           inputs=inputs_split)
    forced("fully replicated (4,)", mesh_1d, params={}, inputs={"args_0": "RR", "args_1": "RR"},
           ops={name: _replicated for name in ops})
    distinct, seen = [], set()
    for label, found in cases:
        key = (found.mesh.shape, tuple((n.name, tuple(n.inputs), tuple(n.outputs))
                                       for n in found.nodes.values()),
               repr(found.checkpoint.to_dict()) if found.checkpoint else None)
        if key not in seen:
            seen.add(key)
            distinct.append((label, found))
    return distinct


def _time_plans(rank: int, world: int, plans: list[dict], rounds: int, warmup: int) -> dict:
    import torch.distributed as dist

    from automap.cluster.detect import TRAINING_LOAD_FLOPS, measure_mesh
    from automap.cluster.device import measure_concurrently
    from automap.generate.program import generate
    from automap.planner.plan import Plan
    from automap.trace.tracing import default_loss, trace

    model = _model()
    ids, labels = _batch()
    traced = trace(model, (ids, labels), loss_fn=default_loss)
    groups, modules = {}, []
    for data in plans:
        p = Plan.from_dict(data)
        if p.mesh.shape not in groups:
            groups[p.mesh.shape] = p.mesh.process_groups()
        module = generate(traced, p, model, groups[p.mesh.shape])
        modules.append((module, torch.optim.AdamW(module.parameters(), lr=1e-4)))
    meshes = {p.mesh.shape: p.mesh for p in map(Plan.from_dict, plans)}
    times, profiles, links = [[] for _ in plans], [], []
    for _ in range(warmup + rounds):
        # The device and the links in the same conditions as the steps around them.
        profiles.append(measure_concurrently("cpu").to_dict())
        links.append({shape: measure_mesh(mesh, load_flops=TRAINING_LOAD_FLOPS).to_dict()
                      for shape, mesh in meshes.items()})
        for k, (module, opt) in enumerate(modules):
            dist.barrier()
            start = time.perf_counter()
            module(ids, labels).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times[k].append(time.perf_counter() - start)
    return {"times": times, "profiles": profiles, "links": links}


def _ranks(values) -> np.ndarray:
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(len(values))
    values = np.asarray(values)
    for v in np.unique(values):  # ties share their mean rank
        ranks[values == v] = ranks[values == v].mean()
    return ranks


def _describe(device) -> str:
    return (f"{device.flops_per_s / 1e9:.1f} GFLOP/s, "
            f"{device.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
            f"{device.op_overhead_s * 1e6:.2f} us per kernel")


def _describe_links(mesh) -> str:
    return " x ".join(f"{a * 1e6:.0f} us {b / 1e9:.2f} GB/s"
                      for a, b in zip(mesh.alpha_s, mesh.bandwidth_bytes_per_s))


def spearman(a, b) -> float:
    return float(np.corrcoef(_ranks(a), _ranks(b))[0, 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per plan")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per plan first")
    args = parser.parse_args()
    warnings.simplefilter("ignore")

    from automap.cluster.cluster import Cluster
    from automap.cluster.device import FIELDS, DeviceProfile
    from automap.launch import run_on_gloo
    from automap.planner.search import reprice
    from automap.sharding.mesh import DeviceMesh
    from automap.trace.profiling import profile_traced
    from automap.trace.tracing import default_loss, trace

    start = time.perf_counter()
    cluster = Cluster.from_dict(run_on_gloo(_detect, WORLD, timeout_s=600)[0])
    measured = cluster.device_profile
    device = DeviceProfile(**{k: measured[k] for k in (*FIELDS, "shared_slowdown")})
    meshes = {m.shape: m for m in cluster.meshes()}  # fitted on the fastest iterations
    print(f"device profile (4 ranks at once): {_describe(device)}; links "
          + ", ".join(f"{m.shape}: {_describe_links(m)}" for m in meshes.values()))

    torch.set_num_threads(1)
    model, inputs = _model(), _batch()
    traced = trace(model, inputs, loss_fn=default_loss)
    profile = profile_traced(traced, "adamw")
    cases = _cases(meshes[(4,)], meshes[(2, 2)], device, traced, profile)
    print(f"{len(cases)} distinct plans in {time.perf_counter() - start:.0f} s")
    results = run_on_gloo(_time_plans, WORLD, [p.to_dict() for _, p in cases], args.rounds,
                          args.warmup, timeout_s=3000)
    per_step = np.max([r["times"] for r in results], axis=0)[:, args.warmup:]
    measured = [float(statistics.median(row)) for row in per_step]
    # The device as it ran: the median over the rounds of the profile every rank
    # measured at once between them.
    during = DeviceProfile(**{k: statistics.median(p[k] for p in results[0]["profiles"])
                              for k in device.to_dict()})
    rounds = results[0]["links"]
    links = {shape: DeviceMesh.from_dict({
        **rounds[0][shape],
        "alpha_s": np.median([r[shape]["alpha_s"] for r in rounds], axis=0).tolist(),
        "bandwidth_bytes_per_s": np.median([r[shape]["bandwidth_bytes_per_s"] for r in rounds],
                                           axis=0).tolist()}) for shape in rounds[0]}
    print(f"device profile during the timed steps: {_describe(during)}; links "
          + ", ".join(f"{shape}: {_describe_links(m)}" for shape, m in links.items()))
    old_device = DeviceProfile(during.flops_per_s, UNBOUNDED_BYTES_PER_S, NO_OVERHEAD_S)
    before = [reprice(traced, profile, p, old_device, mesh=links[p.mesh.shape]).sequential_s
              for _, p in cases]
    after = [reprice(traced, profile, p, during, mesh=links[p.mesh.shape]) for _, p in cases]
    planned = [p.predicted_step_s for _, p in cases]
    # What the old model predicted out of the box: its default FLOP rate (an
    # A100's) and the detected links.
    shipped_device = DeviceProfile(OLD_DEFAULT_FLOPS_PER_S, UNBOUNDED_BYTES_PER_S, NO_OVERHEAD_S)
    shipped = [reprice(traced, profile, p, shipped_device, mesh=meshes[p.mesh.shape]).sequential_s
               for _, p in cases]

    print(f"\n{'plan':36} {'peak MiB':>8} {'before ms':>9} {'after ms':>8} {'measured':>8} "
          f"{'spread':>6} {'before/m':>8} {'after/m':>7} {'planned/m':>9}  after: exposed sync, "
          f"optimizer ms")
    for (label, p), b, t, pl, m, row in zip(cases, before, after, planned, measured, per_step):
        spread = (max(row) - min(row)) / m
        a = t.step_s
        print(f"{label[:36]:36} {p.predicted_peak_memory_bytes / 2**20:8.1f} {b * 1e3:9.1f} "
              f"{a * 1e3:8.1f} {m * 1e3:8.1f} {spread:6.0%} {b / m:8.2f} {a / m:7.2f} "
              f"{pl / m:9.2f}  {t.exposed_sync_s * 1e3:.1f} of {t.gradient_sync_s * 1e3:.1f}, "
              f"{t.optimizer_s * 1e3:.1f}")
    print("(before: FLOPs over the FLOP rate, collectives in sequence, no optimizer; after: "
          "this model, both with the profile and links measured during the steps; planned: "
          "this model with the profile and links the plans were made with; shipped: the old "
          "model with its default 100 TFLOP/s and the detected links)")
    after = [t.step_s for t in after]
    for name, pred in (("before", before), ("after", after), ("planned", planned),
                       ("shipped", shipped)):
        ratios = [p / m for p, m in zip(pred, measured)]
        print(f"{name:7}: Spearman {spearman(pred, measured):+.3f} (goal >= 0.9), median "
              f"predicted/measured {statistics.median(ratios):.2f} (goal 0.67..1.5), range "
              f"{min(ratios):.2f}..{max(ratios):.2f}")
    print(f"wall {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
