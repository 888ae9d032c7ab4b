"""automap detect: measure the cluster (links, and each device's FLOP/s,
memory bandwidth and kernel overhead, every rank at once) and write its JSON.

Under torchrun every rank runs the command (NCCL on GPUs, gloo otherwise)
and rank 0 writes the file; --local N instead spawns N gloo ranks on this
machine. The file is automap.Cluster's JSON (see automap.cluster.cluster)."""

from __future__ import annotations

import os
import sys

from automap.cli.arguments import count, parse_bytes, positive_float, positive_int, writable_file


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "detect",
        help="measure the links between ranks and each device's speeds; write the cluster JSON",
        description=__doc__,
    )
    p.add_argument("-o", "--output", required=True, type=writable_file,
                   help="where to write the cluster JSON")
    p.add_argument("--local", type=positive_int, metavar="N",
                   help="spawn N gloo ranks on this machine instead of running under torchrun")
    p.add_argument("--sizes", type=_sizes, metavar="BYTES,...",
                   help="message sizes, e.g. 8,4K,1M,4M (default: by backend)")
    p.add_argument("--iters", type=positive_int, default=5, help="timed repetitions per size")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="runs of the pair measurements; each pair takes the median, and tiers "
                        "split only where bandwidths differ beyond the runs' spread")
    p.add_argument("--measure-groups", type=count, default=3, metavar="K",
                   help="measure the axes of the best K candidate meshes by group all-reduce")
    p.add_argument("--no-profile", action="store_true",
                   help="skip the device profile (FLOP/s, memory bandwidth, kernel overhead)")
    p.add_argument("--timeout", type=positive_float, default=600.0, metavar="SECONDS",
                   help="give up after this long (default 600)")
    p.set_defaults(run=_run)


def _sizes(text: str) -> tuple[int, ...]:
    """Comma-separated byte sizes, e.g. 8,4K,1M (K, M, G are binary)."""
    return tuple(parse_bytes(item) for item in text.split(","))


def _options(args) -> dict:
    return {
        "sizes_bytes": args.sizes,
        "iters": args.iters,
        "repeats": args.repeats,
        "measure_groups": args.measure_groups,
        "measure_profile": not args.no_profile,
        "quiet": getattr(args, "quiet", False),  # -q: automap.cli.main adds it
    }


def _local_rank_main(rank: int, world_size: int, options: dict) -> dict | None:
    from automap.cluster.detect import detect_cluster
    from automap.progress import console

    with console(enabled=not options["quiet"]):  # a spawned rank: shows its own progress
        cluster = detect_cluster(**options)
    return cluster.to_dict() if rank == 0 else None


def _run(args) -> int:
    from automap.cluster.cluster import Cluster

    if args.local is not None:
        from automap.launch import run_on_gloo

        data = run_on_gloo(_local_rank_main, args.local, _options(args), timeout_s=args.timeout)[0]
        cluster = Cluster.from_dict(data)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        cluster = _detect_under_torchrun(args)
        if cluster is None:
            return 0
    else:
        print("automap detect: run under torchrun, or pass --local N to measure N local "
              "gloo ranks", file=sys.stderr)
        return 2
    cluster.to_json(args.output)
    print(cluster.summary())
    print(f"wrote {args.output} ({cluster.measurement.get('wall_s', 0.0):.1f} s of measurement)")
    return 0


def _detect_under_torchrun(args):
    """Run the detector on this torchrun rank; the cluster on rank 0, else None."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from automap.cluster.detect import detect_cluster

    started_here = not dist.is_initialized()
    if started_here:
        on_gpu = torch.cuda.is_available()
        if on_gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if on_gpu else "gloo",
                                timeout=timedelta(seconds=args.timeout))
    try:
        cluster = detect_cluster(**_options(args))
        return cluster if dist.get_rank() == 0 else None
    finally:
        if started_here:
            dist.destroy_process_group()
