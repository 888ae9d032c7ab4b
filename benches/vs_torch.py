"""automap against what a user would pick instead (issue 14, item 6).

One GPT-2-style model (transformers' GPT2LMHeadModel, dropout 0; default: 4 layers,
width 256, vocab 2048, sequence 256, global batch 16) trained with AdamW on 4 gloo
ranks, in one run, under:

- DDP: ``DistributedDataParallel``, each rank on its quarter of the batch;
- FSDP2: ``fully_shard`` on every transformer block and on the root;
- automap: ``autoparallelize`` with default options (the device's speeds measured on
  every rank at first use) on the global batch;
- automap within a budget DDP cannot meet (``--budget-fraction`` of DDP's measured
  peak per rank);
- both again on the same mesh with its links measured between idle ranks
  (``automap.cluster.detect.measure_mesh`` without load) instead of as
  ``autoparallelize`` measures them for a mesh shape (each all-reduce's latency
  after ``TRAINING_LOAD_FLOPS`` of compute on every rank, waiting for the
  slowest); item 6 is checked on the default-options runs, these are printed
  beside them;
- ``automap_dp``, a reference: the default options with every parameter whole.

Each runner is built and its memory measured in turn, then all are timed together:
``--steps`` rounds of one step of each (rotated order, every step started on every
rank at once), so that the machine's other load meets every runner alike. A step
(forward, backward, optimizer step, after ``--warmup`` steps) lasts until its
slowest rank is done. Per runner: the median step; against DDP and FSDP2 the median
of the per-round ratios (each pair of steps ran within one round, so load that
drifts over the run cancels; the ratios' range is printed) and the same for the
CPU work of a step (every rank's CPU seconds summed, gloo's threads included:
what the step costs whatever else shares the cores); the peak of live
tensor bytes per rank during one step (``trust_workers.measure_training``: what is
live between steps plus the CPU allocator's running total from the profiler's memory
events); for automap its plan's predicted step time and peak. Printed as one table
with automap's ratios to DDP and FSDP2 (plan: its kind, ``Nfs`` the parameter
reads gathered from their shard by ``gather_shard``, i.e. sharded data
parallelism, ``+Nck`` checkpoint blocks), and written as JSON (``--out``, else a
temporary folder).

    python benches/vs_torch.py
    python benches/vs_torch.py --steps 3 --out /tmp/vs.json

Exit status 1 when automap is slower than DDP or FSDP2 (median per-round ratio
above 1), or its peak is above DDP's
(without a budget), above FSDP2's when the budget forces a sharded plan, or above
its budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from automap.launch import run_on_gloo  # noqa: E402
from vs_torch_workers import RUNNERS, Setup, compare  # noqa: E402

MIB = 2**20


def paired_ratio(rounds: list[float], reference: list[float]) -> dict | None:
    """``rounds`` against ``reference`` round by round (each pair ran back to back, so
    what else loads the machine meets both alike): the median ratio and the range."""
    ratios = [a / b for a, b in zip(rounds, reference) if b > 0]
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "low": min(ratios), "high": max(ratios),
            "rounds": len(ratios)}


def summarise(per_rank: list[dict[str, dict]]) -> dict[str, dict]:
    """Per runner: the median step (per round the slowest rank's wall time), every
    rank's peak, automap's plan, and the paired ratios of step time and of CPU work to
    DDP's and FSDP2's (``vs``)."""
    rows = {}
    for name in per_rank[0]:
        records = [r[name] for r in per_rank]
        rounds = records[0].get("round_step_s") or []
        row = {"step_s": statistics.median(rounds) if rounds else None,
               "round_step_s": rounds, "round_cpu_s": records[0].get("round_cpu_s") or [],
               "peak_bytes_per_rank": [r["peak_bytes"] for r in records],
               "peak_bytes": max(r["peak_bytes"] for r in records),
               "live_before_bytes": max(r["live_before_bytes"] for r in records),
               # DDP's and FSDP2's ranks each have their share's mean: of as many
               # tokens, so their mean is the global batch's (automap's, on every rank).
               "loss": sum(r["loss"] for r in records) / len(records)}
        for key in ("setup_s", "plan_kind", "predicted_step_s", "predicted_peak_bytes",
                    "budget_bytes", "memory_binding", "checkpoint_blocks", "device",
                    "links", "local_parameter_bytes", "fsdp_gathers"):
            if key in records[0]:
                row[key] = records[0][key]
        rows[name] = row
    for row in rows.values():
        row["vs"] = {ref: {"step": paired_ratio(row["round_step_s"], rows[ref]["round_step_s"]),
                           "cpu": paired_ratio(row["round_cpu_s"], rows[ref]["round_cpu_s"])}
                     for ref in ("ddp", "fsdp2") if ref in rows}
    return rows


def verdicts(rows: dict[str, dict], names=("automap", "automap_budget")) -> list[str]:
    """What item 6 asks of each automap row of ``names``, as failure messages (none:
    it holds)."""
    failures = []
    ddp, fsdp = rows.get("ddp"), rows.get("fsdp2")
    for name in names:
        row = rows.get(name)
        if row is None:
            continue
        for other, key in (("DDP", "ddp"), ("FSDP2", "fsdp2")):
            ratio = row["vs"].get(key, {}).get("step")
            if ratio is not None and ratio["median"] > 1.0:
                failures.append(f"{name}: step {ratio['median']:.3f}x {other}'s (median of "
                                f"{ratio['rounds']} rounds, each side by side)")
        # DDP's memory when the plan is data parallel; within a budget DDP cannot
        # meet, FSDP2's when the plan shards (a replicated-parameter plan within
        # one still must stay below DDP). Without a budget, a fully replicated
        # plan (the fastest where links are slow next to the work) has no bound.
        budgeted = row.get("budget_bytes") is not None
        forced = budgeted and row["plan_kind"] == "sharded"
        other, ref = ("FSDP2", fsdp) if forced else ("DDP", ddp)
        if not budgeted and row["plan_kind"] != "data parallel":
            ref = None
        if ref is not None and row["peak_bytes"] > ref["peak_bytes"]:
            failures.append(f"{name}: {row['plan_kind']} plan's peak "
                            f"{row['peak_bytes'] / MIB:.1f} MiB > {other}'s "
                            f"{ref['peak_bytes'] / MIB:.1f} MiB")
        budget = row.get("budget_bytes")
        if budget is not None and row["peak_bytes"] > budget:
            failures.append(f"{name}: peak {row['peak_bytes'] / MIB:.1f} MiB > its budget "
                            f"{budget / MIB:.1f} MiB")
    return failures


def table(rows: dict[str, dict]) -> str:
    ddp, fsdp = rows.get("ddp"), rows.get("fsdp2")
    head = (f"{'runner':<21}{'loss':>8}{'step s':>8}{'peak MiB/rank':>26}{'pred s':>8}"
            f"{'pred MiB':>9}"
            f"{'plan':>19}{'/DDP s':>8}{'/DDP mem':>9}{'/FSDP2 s':>9}{'/FSDP2 mem':>11}")
    lines = [head, "-" * len(head)]
    for name, row in rows.items():
        peaks = " ".join(f"{p / MIB:.1f}" for p in row["peak_bytes_per_rank"])
        step = f"{row['step_s']:.3f}" if row["step_s"] is not None else "-"
        cells = f"{name:<21}{row['loss']:>8.4f}{step:>8}{peaks:>26}"
        if "predicted_step_s" in row:
            kind = row["plan_kind"] + (f" {row['fsdp_gathers']}fs" if row.get("fsdp_gathers")
                                       else "") + (f"+{row['checkpoint_blocks']}ck"
                                                   if row["checkpoint_blocks"] else "")
            cells += (f"{row['predicted_step_s']:>8.3f}{row['predicted_peak_bytes'] / MIB:>9.1f}"
                      f"{kind:>19}")
            for key, ref in (("ddp", ddp), ("fsdp2", fsdp)):
                if ref is None:
                    cells += f"{'':>17}"
                    continue
                paired = row["vs"][key]["step"]
                ratio = f"{paired['median']:.2f}" if paired else "-"
                cells += f"{ratio:>8}{row['peak_bytes'] / ref['peak_bytes']:>9.2f}"
        lines.append(cells)
    for name, row in rows.items():
        for key, label in (("ddp", "DDP"), ("fsdp2", "FSDP2")):
            paired = row["vs"].get(key) if name not in ("ddp", "fsdp2") else None
            if paired and paired["step"]:
                step, cpu = paired["step"], paired["cpu"]
                lines.append(f"{name} / {label}: step {step['median']:.3f}x "
                             f"({step['low']:.2f}-{step['high']:.2f} over {step['rounds']} "
                             f"rounds), CPU work {cpu['median']:.3f}x "
                             f"({cpu['low']:.2f}-{cpu['high']:.2f})")
        if row.get("budget_bytes") is not None:
            lines.append(f"{name}: budget {row['budget_bytes'] / MIB:.1f} MiB per rank "
                         f"(binding: {row['memory_binding']})")
        if "device" in row:
            links = row["links"]
            lines.append(f"{name}: planned with {row['device']}, links "
                         f"{links['alpha_s'][0] * 1e6:.0f} us, "
                         f"{links['bandwidth_bytes_per_s'][0] / 1e9:.2f} GB/s; "
                         f"setup {row['setup_s']:.1f} s")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=Setup.timed_steps,
                        help="timed steps per runner (median reported)")
    parser.add_argument("--warmup", type=int, default=Setup.warmup_steps)
    parser.add_argument("--budget-fraction", type=float, default=Setup.budget_fraction)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--runners", nargs="+", default=list(RUNNERS), choices=RUNNERS)
    parser.add_argument("--out", type=Path, default=None, help="JSON output path")
    args = parser.parse_args(argv)
    if any(n.endswith("_budget") for n in args.runners) and "ddp" not in args.runners:
        parser.error("automap_budget needs ddp (its budget is a fraction of DDP's peak)")
    setup = Setup(timed_steps=args.steps, warmup_steps=args.warmup,
                  budget_fraction=args.budget_fraction)
    start = time.perf_counter()
    per_rank = run_on_gloo(compare, args.world, setup, tuple(args.runners), timeout_s=1500)
    rows = summarise(per_rank)
    print(f"{args.world} gloo ranks, {dataclasses.asdict(setup)}; "
          f"{time.perf_counter() - start:.0f} s in all")
    print(table(rows))
    failures = verdicts(rows)
    print("\n".join(failures) if failures else "item 6 holds in this run")
    measured = verdicts(rows, ("automap_links", "automap_links_budget"))
    if any(n in rows for n in ("automap_links", "automap_links_budget")):
        print("with measured links: " + ("; ".join(measured) if measured else "item 6 holds"))
    out = args.out or Path(tempfile.mkdtemp(prefix="vs_torch_")) / "vs_torch.json"
    os.makedirs(out.parent, exist_ok=True)
    out.write_text(json.dumps({"setup": dataclasses.asdict(setup), "world": args.world,
                               "runners": rows, "failures": failures,
                               "failures_with_measured_links": measured}, indent=2))
    print(f"written {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
