"""Trust bench on one GPU (issue 14, item 2): predicted per-rank peak memory
against ``torch.cuda.max_memory_allocated``, and predicted step time against the
measured one.

A machine with one GPU cannot run NCCL on several ranks (NCCL refuses two ranks
on one device), so two set-ups:

- ``--ranks 1`` (default): one NCCL rank in this process, mesh (1,): the plans
  differ by their activation checkpointing under the budgets (the whole memory
  model but the collectives' buffers);
- ``--ranks 4``: 4 gloo processes that share the GPU, mesh (4,): the sharded
  plans of ``benches/trust.py`` with their tensors on the GPU (gloo stages CUDA
  tensors through host memory, so a collective's own buffers are not on the
  device); each process has its own caching allocator, hence its own peak.

The plans are made with the GPU's speeds measured here (``measure_device_profile``)
unless ``--cpu-speeds`` (``benches/trust.py``'s). Printed per plan as in
``benches/trust.py``, plus what the allocator held before the step beyond the
live tensors (cuBLAS's workspace, say), and the predicted and measured step.
The one NCCL rank's plans are CUDA plans: their predicted peaks hold the
libraries' workspaces measured here (``automap.cluster.workspace``), so they
compare with ``max_memory_allocated`` as it is. The 4 gloo ranks' plans are
CPU plans (gloo's): their peaks hold none, and "other" is what they miss.

    python benches/trust_gpu.py                     # one NCCL rank, three models
    python benches/trust_gpu.py gpt2 --ranks 4      # 4 gloo ranks sharing the GPU

Without a GPU it prints so and exits 0 (``--device cpu`` runs it on the CPU with
gloo, to check the bench itself). Exit status 1 as ``benches/trust.py``'s.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from automap.launch import free_port, run_on_gloo  # noqa: E402
from trust import FRACTIONS, SPEEDS, plans_for, report  # noqa: E402
from trust_workers import measure_plans  # noqa: E402

TIMED_STEPS = 3


def _one_rank(device: str):
    """This process as the one rank of a group: NCCL on a GPU, gloo on the CPU."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1)
    return backend


def run(names, fractions, ranks: int, device: str, speeds: dict) -> list[dict]:
    rows = []
    backend = _one_rank(device) if ranks == 1 else "gloo"
    with tempfile.TemporaryDirectory() as folder:
        for name in names:
            start = time.perf_counter()
            planned = plans_for(name, folder, fractions, mesh_shape=(ranks,), backend=backend,
                                speeds=speeds)
            print(f"{name}: {len(planned)} plans in {time.perf_counter() - start:.1f} s",
                  flush=True)
            jobs = [(r["model"], r["path"]) for r in planned if "path" in r]
            if ranks == 1:
                measured = [measure_plans(0, 1, jobs, TIMED_STEPS, device)]
            else:
                measured = run_on_gloo(measure_plans, ranks, jobs, TIMED_STEPS, device,
                                       timeout_s=900)
            for r in planned:
                if "path" in r:
                    per_rank = [m[r["path"]] for m in measured]
                    r["measured"] = [m["peak_bytes"] for m in per_rank]
                    r["other"] = max((m["allocated_before_bytes"] or m["live_before_bytes"])
                                     - m["live_before_bytes"] for m in per_rank)
                    r["step_s"] = max(m["step_s"] for m in per_rank)
            rows += planned
    if ranks == 1:
        dist.destroy_process_group()
    return rows


#: Beside ``trust.report``'s: what the allocator held before the step beyond
#: the live tensors, and the step predicted / measured.
EXTRA = [("other MiB", 9, lambda r: f"{r['other'] / 2**20:.2f}"),
         ("step pred/meas ms", 18,
          lambda r: f"{r['predicted_step_s'] * 1e3:.2f}/{r['step_s'] * 1e3:.2f}")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["mlp", "gpt2", "resnet"])
    parser.add_argument("--ranks", type=int, default=1, choices=(1, 2, 4))
    parser.add_argument("--quick", action="store_true",
                        help="two budgets only: unconstrained, and half-way to the least")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--cpu-speeds", action="store_true",
                        help="plan at benches/trust.py's speeds, not the GPU's measured ones")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("trust_gpu: no CUDA GPU here; nothing measured")
        return 0
    warnings.filterwarnings("ignore", category=UserWarning)
    speeds = SPEEDS
    if args.device == "cuda" and not args.cpu_speeds:
        from automap.cluster.device import FIELDS, measure_device_profile

        profile = measure_device_profile("cuda")
        speeds = {name: getattr(profile, name) for name in FIELDS}
        print("GPU:", torch.cuda.get_device_name(), {k: f"{v:.3g}" for k, v in speeds.items()})
    start = time.perf_counter()
    rows = run(args.models, (None, 0.5) if args.quick else FRACTIONS, args.ranks,
               args.device, speeds)
    ok = report(rows, EXTRA)
    print(f"trust_gpu bench: {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
