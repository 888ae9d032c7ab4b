"""automap plan and automap explain."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from automap.cli.arguments import (
    floats,
    parse_bytes,
    parse_mesh_shape,
    positive_float,
    positive_int,
    readable_file,
    report,
    writable_file,
)
from automap.cli.factory import load_factory
from automap.errors import AutomapError
from automap.trace.optimizer_names import OPTIMIZER_IMPLS, OPTIMIZER_NAMES


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan", help="search a sharding plan for a model and a mesh",
        description="Search the intra-op sharding plan (and, within --memory, the activation "
                    "checkpoints) of a model on a device mesh; print it and optionally write "
                    "its JSON.")
    p.add_argument("target", help="<python-file>:<factory> returning (model, example_inputs"
                   "[, loss_fn]); build the model on torch.device('meta')")
    p.add_argument("--batch", type=positive_int, default=None, help="batch size for the factory")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--mesh", type=parse_mesh_shape, help="e.g. 8, 2x4")
    where.add_argument("--cluster", type=readable_file, metavar="CLUSTER_JSON",
                       help="a cluster file (automap detect -o, or written by hand): its "
                            "measured links, device speeds and memory workspaces; its best "
                            "few meshes are tried")
    p.add_argument("--memory", type=parse_bytes, default=None,
                   help="memory budget per device, e.g. 16GiB, 16G (= 16 GiB), 500MB "
                        "(default: unlimited)")
    p.add_argument("--alpha-s", type=floats, default=None,
                   help="link latency per mesh axis in seconds, comma-separated")
    p.add_argument("--bandwidth", type=floats, default=None,
                   help="link bandwidth per mesh axis in bytes/s, comma-separated")
    p.add_argument("--backend", default=None,
                   help="the torch.distributed backend training will use (e.g. gloo, nccl): "
                        "collectives are priced as it runs them (default: as NCCL does)")
    p.add_argument("--flops", type=positive_float, default=None,
                   help="sustained FLOP/s per device (default: measured on this machine)")
    p.add_argument("--memory-bandwidth", type=positive_float, default=None,
                   help="memory bandwidth per device in bytes/s (default: measured)")
    p.add_argument("--op-overhead", type=positive_float, default=None,
                   help="fixed seconds per kernel launch (default: measured)")
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZER_NAMES)
    p.add_argument("--optimizer-impl", default="auto", choices=OPTIMIZER_IMPLS,
                   help="the kernels the optimizer steps with, which size its temporaries "
                        "(default auto: foreach on GPUs, for-loop on CPUs, as torch picks)")
    p.add_argument("--time-limit", type=positive_float, default=60.0,
                   help="solver limit, seconds")
    p.add_argument("--checkpointing", default="auto", choices=["auto", "off", "only"],
                   help="within --memory: two-stage search with activation checkpointing "
                        "(auto), sharding alone (off), or checkpointing of the fastest "
                        "sharding (only)")
    p.add_argument("-o", "--output", type=writable_file, default=None,
                   help="write the plan JSON here (checked before planning)")
    p.set_defaults(run=_plan)
    e = subparsers.add_parser("explain", help="explain a plan JSON",
                              description="Print a saved plan: per node the chosen specs, "
                                          "costs and alternatives, the layout conversions and "
                                          "the checkpoint blocks.")
    e.add_argument("plan", help="plan.json written by automap plan")
    e.add_argument("--rows", type=positive_int, default=60, help="nodes to list")
    e.add_argument("--plot", metavar="DIR", default=None,
                   help="also draw DIR/plan.png (the graph coloured by sharding, conversions, "
                        "checkpoint blocks) and DIR/memory.png (predicted memory per rank "
                        "over the step); needs matplotlib: pip install automap[plot]")
    e.set_defaults(run=_explain)


def _plan(args: argparse.Namespace) -> int:
    from automap.cluster.cluster import Cluster
    from automap.planner.search import plan
    from automap.sharding.mesh import DeviceMesh

    if args.cluster is not None:
        given = [flag for flag, value in (("--alpha-s", args.alpha_s),
                                          ("--bandwidth", args.bandwidth),
                                          ("--backend", args.backend)) if value is not None]
        if given:
            # The cluster's links and device kind say these; two sources would conflict.
            print(f"automap plan: error: {', '.join(given)} describe a --mesh; the cluster "
                  "file has its own links and backend", file=sys.stderr)
            return 2
    try:
        factory = load_factory(args.target)
        built = factory(args.batch) if args.batch is not None else factory()
        if not isinstance(built, tuple) or len(built) not in (2, 3):
            raise AutomapError(f"{args.target} must return (model, example_inputs) or "
                               f"(model, example_inputs, loss_fn)")
        model, inputs, loss_fn = (*built, None) if len(built) == 2 else built
        mesh = Cluster.from_json(args.cluster) if args.cluster is not None else DeviceMesh(
            args.mesh, alpha_s=args.alpha_s, bandwidth_bytes_per_s=args.bandwidth,
            backend=args.backend)
        result = plan(model, inputs, mesh, args.memory, loss_fn=loss_fn,
                      optimizer=args.optimizer, optimizer_impl=args.optimizer_impl,
                      flops_per_s=args.flops,
                      memory_bandwidth_bytes_per_s=args.memory_bandwidth,
                      op_overhead_s=args.op_overhead,
                      time_limit_s=args.time_limit, checkpointing=args.checkpointing)
        print(result.explain(max_rows=20))
        if args.output:
            result.to_json(args.output)
            print(f"\nplan written to {args.output}")
    except (AutomapError, OSError) as exc:
        return report("plan", exc)
    return 0


def _explain(args: argparse.Namespace) -> int:
    from automap.planner.plan import Plan

    try:
        plan = Plan.from_json(args.plan)
        print(plan.explain(max_rows=args.rows))
        if args.plot is not None:
            _plot(plan, args.plot)
    except (AutomapError, OSError) as exc:
        return report("explain", exc)
    return 0


def _plot(plan, directory: str) -> None:
    """plan.png and, where the plan carries its simulated memory timeline, memory.png."""
    import os

    os.makedirs(directory, exist_ok=True)
    print(f"\npicture of the plan written to {plan.plot(os.path.join(directory, 'plan.png'))}")
    if plan.memory_timeline is None:
        print("memory.png not written: this plan has no simulated memory timeline (it was "
              "planned without verify, with reduce_depth, or by an older automap)")
        return
    written = plan.plot_memory(os.path.join(directory, "memory.png"))
    print(f"picture of its memory over the step written to {written}")
