"""The local gloo launcher reports a failing rank's own traceback, exits its
ranks cleanly with collectives still in flight, leaves no rank behind when
one stops, and no semaphore behind when a rank made one."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from api_workers import fail_on_rank_one, leave_a_collective_in_flight, stop_rank_one
from automap.launch import run_on_gloo

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(120)
def test_a_failing_rank_reports_its_traceback():
    with pytest.raises(RuntimeError, match="rank one fails on purpose"):
        run_on_gloo(fail_on_rank_one, 2, timeout_s=60)


@pytest.mark.timeout(200)
def test_ranks_exit_cleanly_with_a_collective_in_flight():
    for _ in range(3):
        assert run_on_gloo(leave_a_collective_in_flight, 2, timeout_s=60) == [0, 1]


@pytest.mark.timeout(120)
def test_a_stopped_rank_is_killed_when_the_run_times_out():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish in 5 s"):
        run_on_gloo(stop_rank_one, 2, timeout_s=5)
    assert time.monotonic() - start < 90


@pytest.mark.timeout(200)
def test_a_rank_drawing_a_progress_bar_leaks_no_semaphore():
    """tqdm's first bar made a multiprocessing lock in each rank, which its
    os._exit never unlinked: the README's main job ended with "There appear
    to be 1 leaked semaphore objects to clean up at shutdown"."""
    here = Path(__file__).parent
    script = ("from automap.launch import run_on_gloo\n"
              "from api_workers import draw_a_disabled_progress_bar\n"
              "if __name__ == '__main__':\n"
              "    assert run_on_gloo(draw_a_disabled_progress_bar, 2, timeout_s=60) == [0, 1]\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(here), str(here.parent / "support"), *sys.path]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "leaked semaphore" not in done.stderr
