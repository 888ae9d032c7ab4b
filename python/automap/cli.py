"""The `automap` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="automap", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="plan and train a tiny GPT-2 on 4 local gloo ranks "
                          "(a 2x2 mesh), next to the serial model")
    demo.set_defaults(run=lambda args: _demo())
    from automap import detect_cli, estimate_cli, plan_cli

    estimate_cli.register(sub)
    plan_cli.register(sub)
    detect_cli.register(sub)
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


def _demo() -> int:
    from automap.demo import run_training_demo

    return run_training_demo()


if __name__ == "__main__":
    sys.exit(main())
