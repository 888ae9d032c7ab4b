"""``automap estimate``: the memory of one training step on a single device, estimated
symbolically (nothing real is allocated).

Usage::

    automap estimate model.py:build --batch 8 [--optimizer adamw] [--device cuda]
                     [--attn-implementation sdpa] [--table] [--json OUT.json]

``model.py:build`` names a Python file and a factory function in it. The factory
contract: ``build(batch_size)`` (or ``build()`` when ``--batch`` is not given) returns
``(model, example_inputs)`` or ``(model, example_inputs, loss_fn)``, where
``example_inputs`` is a tensor, a tuple of positional arguments or a dict of keyword
arguments, and ``loss_fn`` maps the model's output to the scalar loss (default: the
model's own loss, e.g. a Hugging Face model given ``labels``). Build the model under
``torch.device("meta")`` and make the inputs meta tensors to need no memory at all.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from pathlib import Path
from typing import Any

from automap.errors import AutomapError
from automap.trace.profiling import OPTIMIZERS, profile


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``estimate`` subcommand to an argparse subparsers object."""
    parser = subparsers.add_parser(
        "estimate",
        help="estimate the per-device memory of a training step, without allocating",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", help="<python-file>:<factory>")
    parser.add_argument("--batch", type=int, default=None, help="batch size for the factory")
    parser.add_argument(
        "--optimizer", default="adamw", choices=[*OPTIMIZERS, "none"], help="default: adamw"
    )
    parser.add_argument(
        "--device", default=None, help="device type to estimate for (default: cuda if present)"
    )
    parser.add_argument(
        "--attn-implementation", default=None, help="Hugging Face models: 'sdpa' or 'eager'"
    )
    parser.add_argument("--table", action="store_true", help="also print the per-node table")
    parser.add_argument("--json", metavar="PATH", help="write the full profile as JSON")
    parser.set_defaults(run=run)
    return parser


def load_factory(target: str) -> Any:
    """The factory function named by ``<python-file>:<factory>``."""
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name:
        raise AutomapError(f"expected <python-file>:<factory>, got {target!r}")
    file = Path(path)
    if not file.is_file():
        raise AutomapError(f"no such file: {file}")
    spec = importlib.util.spec_from_file_location(f"_automap_estimate_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(file.parent.resolve()))  # let the file import its neighbours
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise AutomapError(f"{file} has no function {name!r}")
    return factory


def run(args: argparse.Namespace) -> int:
    # Tracing and profiling a large model take seconds: show each stage on stderr.
    progress = logging.StreamHandler(sys.stderr)
    progress.setFormatter(logging.Formatter("automap: %(message)s"))
    package_log = logging.getLogger("automap")
    level = package_log.level
    package_log.addHandler(progress)
    package_log.setLevel(logging.INFO)
    try:
        return _estimate(args)
    finally:
        package_log.removeHandler(progress)
        package_log.setLevel(level)


def _estimate(args: argparse.Namespace) -> int:
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
        print(f"automap estimate: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    batch = f", batch {args.batch}" if args.batch is not None else ""
    print(f"{result.traced.model_type} on one {result.device} device{batch}")
    print(result.memory_breakdown())
    if args.table:
        print()
        print(result.table())
    if args.json:
        result.to_json(args.json)
        print(f"profile written to {args.json}")
    return 0
