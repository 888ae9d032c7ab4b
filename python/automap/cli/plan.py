"""`automap plan` and `automap explain`."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from automap.cli.estimate import load_factory
from automap.errors import AutomapError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'16GiB', '500MB', '1e9' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 16GiB, 500MB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_mesh_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(s < 1 for s in shape):
        raise argparse.ArgumentTypeError(f"not a mesh shape: {text!r} (e.g. 8, 2x4, 2x2x2)")
    return shape


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("plan", help="search a sharding plan for a model and a mesh")
    p.add_argument("target", help="<python-file>:<factory> returning (model, example_inputs"
                   "[, loss_fn]); build the model on torch.device('meta')")
    p.add_argument("--batch", type=int, default=None, help="batch size for the factory")
    p.add_argument("--mesh", type=parse_mesh_shape, required=True, help="e.g. 8, 2x4")
    p.add_argument("--memory", type=parse_bytes, default=None,
                   help="memory budget per device, e.g. 16GiB (default: unlimited)")
    p.add_argument("--alpha-s", type=_floats, default=None,
                   help="link latency per mesh axis in seconds, comma-separated")
    p.add_argument("--bandwidth", type=_floats, default=None,
                   help="link bandwidth per mesh axis in bytes/s, comma-separated")
    p.add_argument("--flops", type=float, default=None,
                   help="sustained FLOP/s per device (default: measured on this machine)")
    p.add_argument("--memory-bandwidth", type=float, default=None,
                   help="memory bandwidth per device in bytes/s (default: measured)")
    p.add_argument("--op-overhead", type=float, default=None,
                   help="fixed seconds per kernel launch (default: measured)")
    p.add_argument("--optimizer", default="adamw", choices=["sgd", "sgd_momentum", "adam",
                                                            "adamw"])
    p.add_argument("--time-limit", type=float, default=60.0, help="solver limit, seconds")
    p.add_argument("--checkpointing", default="auto", choices=["auto", "off", "only"],
                   help="within --memory: two-stage search with activation checkpointing "
                        "(auto), sharding alone (off), or checkpointing of the fastest "
                        "sharding (only)")
    p.add_argument("-o", "--output", default=None, help="write the plan JSON here")
    p.set_defaults(run=_plan)
    e = subparsers.add_parser("explain", help="explain a plan JSON")
    e.add_argument("plan", help="plan.json written by automap plan")
    e.add_argument("--rows", type=int, default=60, help="nodes to list")
    e.set_defaults(run=_explain)


def _plan(args: argparse.Namespace) -> int:
    from automap.planner.search import plan
    from automap.sharding.mesh import DeviceMesh

    try:
        factory = load_factory(args.target)
        built = factory(args.batch) if args.batch is not None else factory()
        if not isinstance(built, tuple) or len(built) not in (2, 3):
            raise AutomapError(f"{args.target} must return (model, example_inputs) or "
                               f"(model, example_inputs, loss_fn)")
        model, inputs, loss_fn = (*built, None) if len(built) == 2 else built
        mesh = DeviceMesh(args.mesh, alpha_s=args.alpha_s,
                          bandwidth_bytes_per_s=args.bandwidth)
        result = plan(model, inputs, mesh, args.memory, loss_fn=loss_fn,
                      optimizer=args.optimizer, flops_per_s=args.flops,
                      memory_bandwidth_bytes_per_s=args.memory_bandwidth,
                      op_overhead_s=args.op_overhead,
                      time_limit_s=args.time_limit, checkpointing=args.checkpointing,
                      verbose=True)
    except AutomapError as exc:
        print(f"automap plan: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(result.explain(max_rows=20))
    if args.output:
        result.to_json(args.output)
        print(f"\nplan written to {args.output}")
    return 0


def _explain(args: argparse.Namespace) -> int:
    from automap.planner.plan import Plan

    try:
        print(Plan.from_json(args.plan).explain(max_rows=args.rows))
    except (AutomapError, OSError) as exc:
        print(f"automap explain: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0
