"""The example batch and one microbatch of it: every tensor of the example
inputs is split along dim 0, its batch dimension."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree


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
