"""Argument types shared by the subcommands (byte sizes, positive numbers, mesh
shapes, output paths) and the one way a command reports a failure. Each type
raises argparse.ArgumentTypeError, so a bad value ends in a usage message
naming it, never a traceback. No torch here: --help stays fast."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

#: Byte units: K/M/G/T alone are binary (as in Slurm and Docker: 16G is
#: 16 GiB), KiB... are binary, KB... are decimal; B or nothing is bytes.
_UNITS = {"": 1, "b": 1,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}

_BYTES_HELP = "e.g. 16GiB, 16G (= 16 GiB), 1.5TiB, 500MB, 1e9"


def parse_bytes(text: str) -> int:
    """'16GiB', '16G', '1.5 TiB', '500MB', '1e9' -> bytes (a positive finite number)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} ({_BYTES_HELP})")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(value) or value < 1 or value >= 2**63:
        raise argparse.ArgumentTypeError(
            f"byte size {text!r} is {value:g} bytes; it must be at least 1 byte and below "
            f"2^63 ({_BYTES_HELP})")
    return int(value)


def positive_float(text: str) -> float:
    """A finite number > 0 (FLOP/s, seconds, bandwidths)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"not a finite number > 0: {text!r}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def count(text: str) -> int:
    return _int_at_least(text, 0)


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"not an integer >= {least}: {text!r}")
    return value


def floats(text: str) -> list[float]:
    """Comma-separated finite numbers >= 0 (one per mesh axis)."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        values = [math.nan]
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of finite numbers >= 0: {text!r} (e.g. 1e-5,5e-6)")
    return values


def parse_mesh_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(s < 1 for s in shape):
        raise argparse.ArgumentTypeError(f"not a mesh shape: {text!r} (e.g. 8, 2x4, 2x2x2)")
    return shape


def readable_file(text: str) -> str:
    """A path to an existing file (checked before any work)."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no file {text!r}")
    return text


def writable_file(text: str) -> str:
    """A path a file can be written to: checked before the work that fills it."""
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file name")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: no folder {folder!r}")
    if not os.access(folder, os.W_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: permission denied")
    return text


def report(command: str, exc: BaseException) -> int:
    """Print a failure as one line on stderr; the exit status."""
    print(f"automap {command}: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 1
