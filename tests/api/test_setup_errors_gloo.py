"""Setup on several ranks fails together and in bounded time: an error on one
rank (an argument, planning on the leader) is raised on every rank as the same
typed error; a stopped rank (SIGSTOP) is reported by the others within the
setup timeout; a generated module refuses inputs the plan was not made for,
inputs that require a gradient, a switch to the mode it was not traced in, and
a cast of its state to another dtype."""

from __future__ import annotations

import pytest
import torch

import automap
from automap.launch import run_on_gloo
from setup_workers import errors_reach_every_rank, stopped_rank


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_errors_reach_every_rank_as_the_same_typed_error():
    results = run_on_gloo(errors_reach_every_rank, 2, timeout_s=300)
    for r in results:
        assert r["argument"]["class"] == "InvalidArgumentError"
        assert "memory_budget_bytes" in r["argument"]["message"]
        assert "-1.0" in r["argument"]["message"]
        assert r["unknown_option"]["class"] == "InvalidArgumentError", r["unknown_option"]
        assert "nonsense_option" in r["unknown_option"]["message"]
        assert r["planning"]["class"] == "InfeasibleBudgetError"
        assert r["planning"]["least"] > 1000
        assert r["no_optimizer_loss"] == pytest.approx(results[0]["no_optimizer_loss"])
        for key, needle in (("batch", "expected shape [32, 64]"), ("dtype", "torch.float64"),
                            ("extra", "positional"), ("keyword", "keyword inputs")):
            assert r[key]["class"] == "InputMismatchError", (key, r[key])
            assert needle in r[key]["message"], (key, r[key]["message"])
        assert r["requires_grad"]["class"] == "InputMismatchError", r["requires_grad"]
        assert "requires a gradient" in r["requires_grad"]["message"]
        assert r["no_grad_loss"] == pytest.approx(r["no_optimizer_loss"])
        assert r["eval"]["class"] == "TrainingModeError", r["eval"]
        assert "traced in training mode" in r["eval"]["message"]
        assert r["training"] is True
        for key in ("cast", "cast_to"):
            assert r[key]["class"] == "InvalidArgumentError", (key, r[key])
            assert "dtypes it was traced in" in r[key]["message"]
        assert r["moved"] is True
        assert r["still_trains"] == pytest.approx(r["no_optimizer_loss"])
    # The same error on both ranks: rank 0 did not fail itself, it raised rank 1's.
    assert results[0]["argument"]["message"] == results[1]["argument"]["message"]
    assert results[0]["planning"]["least"] == results[1]["planning"]["least"]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_stopped_rank_is_reported_within_the_setup_timeout():
    timeout_s = 5.0
    leader, woken = run_on_gloo(stopped_rank, 2, timeout_s, timeout_s=120)
    assert leader["class"] == "DistributedError", leader
    assert "Rank 1" in leader["message"] or "rank 1" in leader["message"], leader
    assert "5 s" in leader["message"]
    # Within the timeout, plus the margin of a busy machine.
    assert leader["seconds"] < timeout_s + 25, leader
    assert woken["class"] == "DistributedError", woken


def test_no_process_group_says_how_to_start_one():
    model = torch.nn.Linear(4, 4)
    for call in (lambda: automap.autoparallelize(model, torch.randn(2, 4)),
                 lambda: automap.apply(None, model)):
        with pytest.raises(automap.DistributedError, match="init_process_group"):
            call()
