"""Where a pipelined step's time goes, per rank (4 gloo ranks, the trust
bench's GPT-2): compute in the stage's ``forward_one_chunk`` and
``backward_one_chunk``, waiting in the schedule's point-to-point waits
(``_wait_batch_p2p``: bubbles and sends), the rest of the module's forward
(gradient sync, tied weights, the loss's broadcast) and the optimizer; beside
each stage's repriced per-microbatch forward and backward (with the profile
measured between the rounds, every rank at once) times M.

    PYTHONPATH=python python benches/pipeline_attribution.py ALPHA_S BANDWIDTH_B_PER_S
"""

import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CONFIGS = [(2, "1f1b", 4), (4, "1f1b", 4), (4, "gpipe", 4), (4, "1f1b", 8)]


def worker(rank, world, plans, rounds):
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as sch
    from torch.distributed.pipelining import PipelineStage

    from automap.api import apply
    from automap.cluster.device import measure_concurrently
    from automap.planner.plan import Plan
    from trust_workers import build
    acc = {}

    def timed(key, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[key] = acc.get(key, 0.0) + time.perf_counter() - t
                acc[key + "#"] = acc.get(key + "#", 0) + 1
        return wrapper
    sch._wait_batch_p2p = timed("wait", sch._wait_batch_p2p)
    PipelineStage.forward_one_chunk = timed("fwd", PipelineStage.forward_one_chunk)
    PipelineStage.backward_one_chunk = timed("bwd", PipelineStage.backward_one_chunk)
    mods = []
    for data in plans:
        model, inputs, loss_fn = build("gpt2")
        module = apply(Plan.from_dict(data), model, inputs, loss_fn=loss_fn)
        mods.append((module, torch.optim.AdamW(module.parameters(), lr=1e-4), inputs))
    out = [[] for _ in plans]
    profiles = []
    for r in range(rounds + 1):
        profiles.append(measure_concurrently("cpu").to_dict())
        for k, (module, opt, inputs) in enumerate(mods):
            dist.barrier()
            acc.clear()
            t0 = time.perf_counter()
            loss = module(**inputs)
            t1 = time.perf_counter()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            if r:
                out[k].append({**acc, "module": t1 - t0, "opt": t2 - t1, "step": t2 - t0})
    return {"rows": out, "profiles": profiles}


def main():
    warnings.simplefilter("ignore")
    import automap
    from automap.cluster.device import DeviceProfile
    from automap.launch import run_on_gloo
    from automap.planner.microbatch import microbatch_inputs
    from automap.planner.pipeline_search import reprice_pipeline
    from automap.sharding.mesh import DeviceMesh
    from automap.trace.profiling import profile_traced
    from automap.trace.tracing import trace
    from trust_workers import build
    alpha, bw = float(sys.argv[1]), float(sys.argv[2])
    mesh = DeviceMesh((4,), alpha_s=[alpha], bandwidth_bytes_per_s=[bw])
    model, inputs, loss_fn = build("gpt2")
    torch.set_num_threads(1)
    plans = []
    for n, s, m in CONFIGS:
        plans.append(automap.plan(model, inputs, mesh, loss_fn=loss_fn, pipeline=n,
                                  microbatches=m, schedule=s, verify=False,
                                  flops_per_s=5e9, memory_bandwidth_bytes_per_s=5e9,
                                  op_overhead_s=1e-5))
    res = run_on_gloo(worker, 4, [p.to_dict() for p in plans], 3, timeout_s=1200)
    during = DeviceProfile(**{k: statistics.median(p[k] for p in res[0]["profiles"])
                              for k in res[0]["profiles"][0]})
    print(f"profile during the rounds: {during}; load {os.getloadavg()}")
    keys = ("fwd", "bwd", "wait", "module", "opt", "step", "fwd#", "wait#")
    for i, (p, (n, s, m)) in enumerate(zip(plans, CONFIGS)):
        traced = trace(model, microbatch_inputs(inputs, m), loss_fn=loss_fn)
        part = reprice_pipeline(traced, profile_traced(traced, "adamw"), p, during, mesh=mesh)
        steps = [max(res[r]["rows"][i][j]["step"] for r in range(4)) for j in range(3)]
        print(f"== {n} stages {s} M={m}: predicted {part.step_s * 1e3:.0f} ms (tail "
              f"{part.tail_s * 1e3:.1f}, tied {part.tied_s * 1e3:.1f}, sends "
              f"{[round(x * 1e3, 2) for x in part.send_s]}); measured median "
              f"{statistics.median(steps) * 1e3:.0f} ms ({[round(x * 1e3) for x in steps]})")
        for r in range(4):
            rows = res[r]["rows"][i]
            med = {k: statistics.median(row.get(k, 0) for row in rows) for k in keys}
            st = next(k for k, rec in enumerate(p.pipeline.stages) if r in rec.ranks)
            other = med["module"] - med["fwd"] - med["bwd"] - med["wait"]
            priced = (part.forward_s[st] + part.backward_s[st]) * m
            print(f"   rank {r} stage {st}: fwd {med['fwd'] * 1e3:.0f} ({med['fwd#']:.0f}x) "
                  f"bwd {med['bwd'] * 1e3:.0f} wait {med['wait'] * 1e3:.0f} "
                  f"({med['wait#']:.0f}x) module {med['module'] * 1e3:.0f} other "
                  f"{other * 1e3:.0f} opt {med['opt'] * 1e3:.0f} | priced M x (fwd + bwd) "
                  f"{priced * 1e3:.0f}")


if __name__ == "__main__":
    main()
