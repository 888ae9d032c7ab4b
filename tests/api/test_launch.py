"""The local gloo launcher reports a failing rank's own traceback, exits its
ranks cleanly with collectives still in flight, and leaves no rank behind
when one stops."""

from __future__ import annotations

import time

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
