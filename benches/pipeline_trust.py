"""Pipeline trust bench (issue 18, acceptance 3): predicted against measured step
time of pipelined plans beside the intra-op plan on 4 gloo ranks, by the method
of ``benches/step_time.py``:

1. ``detect_cluster`` on 4 ranks measures the links and the device profile,
   every rank at once; every plan is made with that cluster's (4,) mesh and
   profile.
2. 4 ranks build every plan's module (``apply``) and time its training steps,
   the plans taking turns step by step (outside load drifting over the run
   hits every plan alike); before each round every rank measures the device
   at once (``measure_concurrently``) and the links (``measure_mesh``). A
   step's time is the slowest rank's; the median over the rounds after
   warm-up is the measurement.
3. Every plan is priced again with the median profile and links measured
   during the rounds: intra-op plans by ``search.reprice``, pipelined ones by
   ``pipeline_search.reprice_pipeline`` (the same submesh plan and stage
   bounds).

The model is the trust bench's GPT-2-style LM (4 layers, width 256, batch 16 of
128 tokens). Plans: intra-op on (4,), and 2 and 4 stages under 1F1B and GPipe
with 4 microbatches, and some with 2 or 8. Printed: per plan the prediction
with the profile the plan was made with and with the one measured during the
steps (and with the stages always at the all-ranks-busy speed: "busy", the
model before ``shared_slowdown``), the measured median and the ratios; then
the Spearman rank correlation over all rows (intra-op and pipelines pooled)
and the median ratio; also, as an experiment, of the schedule simulated
under processor sharing (``shared_schedule_s``).

    PYTHONPATH=python python benches/pipeline_trust.py [--rounds 5] [--warmup 2] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

WORLD = 4
#: (pipeline, schedule, microbatches); "off": the intra-op plan on the whole mesh.
CONFIGS = [("off", None, 1), (2, "1f1b", 4), (2, "gpipe", 4), (4, "1f1b", 4),
           (4, "gpipe", 4), (2, "gpipe", 2), (2, "1f1b", 8), (4, "1f1b", 8)]


def _detect(rank: int, world: int) -> dict | None:
    from automap.cluster.detect import detect_cluster
    from automap.cluster.device import measure_concurrently

    cluster = detect_cluster(iters=3, measure_groups=2, quiet=True)
    shared = measure_concurrently("cpu").shared_slowdown  # the cluster file lacks it
    return (cluster.to_dict(), shared) if rank == 0 else None


def _plans(configs, mesh, device) -> list[dict]:
    import automap
    from trust_workers import build

    model, inputs, loss_fn = build("gpt2")
    rows = []
    for pipeline, schedule, microbatches in configs:
        options = {} if pipeline == "off" else {
            "pipeline": pipeline, "microbatches": microbatches, "schedule": schedule}
        start = time.perf_counter()
        plan = automap.plan(model, inputs, mesh, loss_fn=loss_fn,
                            flops_per_s=device.flops_per_s,
                            memory_bandwidth_bytes_per_s=device.memory_bandwidth_bytes_per_s,
                            op_overhead_s=device.op_overhead_s,
                            shared_slowdown=device.shared_slowdown, **options)
        record = plan.pipeline
        rows.append({
            "label": "intra-op (4,)" if record is None else
            f"{len(record.stages)} st. x {record.submesh_shape} {record.schedule} "
            f"M={record.microbatches}",
            "plan": plan.to_dict(), "planning_s": time.perf_counter() - start,
            "planned_s": plan.predicted_step_s if record is None else record.predicted_step_s})
    return rows


def _time_plans(rank: int, world: int, plans: list[dict], rounds: int, warmup: int) -> dict:
    import torch
    import torch.distributed as dist

    from automap.api import apply
    from automap.cluster.detect import TRAINING_LOAD_FLOPS, measure_mesh
    from automap.cluster.device import measure_concurrently
    from automap.planner.plan import Plan
    from automap.sharding.mesh import DeviceMesh
    from trust_workers import build

    modules = []
    for data in plans:
        model, inputs, loss_fn = build("gpt2")
        module = apply(Plan.from_dict(data), model, inputs, loss_fn=loss_fn)
        modules.append((module, torch.optim.AdamW(module.parameters(), lr=1e-4), inputs))
    whole = DeviceMesh((world,))
    times, profiles, links = [[] for _ in plans], [], []
    for _ in range(warmup + rounds):
        profiles.append(measure_concurrently("cpu").to_dict())
        links.append(measure_mesh(whole, load_flops=TRAINING_LOAD_FLOPS).to_dict())
        for k, (module, opt, inputs) in enumerate(modules):
            dist.barrier()
            start = time.perf_counter()
            module(**inputs).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times[k].append(time.perf_counter() - start)
    return {"times": times, "profiles": profiles, "links": links}


def _reprice(rows, device, mesh) -> list:
    from automap.planner.microbatch import microbatch_inputs
    from automap.planner.pipeline_search import reprice_pipeline
    from automap.planner.plan import Plan
    from automap.planner.search import reprice
    from automap.trace.profiling import profile_traced
    from automap.trace.tracing import trace
    from trust_workers import build

    model, inputs, loss_fn = build("gpt2")
    traced_by_m: dict = {}
    out = []
    for r in rows:
        plan = Plan.from_dict(r["plan"])
        m = plan.pipeline.microbatches if plan.pipeline else 1
        if m not in traced_by_m:
            traced = trace(model, microbatch_inputs(inputs, m) if m > 1 else inputs,
                           loss_fn=loss_fn)
            traced_by_m[m] = (traced, profile_traced(traced, "adamw"))
        traced, profile = traced_by_m[m]
        if plan.pipeline is None:
            out.append(reprice(traced, profile, plan, device, mesh=mesh).step_s)
        else:
            out.append(reprice_pipeline(traced, profile, plan, device, mesh=mesh))
    return out


def shared_schedule_s(part, schedule: str, microbatches: int, world: int,
                      shared_slowdown: float) -> float:
    """An experiment beside the model: the schedule's operations (torch's order
    per stage) run as a simulation under processor sharing, a busy rank going
    at ``min(1, capacity / busy ranks)`` of its speed alone, the capacity
    ``world / shared_slowdown`` ranks alone; the stage times are priced with
    every rank busy. Plus the tail and the tied weights."""
    from automap.generate.simulate_pipeline import schedule_order

    n = len(part.forward_s)
    per_stage = world // n
    orders = [schedule_order(schedule, microbatches, n, k) for k in range(n)]
    head, current, done = [0] * n, [None] * n, set()
    capacity, clock = world / shared_slowdown, 0.0

    def ready(k, op, i) -> bool:
        if op == "F":
            return k == 0 or ("F", k - 1, i) in done
        return ("F", k, i) in done and (k == n - 1 or ("B", k + 1, i) in done)

    while True:
        for k in range(n):
            if current[k] is None and head[k] < len(orders[k]):
                op, i = orders[k][head[k]]
                if ready(k, op, i):
                    work = part.forward_s[k] if op == "F" else part.backward_s[k]
                    current[k] = [op, i, work / shared_slowdown]
                    head[k] += 1
        busy = [k for k in range(n) if current[k] is not None]
        if not busy:
            break
        speed = min(1.0, capacity / (per_stage * len(busy)))
        step = min(current[k][2] for k in busy) / speed
        clock += step
        for k in busy:
            current[k][2] -= step * speed
            if current[k][2] <= 1e-12:
                done.add((current[k][0], k, current[k][1]))
                current[k] = None
    return clock + part.tail_s + part.tied_s


def _ranks(values) -> np.ndarray:
    values = np.asarray(values)
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(len(values))
    for v in np.unique(values):  # ties share their mean rank
        ranks[values == v] = ranks[values == v].mean()
    return ranks


def spearman(a, b) -> float:
    return float(np.corrcoef(_ranks(a), _ranks(b))[0, 1])


def _describe(device, mesh) -> str:
    return (f"{device.flops_per_s / 1e9:.1f} GFLOP/s, "
            f"{device.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
            f"{device.op_overhead_s * 1e6:.2f} us per kernel, alone "
            f"{device.shared_slowdown:.2f}x faster; link "
            f"{mesh.alpha_s[0] * 1e6:.0f} us {mesh.bandwidth_bytes_per_s[0] / 1e9:.2f} GB/s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per plan")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per plan first")
    parser.add_argument("--quick", action="store_true", help="the first 5 plans only")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    import os

    import torch

    from automap.cluster.cluster import Cluster
    from automap.cluster.device import FIELDS, DeviceProfile
    from automap.launch import run_on_gloo
    from automap.planner.plan import Plan
    from automap.sharding.mesh import DeviceMesh

    start = time.perf_counter()
    print(f"load before: {os.getloadavg()}")
    detected, shared = run_on_gloo(_detect, WORLD, timeout_s=600)[0]
    cluster = Cluster.from_dict(detected)
    measured = cluster.device_profile
    device = DeviceProfile(**{k: measured[k] for k in FIELDS}, shared_slowdown=shared)
    mesh = next(m for m in cluster.meshes() if m.shape == (WORLD,))
    print(f"detected (4 ranks at once): {_describe(device, mesh)}")
    torch.set_num_threads(1)
    rows = _plans(CONFIGS[:5] if args.quick else CONFIGS, mesh, device)
    print(f"{len(rows)} plans in {time.perf_counter() - start:.0f} s")
    results = run_on_gloo(_time_plans, WORLD, [r["plan"] for r in rows], args.rounds,
                          args.warmup, timeout_s=3000)
    per_step = np.max([r["times"] for r in results], axis=0)[:, args.warmup:]
    measured = [float(statistics.median(row)) for row in per_step]
    during = DeviceProfile(**{k: statistics.median(p[k] for p in results[0]["profiles"])
                              for k in device.to_dict()})
    links = results[0]["links"]
    during_mesh = DeviceMesh.from_dict({
        **links[0], "alpha_s": np.median([m["alpha_s"] for m in links], axis=0).tolist(),
        "bandwidth_bytes_per_s": np.median([m["bandwidth_bytes_per_s"] for m in links],
                                           axis=0).tolist()})
    print(f"during the timed steps: {_describe(during, during_mesh)}")
    priced = _reprice(rows, during, during_mesh)
    predicted = [p if isinstance(p, float) else p.step_s for p in priced]
    shared = [p if isinstance(p, float) else shared_schedule_s(
        p, Plan.from_dict(r["plan"]).pipeline.schedule, Plan.from_dict(r["plan"]).pipeline.
        microbatches, WORLD, during.shared_slowdown) for p, r in zip(priced, rows)]
    # The model before shared_slowdown: stages always at the all-ranks-busy speed.
    busy = [p if isinstance(p, float) else p.step_s for p in _reprice(
        rows, dataclasses.replace(during, shared_slowdown=1.0), during_mesh)]
    print(f"\n{'plan':28s} {'planned':>8s} {'predicted':>9s} {'measured':>8s} {'spread':>6s} "
          f"{'pred/m':>6s} {'busy/m':>6s} {'plan/m':>6s}  "
          "stages: per microbatch fwd+bwd ms; tail, tied ms")
    for r, p, pr, m, row, bu in zip(rows, predicted, priced, measured, per_step, busy):
        parts = "" if isinstance(pr, float) else (
            " ".join(f"{(f + b) * 1e3:.1f}" for f, b in zip(pr.forward_s, pr.backward_s))
            + f"; {pr.tail_s * 1e3:.1f}, {pr.tied_s * 1e3:.1f}")
        print(f"{r['label']:28s} {r['planned_s'] * 1e3:6.0f}ms {p * 1e3:7.0f}ms {m * 1e3:6.0f}ms "
              f"{(max(row) - min(row)) / m:6.0%} {p / m:6.2f} {bu / m:6.2f} "
              f"{r['planned_s'] / m:6.2f}  {parts}")
    for name, pred in (("predicted", predicted), ("all busy", busy), ("simulated", shared),
                       ("planned", [r["planned_s"] for r in rows])):
        ratios = [p / m for p, m in zip(pred, measured)]
        print(f"{name:9}: Spearman {spearman(pred, measured):+.3f} (goal >= 0.9), median "
              f"predicted/measured {statistics.median(ratios):.2f} (goal 0.67..1.5), range "
              f"{min(ratios):.2f}..{max(ratios):.2f}")
    print(f"load after: {os.getloadavg()}; wall {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
