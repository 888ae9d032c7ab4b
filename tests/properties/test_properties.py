"""Property-based tests (hypothesis, bounded and deterministic): random meshes,
specs, shapes, dtypes, budgets, link figures, mutated plan JSON, command lines
and run-time inputs through the public API; every input gives a result or an
``AutomapError``. Each property runs in a child process, so a segfault, an
abort or a hang (the timeout) fails its test, not the suite."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(target: str, timeout_s: float) -> None:
    try:
        done = subprocess.run([sys.executable, os.path.join(HERE, "fuzz_targets.py"), target],
                              capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    except subprocess.TimeoutExpired:
        pytest.fail(f"{target}: no answer in {timeout_s:.0f} s (a hang)")
    crash = f"killed by signal {-done.returncode}" if done.returncode < 0 else ""
    assert done.returncode == 0, f"{target} {crash}\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("target", ["meshes", "meshes_specs_layouts", "plan_json",
                                    "command_line"])
def test_api_and_cli_answer_every_input(target):
    _run(target, timeout_s=180)


@pytest.mark.timeout(300)
def test_planning_answers_every_budget_and_link_figure():
    _run("planning", timeout_s=280)


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_generated_modules_answer_every_input():
    _run("module_inputs", timeout_s=180)
