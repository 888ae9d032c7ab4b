"""The pipeline runtime on the torch releases it supports: torch 2.11 (a GPU
machine's) fed ``step(arg_mbs=...)`` to the first stage's forward as a model
keyword, and its pipelining cannot train a stage that receives integers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import automap.generate.pipeline as pipeline
from automap.errors import PipelineError
from automap.generate.schedule_call import run_schedule


class _OldSchedule:
    """A schedule of torch before 2.14: ``step`` splits whole-batch inputs and
    hands any other keyword to the model."""

    def __init__(self) -> None:
        self._has_backward = True
        self._stage = SimpleNamespace(has_backward=None, cleared=0)
        self._stage.clear_runtime_states = lambda: setattr(
            self._stage, "cleared", self._stage.cleared + 1)
        self.calls: list = []

    def step(self, *args, target=None, losses=None, return_outputs=True, **kwargs):
        raise AssertionError(f"step got model keywords {sorted(kwargs)}")

    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None,
                           return_outputs=True):
        self.calls.append((arg_mbs, kwarg_mbs, target_mbs, return_outputs,
                           self._has_backward, self._stage.has_backward))
        losses.append(1.0)


@pytest.mark.parametrize("backward", [True, False])
def test_an_old_schedule_runs_its_own_loop_on_the_split_microbatches(backward):
    schedule, losses = _OldSchedule(), []
    microbatches = [(torch.ones(1),), (torch.zeros(1),)]
    run_schedule(schedule, microbatches, [0.5, 0.5], losses, backward=backward)
    assert losses == [1.0] and schedule._stage.cleared == 1
    ((arg_mbs, kwarg_mbs, targets, outputs, during, stage_flag),) = schedule.calls
    assert arg_mbs is microbatches and kwarg_mbs is None and targets == [0.5, 0.5]
    assert outputs is False and during is backward and stage_flag is backward
    assert schedule._has_backward is True  # restored for the next step


def _stage(index: int, *dtypes: torch.dtype):
    return SimpleNamespace(index=index, input_metas=tuple(
        torch.empty(2, device="meta", dtype=d) for d in dtypes))


def test_a_stage_receiving_integers_is_refused_where_torch_cannot_train_it(monkeypatch):
    stages = [_stage(0, torch.int64), _stage(1, torch.float32, torch.int64)]
    monkeypatch.setattr(pipeline, "RECEIVES_INTEGERS_SINCE", "0.0")
    pipeline._check_received_dtypes(stages)
    monkeypatch.setattr(pipeline, "RECEIVES_INTEGERS_SINCE", "99.0")
    with pytest.raises(PipelineError, match=r"stage 1 .* receives torch\.int64 tensors.*"
                                            r"torch >= 99\.0"):
        pipeline._check_received_dtypes(stages)
    pipeline._check_received_dtypes([_stage(0, torch.int64), _stage(1, torch.float32)])
