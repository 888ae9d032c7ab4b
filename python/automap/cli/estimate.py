"""automap estimate: the memory of one training step on a single device,
estimated symbolically (nothing real is allocated)."""

from __future__ import annotations

import argparse
from typing import Any

from automap.cli.arguments import positive_int, report, writable_file
from automap.cli.factory import load_factory
from automap.errors import AutomapError
from automap.trace.optimizer_names import OPTIMIZER_NAMES

__all__ = ["load_factory", "register", "run"]

DESCRIPTION = """\
Estimate the per-device memory of one training step, symbolically.

TARGET names a Python file and a factory function in it, e.g. model.py:build.
The factory, called as build(batch_size) (or build() without --batch),
returns (model, example_inputs) or (model, example_inputs, loss_fn):
example_inputs is a tensor, a tuple of positional arguments or a dict of
keyword arguments; loss_fn maps the model's output to the scalar loss
(default: the model's own loss, e.g. a Hugging Face model given labels).
Build the model under torch.device("meta") and make the inputs meta tensors
to need no memory at all.

example: automap estimate model.py:build --batch 8 --optimizer adamw --table
"""


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the estimate subcommand to an argparse subparsers object."""
    parser = subparsers.add_parser(
        "estimate",
        help="estimate the per-device memory of a training step, without allocating",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", help="<python-file>:<factory>")
    parser.add_argument("--batch", type=positive_int, default=None,
                        help="batch size for the factory")
    parser.add_argument(
        "--optimizer", default="adamw", choices=[*OPTIMIZER_NAMES, "none"], help="default: adamw"
    )
    parser.add_argument(
        "--device", type=_device, default=None,
        help="device type to estimate for: cpu or cuda (default: cuda if present)"
    )
    parser.add_argument(
        "--attn-implementation", default=None, choices=["sdpa", "eager"],
        help="Hugging Face models: sdpa or eager"
    )
    parser.add_argument("--table", action="store_true", help="also print the per-node table")
    parser.add_argument("--json", metavar="PATH", type=writable_file,
                        help="write the full profile as JSON")
    parser.set_defaults(run=run)
    return parser


def _device(text: str) -> str:
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"not a device to estimate for: {text!r} (cpu, cuda, "
                                         f"cuda:1)")
    return str(device)


def run(args: argparse.Namespace) -> int:
    from automap.trace.profiling import profile

    try:
        factory = load_factory(args.target)
        built = factory(args.batch) if args.batch is not None else factory()
        if not isinstance(built, tuple) or len(built) not in (2, 3):
            raise AutomapError(
                f"{args.target} must return (model, example_inputs) or "
                f"(model, example_inputs, loss_fn), got {type(built).__name__}"
            )
        model, example_inputs, loss_fn = (*built, None) if len(built) == 2 else built
        result = profile(
            model,
            example_inputs,
            None if args.optimizer == "none" else args.optimizer,
            loss_fn=loss_fn,
            device=args.device,
            attn_implementation=args.attn_implementation,
        )
    except AutomapError as exc:
        return report("estimate", exc)
    batch = f", batch {args.batch}" if args.batch is not None else ""
    print(f"{result.traced.model_type} on one {result.device} device{batch}")
    print(result.memory_breakdown())
    if str(result.device).startswith("cuda"):
        _print_library_workspaces(result.peak_memory_bytes)
    if args.table:
        print()
        print(result.table())
    if args.json:
        result.to_json(args.json)
        print(f"profile written to {args.json}")
    return 0


def _print_library_workspaces(peak_bytes: float) -> None:
    """What cuBLAS and cuBLASLt keep allocated beside the step's tensors on
    this GPU (``automap.cluster.workspace``, measured), and the peak with them."""
    from automap.cluster.workspace import library_workspace_bytes
    from automap.trace.profiling import format_bytes

    held = library_workspace_bytes("cuda")
    print(f"{'cuBLAS/cuBLASLt workspaces':<34}{format_bytes(held):>12}")
    print(f"{'peak with them':<34}{format_bytes(peak_bytes + held):>12}")
