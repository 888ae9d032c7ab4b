"""Pipeline trust bench (issue 18, acceptance 3): predicted against measured step
time (and per-rank peak memory) of pipelined plans, beside the intra-op plan,
on 4 gloo ranks, measured as the trust bench measures (``trust_workers``: a
warm-up step, one profiled step for the peak of live tensor bytes, then the
median of timed steps started together on every rank).

The model is the trust bench's GPT-2-style LM (4 layers, width 256, batch 16 of
128 tokens). Plans: intra-op on (4,), and ``pipeline`` 2 and 4 stages under
1F1B and GPipe with 4 microbatches, all with the device's measured speeds (the
same for every plan: the planner measures them once per process).

    PYTHONPATH=python python benches/pipeline_trust.py [--steps 3] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import automap  # noqa: E402
from automap.launch import run_on_gloo  # noqa: E402
from trust_workers import build, measure_plans  # noqa: E402

WORLD = 4
MICROBATCHES = 4
#: (pipeline, schedule); "off": the intra-op plan on the whole mesh.
CONFIGS = [("off", None), (2, "1f1b"), (2, "gpipe"), (4, "1f1b"), (4, "gpipe")]


def plans(folder: str, configs) -> list[dict]:
    model, inputs, loss_fn = build("gpt2")
    rows = []
    for pipeline, schedule in configs:
        options = {} if pipeline == "off" else {
            "pipeline": pipeline, "microbatches": MICROBATCHES, "schedule": schedule}
        start = time.perf_counter()
        plan = automap.plan(model, inputs, automap.DeviceMesh((WORLD,)), loss_fn=loss_fn,
                            **options)
        record = plan.pipeline
        path = str(Path(folder) / f"{pipeline}_{schedule}.json")
        Path(path).write_text(plan.to_json())
        rows.append({
            "label": "intra-op (4,)" if record is None else
            f"{len(record.stages)} stages x {record.submesh_shape} {record.schedule}",
            "path": path, "planning_s": time.perf_counter() - start,
            "predicted_s": plan.predicted_step_s if record is None else record.predicted_step_s,
            "predicted_bytes": plan.predicted_peak_memory_bytes if record is None else
            max(s.predicted_peak_memory_bytes for s in record.stages)})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per plan")
    parser.add_argument("--quick", action="store_true", help="intra-op and 2 stages of 1F1B")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        rows = plans(folder, CONFIGS[:2] if args.quick else CONFIGS)
        jobs = [("gpt2", r["path"]) for r in rows]
        measured = run_on_gloo(measure_plans, WORLD, jobs, args.steps, timeout_s=1800)
    mib = 2**20
    print(f"{'plan':28s} {'planned':>8s} {'predicted':>10s} {'measured':>9s} {'error':>7s} "
          f"{'pred. peak':>10s} {'measured peak per rank (MiB)':>30s}")
    for r in rows:
        step_s = max(m[r["path"]]["step_s"] for m in measured)
        peaks = " ".join(f"{m[r['path']]['peak_bytes'] / mib:.1f}" for m in measured)
        print(f"{r['label']:28s} {r['planning_s']:7.1f}s {r['predicted_s'] * 1e3:8.1f}ms "
              f"{step_s * 1e3:7.1f}ms {(r['predicted_s'] / step_s - 1) * 100:+6.0f}% "
              f"{r['predicted_bytes'] / mib:10.1f} {peaks:>30s}")
    print(f"pipeline trust bench: {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
