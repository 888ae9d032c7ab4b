"""The trust bench's cheap subset (issue 14, item 2; benches/trust.py in full): plans
of the bench's MLP and GPT-2-style LM at budgets from unconstrained down to the
smallest feasible, with checkpointing off and auto, applied on 4 gloo ranks and
trained with AdamW; every rank's measured peak (the smaller of two runs) is within
5 % of the plan's prediction and within the plan's budget."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from automap.launch import run_on_gloo
from trust import MAX_ERROR, MESH, plans_for
from trust_workers import measure_plans

pytestmark = pytest.mark.multiprocess

#: (model, budgets as in ``trust.FRACTIONS``, checkpointing modes, AdamW's kernels:
#: the state-heavy MLP peaks in the optimizer's step, whose foreach temporaries
#: are one per parameter shard).
SUBSET = [("mlp", (None, "least"), ("off",), "auto"), ("gpt2", (0.33, "least"), ("auto",), "auto"),
          ("mlp_state", (None,), ("off",), "foreach")]


@pytest.mark.timeout(600)
def test_predicted_peaks_hold_on_every_rank():
    with tempfile.TemporaryDirectory() as folder:
        planned = []
        for name, fractions, modes, impl in SUBSET:
            planned += plans_for(name, folder, fractions, modes, optimizer_impl=impl)
        rows = [r for r in planned if "path" in r]
        assert len(rows) == 5, planned  # every budget of the subset is feasible
        jobs = [(r["model"], r["path"]) for r in rows]
        # Two runs: each rank's smaller peak. Now and then (1 of 16 rank-plans in
        # one loaded CI run, 0 of 48 in the bench) gloo's worker thread still frees
        # a buffer late on one rank; open in issue 14.
        runs = [run_on_gloo(measure_plans, MESH[0], jobs, timeout_s=250) for _ in range(2)]
    failures = []
    for r in rows:
        peaks = [min(run[rank][r["path"]]["peak_bytes"] for run in runs)
                 for rank in range(MESH[0])]
        label = f"{r['model']} budget {r['budget']} {r['mode']}"
        for rank, peak in enumerate(peaks):
            error = r["predicted"] / peak - 1
            if abs(error) > MAX_ERROR:
                failures.append(f"{label}: rank {rank} measured {peak} B, predicted "
                                f"{r['predicted']:.0f} B ({error:+.1%})")
            if r["budget"] is not None and peak > r["budget"]:
                failures.append(f"{label}: rank {rank} measured {peak} B over the budget")
    assert not failures, "\n".join(failures)
    # The budgets bind: the GPT-2 plans checkpoint, the least MLP one is leaner.
    assert all(r["blocks"] > 0 for r in rows if r["model"] == "gpt2")
    mlp = {r["fraction"]: r["predicted"] for r in rows if r["model"] == "mlp"}
    assert mlp["least"] < mlp[None]


@pytest.mark.timeout(300)
def test_the_gpu_bench_runs_its_plans_on_one_rank():
    """``benches/trust_gpu.py`` (one NCCL rank on a GPU) run on the CPU with one
    gloo rank: it plans, measures and reports every row within 5 %. Without a GPU
    ``--device cuda`` says so and exits 0."""
    bench = Path(__file__).resolve().parents[2] / "benches" / "trust_gpu.py"
    done = subprocess.run([sys.executable, str(bench), "mlp", "--quick", "--device", "cpu"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("mlp ")]
    assert len(rows) == 3 and all(" yes " in line for line in rows), done.stdout
    if not torch.cuda.is_available():
        gpu = subprocess.run([sys.executable, str(bench)], capture_output=True, text=True,
                             timeout=60)
        assert gpu.returncode == 0 and "no CUDA GPU" in gpu.stdout, gpu.stdout + gpu.stderr
