"""The command line answers bad input with a message, never a traceback: byte
sizes with or without "iB" and with decimals, output paths checked before any
planning, unknown devices, truncated plan files; --help and --version answer
without importing torch, and help texts carry no reST markup."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from automap.cli import main
from automap.cli.arguments import parse_bytes
from cli_factories import mlp_factory

COMMANDS = ("demo", "plan", "explain", "estimate", "detect")


@pytest.mark.parametrize("text, expected", [
    ("16G", 16 * 2**30), ("16GiB", 16 * 2**30), ("16 gib", 16 * 2**30), ("16GB", 16 * 10**9),
    ("1.5TiB", int(1.5 * 2**40)), ("1.5T", int(1.5 * 2**40)), ("500MB", 500 * 10**6),
    ("500M", 500 * 2**20), ("64K", 65536), ("1e9", 10**9), ("4096", 4096), ("2.5KiB", 2560),
])
def test_byte_sizes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["1e999GiB", "abc", "-5G", "0", "nan", "inf", "16Q", "1e30TiB",
                                  "G"])
def test_bad_byte_sizes_are_usage_errors(text):
    with pytest.raises(argparse.ArgumentTypeError, match=r"byte size|not a byte"):
        parse_bytes(text)


def _run(*args: str, code: str = "") -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter; afterwards it prints whether torch was imported."""
    script = ("import sys\nfrom automap.cli import main\n" + code +
              "try:\n    status = main(sys.argv[1:])\nexcept SystemExit as e:\n"
              "    status = e.code\nprint('torch imported:', 'torch' in sys.modules)\n"
              "sys.exit(status)\n")
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("args", [["--help"], ["--version"], *[[c, "--help"] for c in COMMANDS]])
def test_help_and_version_do_not_import_torch(args):
    done = _run(*args)
    assert done.returncode == 0, done.stderr
    assert "torch imported: False" in done.stdout
    assert "``" not in done.stdout and ":func:" not in done.stdout
    if args == ["--version"]:
        from automap.version import __version__

        assert f"automap {__version__}" in done.stdout


def test_output_path_is_checked_before_planning(tmp_path):
    marker = tmp_path / "imported"
    factory = tmp_path / "factory.py"
    factory.write_text(f"open({str(marker)!r}, 'w').close()\ndef build():\n    raise SystemExit\n")
    done = _run("plan", f"{factory}:build", "--mesh", "2", "-o", "/nodir/plan.json")
    assert done.returncode == 2
    assert "no folder '/nodir'" in done.stderr and "Traceback" not in done.stderr
    assert not marker.exists(), "the factory ran before the output path was checked"


@pytest.mark.parametrize("args, needle", [
    (["plan", "x.py:f", "--mesh", "2", "--memory", "1e999GiB"], "byte size"),
    (["plan", "x.py:f", "--mesh", "2", "--flops", "nan"], "finite number > 0"),
    (["plan", "x.py:f", "--mesh", "0x2"], "not a mesh shape"),
    (["plan", "x.py:f", "--mesh", "2", "--bandwidth", "inf"], "finite numbers"),
    (["plan", "x.py:f", "--mesh", "2", "--optimizer-impl", "fast"], "invalid choice"),
    (["estimate", "x.py:f", "--device", "bogus"], "not a device"),
    (["estimate", "x.py:f", "--batch", "-3"], "integer >= 1"),
    (["detect", "-o", "/nodir/c.json", "--local", "2"], "no folder"),
    (["plan", "x.py:f", "--cluster", "/nodir/cluster.json"], "no file"),
    (["plan", "x.py:f", "--mesh", "2", "--cluster", __file__], "not allowed with"),
    (["plan", "x.py:f"], "one of the arguments --mesh --cluster is required"),
])
def test_bad_arguments_are_usage_errors(args, needle, capsys):
    with pytest.raises(SystemExit) as done:
        main(args)
    assert done.value.code == 2
    assert needle in capsys.readouterr().err


def test_a_truncated_plan_is_a_message(tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text('{"schema_version": 2, "nodes": [')
    assert main(["explain", str(path)]) == 1
    err = capsys.readouterr().err
    assert "InvalidPlanError" in err and "invalid JSON" in err and "Traceback" not in err
    path.write_text(json.dumps({"schema_version": "1.0"}))
    assert main(["explain", str(path)]) == 1
    assert "StalePlanError" in capsys.readouterr().err
    assert main(["explain", str(tmp_path / "missing.json")]) == 1
    assert "FileNotFoundError" in capsys.readouterr().err


def _cluster_file(tmp_path, name: str) -> str:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({
        "version": 1, "devices": 2,
        "device": {"kind": "cuda", "name": name, "sustained_flops_per_s": 1e14,
                   "memory_bandwidth_bytes_per_s": 2e12, "op_overhead_s": 5e-6},
        "tiers": [{"group_size": 2, "alpha_s": 5e-6, "bandwidth_bytes_per_s": 2e11}]}))
    return str(path)


def test_plan_reads_a_cluster_file(tmp_path, capsys):
    """``automap detect -o cluster.json`` then ``automap plan --cluster``: the
    file's meshes and speeds, and for its GPUs the math libraries' workspaces
    (Hopper's defaults for H100s, named by the file)."""
    from automap.planner.plan import Plan

    out = tmp_path / "plan.json"
    assert main(["plan", mlp_factory(tmp_path), "--cluster", _cluster_file(tmp_path, "H100"),
                 "--memory", "100MiB", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "library_workspaces    66.0 MiB" in printed
    planned = Plan.from_json(out)
    assert planned.cost_constants["library_workspace_bytes"] == 66 * 2**20
    assert planned.cost_constants["flops_per_s"] == 1e14
    assert planned.mesh.backend == "nccl"


def test_a_cluster_file_and_mesh_links_conflict(tmp_path, capsys):
    assert main(["plan", "x.py:f", "--cluster", _cluster_file(tmp_path, "A100"),
                 "--bandwidth", "1e9"]) == 2
    assert "--bandwidth describe a --mesh" in capsys.readouterr().err
