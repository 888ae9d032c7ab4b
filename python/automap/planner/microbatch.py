"""The example batch and one microbatch of it: every tensor of the example
inputs is split along dim 0, its batch dimension."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from automap.generate.pipeline_order import interleaved_rounds


def example_batch(example_inputs: Any) -> int | None:
    """The batch size the input tensors share (their dim 0); None when there is
    no tensor, a scalar one, or they disagree."""
    sizes = {t.shape[0] if t.dim() else None
             for t in pytree.tree_leaves(example_inputs) if isinstance(t, torch.Tensor)}
    if len(sizes) != 1:
        return None
    return sizes.pop()


def microbatch_inputs(example_inputs: Any, microbatches: int) -> Any:
    """The first of ``microbatches`` equal slices of every input tensor along
    dim 0 (the batch must divide; ``check_pipeline`` says so first)."""
    if microbatches == 1:
        return example_inputs
    batch = example_batch(example_inputs)
    assert batch is not None and batch % microbatches == 0
    size = batch // microbatches
    return pytree.tree_map_only(torch.Tensor, lambda t: t[:size], example_inputs)


#: ``microbatches="auto"`` tries, for ``n`` stages, the divisors of the batch
#: from ``n`` (1F1B needs a microbatch per stage in flight) to this many times
#: ``n``: the bubble's share ``(n - 1) / (M + n - 1)`` is below 20 % there, and
#: every further microbatch adds its per-op and per-message costs again.
MAX_MICROBATCHES_PER_STAGE = 4


def microbatch_counts(batch: int, stages: int, schedule: str) -> list[int]:
    """The microbatch counts ``microbatches="auto"`` prices for ``stages``
    stages of ``batch``: divisors ``M`` of the batch with ``n <= M <=
    MAX_MICROBATCHES_PER_STAGE * n`` that the schedule runs (interleaved 1F1B:
    its rounds divide ``M``); empty when the batch has fewer than ``n``
    samples."""
    top = min(batch, MAX_MICROBATCHES_PER_STAGE * stages)
    return [m for m in range(stages, top + 1) if batch % m == 0 and
            (schedule != "interleaved" or interleaved_rounds(m, stages) is not None)]
