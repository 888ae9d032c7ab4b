"""Progress and logging (automap.progress): the library logs its stages on the
``automap`` logger and prints nothing; ``verbose=True`` and the command line
show them on stderr, one line per stage when stderr is not a terminal and
tqdm bars when it is; ``-q`` silences them; stdout holds only results."""

from __future__ import annotations

import io
import logging
import subprocess
import sys

import pytest
import torch
from torch import nn

import automap
from automap import progress

SPEEDS = dict(flops_per_s=1e9, memory_bandwidth_bytes_per_s=1e10, op_overhead_s=1e-6)
FACTORY = """\
import torch
def build(batch=8):
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 8))
        x = torch.randn(batch, 16)
    return model, (x,), lambda out: out.pow(2).mean()
"""


CLI = "import sys\nfrom automap.cli import main\nsys.exit(main(sys.argv[1:]))\n"


def _plan_cli(tmp_path, *extra: str, before: tuple[str, ...] = ()
              ) -> subprocess.CompletedProcess:
    factory = tmp_path / "factory.py"
    factory.write_text(FACTORY)
    args = [*before, "plan", f"{factory}:build", "--mesh", "2", "--memory", "1MiB",
            "--flops", "1e9", "--memory-bandwidth", "1e10", "--op-overhead", "1e-6", *extra]
    # stderr is a pipe here, not a terminal: one line per stage.
    return subprocess.run([sys.executable, "-c", CLI, *args], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)


def test_plan_reports_stages_on_stderr_and_results_on_stdout(tmp_path):
    done = _plan_cli(tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines and all(line.startswith("automap: ") for line in lines), done.stderr
    for needle in ("traced Sequential with torch.export", "profiled a training step",
                   "ILP (no memory limit)", "searching within a memory budget of 1.0 MiB",
                   "simulated the plan's"):
        assert any(needle in line for line in lines), (needle, done.stderr)
    assert "gap" in done.stderr  # each solve names its gap
    assert "\r" not in done.stderr and "it/s" not in done.stderr  # no bars off a terminal
    assert done.stdout.startswith("plan on mesh (2,)")  # the explanation, nothing before
    assert "automap: " not in done.stdout


def test_plan_prices_collectives_for_the_backend_given(tmp_path):
    done = _plan_cli(tmp_path, "-q", "--backend", "gloo", "-o", str(tmp_path / "plan.json"))
    assert done.returncode == 0, done.stderr
    assert automap.Plan.from_json(str(tmp_path / "plan.json")).mesh.backend == "gloo"


@pytest.mark.parametrize("where", ["after", "before"])
def test_quiet_silences_progress(tmp_path, where):
    done = _plan_cli(tmp_path, "-q") if where == "after" else \
        _plan_cli(tmp_path, before=("--quiet",))
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.startswith("plan on mesh (2,)")


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _loss(out):
    return out.pow(2).mean()


def test_library_planning_logs_on_the_automap_logger_and_prints_nothing(caplog, capsys):
    caplog.set_level(logging.INFO, logger="automap")
    automap.plan(_Tiny(), (torch.randn(8, 16),), (2,), loss_fn=_loss, **SPEEDS)
    names = {r.name for r in caplog.records}
    assert names and all(n.startswith("automap.") for n in names), names
    assert {"automap.trace.tracing", "automap.trace.profiling",
            "automap.planner.search"} <= names
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("ILP (no memory limit): Optimal") for m in messages), messages
    printed = capsys.readouterr()
    assert printed.out == "" and printed.err == ""  # logged, not printed


def test_verbose_shows_progress_on_stderr_only(capsys):
    automap.plan(_Tiny(), (torch.randn(8, 16),), (2,), loss_fn=_loss, verbose=True, **SPEEDS)
    printed = capsys.readouterr()
    assert printed.out == ""
    assert "automap: ILP (no memory limit)" in printed.err
    # The console is gone after the call: a quiet call stays quiet.
    automap.plan(_Tiny(), (torch.randn(8, 16),), (2,), loss_fn=_loss, **SPEEDS)
    assert capsys.readouterr().err == ""
    assert logging.getLogger("automap").handlers == []


def test_a_terminal_gets_bars_and_lines(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setattr(progress, "_is_terminal", lambda s: True)
    log = logging.getLogger("automap.test")
    with progress.console():
        with progress.stage(log, "counted", total=3) as counting:
            for i in range(3):
                counting.advance(f"item {i}")
            counting.result("3 items")
    text = stream.getvalue()
    assert "automap: counted:   0%" in text and "0/3" in text  # the bar (redrawn at most 10/s)
    assert "automap: counted: 3 items (" in text  # the stage's line above it


def test_stages_below_their_threshold_and_disabled_stages_do_not_report(caplog):
    caplog.set_level(logging.INFO, logger="automap")
    log = logging.getLogger("automap.test")
    with progress.stage(log, "quick", min_s=60.0):
        pass
    with progress.stage(log, "other rank", enabled=False) as other:
        other.advance("step")
    with pytest.raises(ValueError), progress.stage(log, "failed"):
        raise ValueError("stop")
    assert caplog.records == []
    with progress.stage(log, "slow enough"):
        pass
    assert [r.getMessage() for r in caplog.records] == ["slow enough (0.0 s)"]


def test_quiet_console_keeps_warnings_and_nesting_keeps_the_outer_choice(capsys):
    log = logging.getLogger("automap.test")
    with progress.console(enabled=False):
        with progress.console():  # e.g. verbose=True under the CLI's -q
            log.info("hidden")
    assert capsys.readouterr().err == ""
    assert logging.getLogger("automap").level == logging.NOTSET
