"""The `automap` command line: ``demo`` (plan and train a tiny GPT-2 on 4 gloo
ranks), ``plan``/``explain``, ``estimate`` and ``detect``, one module each.
Receives arguments; calls the public API and prints or writes its results."""


from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="automap", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="plan and train a tiny GPT-2 on 4 local gloo ranks "
                          "(a 2x2 mesh), next to the serial model")
    demo.set_defaults(run=lambda args: _demo())
    from automap.cli import detect as detect_cli
    from automap.cli import estimate as estimate_cli
    from automap.cli import plan as plan_cli

    estimate_cli.register(sub)
    plan_cli.register(sub)
    detect_cli.register(sub)
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


def _demo() -> int:
    from automap.cli.demo import run_training_demo

    return run_training_demo()


if __name__ == "__main__":
    sys.exit(main())
