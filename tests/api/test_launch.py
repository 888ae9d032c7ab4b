"""The local gloo launcher reports a failing rank's own traceback."""

from __future__ import annotations

import pytest

from api_workers import fail_on_rank_one
from automap.launch import run_on_gloo

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(120)
def test_a_failing_rank_reports_its_traceback():
    with pytest.raises(RuntimeError, match="rank one fails on purpose"):
        run_on_gloo(fail_on_rank_one, 2, timeout_s=60)
