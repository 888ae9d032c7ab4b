"""The FakeTensorMode of the profile and the simulated steps keeps the storages
an op's outputs share where FakeTensorMode's dispatch cache would rebuild them
apart: an LSTM's backward (``mkldnn_rnn_layer_backward`` returns one bias
gradient twice) profiled 1 KiB more from the second call in a process on."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from automap.trace import fake_mode
from automap.trace.profiling import profile_traced
from automap.trace.tracing import trace
from model_matrix import build


def _nodes(profile) -> list[dict]:
    return [dataclasses.asdict(n) for n in profile.nodes]


@pytest.mark.timeout(300)
def test_an_lstm_profile_is_the_same_every_call_and_the_uncached_dispatchs():
    model, inputs, loss_fn = build("lstm")
    traced = trace(model, inputs, loss_fn=loss_fn)
    first, second, third = (profile_traced(traced, "adamw") for _ in range(3))
    assert _nodes(first) == _nodes(second) == _nodes(third)
    assert first.peak_memory_bytes == second.peak_memory_bytes
    # What every dispatch run for real (no cache) measures.
    with torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
        uncached = profile_traced(traced, "adamw")
    assert _nodes(uncached) == _nodes(second)
    if torch.backends.mkldnn.is_available():
        assert torch.ops.aten.mkldnn_rnn_layer_backward.default in fake_mode._SHARING


def test_ops_whose_outputs_do_not_share_storage_stay_cached():
    """Checked once uncached, then served by the cache as before."""
    with fake_mode.StorageFaithfulFakeMode():
        x = torch.randn(4, 6)
        for _ in range(3):
            values, indices = torch.ops.aten.max.dim(x, 1)
    assert torch.ops.aten.max.dim in fake_mode._CHECKED
    assert torch.ops.aten.max.dim not in fake_mode._SHARING
    assert values.untyped_storage() is not indices.untyped_storage()
