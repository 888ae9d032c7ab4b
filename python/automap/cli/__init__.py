"""The automap command line: demo (plan and train a tiny GPT-2 on 4 gloo ranks),
plan and explain, estimate and detect, one module each. Receives arguments,
calls the public API and prints or writes its results; an AutomapError or a
file error ends the command with its message and exit status 1, not a
traceback. Nothing here imports torch before a subcommand runs, so --help and
--version answer at once. Progress goes to stderr (automap.progress: bars on a
terminal, one line per stage otherwise; -q silences it); stdout holds results."""


from __future__ import annotations

import argparse
import sys

from automap.cli.arguments import report
from automap.errors import AutomapError
from automap.progress import console
from automap.version import __version__

DESCRIPTION = """\
automatic intra-op parallelism and activation checkpointing for PyTorch
training: plan a model's sharding on a device mesh within a memory budget,
explain a saved plan, estimate a step's memory, measure a cluster, or run the
demo."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="automap", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"automap {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help=QUIET_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser("demo", help="plan and train a tiny GPT-2 on 4 local gloo ranks "
                          "(a 2x2 mesh), next to the serial model",
                          description="Plan a tiny GPT-2 on a 2x2 mesh of 4 gloo processes "
                          "on this machine, train it 20 steps with the generated parallel "
                          "module and print each loss next to the serial model's.")
    demo.set_defaults(run=lambda args: _demo(args.quiet))
    from automap.cli import detect as detect_cli
    from automap.cli import estimate as estimate_cli
    from automap.cli import plan as plan_cli

    plan_cli.register(sub)
    estimate_cli.register(sub)
    detect_cli.register(sub)
    for command in sub.choices.values():
        # After the command too (automap plan ... -q); absent there, the global one holds.
        command.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                             help=QUIET_HELP)
    args = parser.parse_args(argv)
    try:
        with console(enabled=not args.quiet):
            return int(args.run(args) or 0)
    except (AutomapError, OSError) as exc:
        return report(args.command, exc)


QUIET_HELP = "no progress on stderr (results and errors still print)"


def _demo(quiet: bool) -> int:
    from automap.cli.demo import run_training_demo

    return run_training_demo(quiet=quiet)


if __name__ == "__main__":
    sys.exit(main())
