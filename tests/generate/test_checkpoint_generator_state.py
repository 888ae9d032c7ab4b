"""Checkpoint regions and the random generator: a region stashes the CPU
generator's state (5 KB, from its forward to its recomputation) only where it
draws random numbers, and the simulated step counts the states it stashes."""

from __future__ import annotations

import torch
from torch import fx, nn

from automap.generate.checkpoint import draws_random
from automap.generate.simulate import _Timeline, generator_states_tracked
from automap.trace.tracing import trace


def _nodes(model: nn.Module) -> list[fx.Node]:
    traced = trace(model, (torch.randn(4, 8),), loss_fn=lambda out: out.sum())
    return list(traced.graph.nodes)


def test_only_regions_that_draw_random_numbers_stash_the_generator():
    assert draws_random(_nodes(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1))))
    assert not draws_random(_nodes(nn.Sequential(nn.Linear(8, 8), nn.ReLU())))


def test_a_region_around_a_stashing_region_stashes_too():
    graph = fx.Graph()
    x = graph.placeholder("x")
    inner = graph.get_attr("checkpoint_0")
    for preserve, expected in ((True, True), (False, False)):
        call = graph.call_function(torch.utils.checkpoint.checkpoint, (inner, x),
                                   {"use_reentrant": False, "preserve_rng_state": preserve})
        assert draws_random([x, inner, call]) is expected


def test_the_simulated_step_tracks_stashed_generator_states():
    timeline = _Timeline()
    timeline.phase = "forward"
    with generator_states_tracked(timeline, torch.device("cpu")):
        state = torch.get_rng_state()
        assert timeline.live == state.untyped_storage().nbytes() > 0
        del state
        assert timeline.live == 0
    with generator_states_tracked(timeline, torch.device("meta")):
        state = torch.get_rng_state()  # CPU memory: not the device's
        assert timeline.live == 0 and state.numel() > 0


def test_random_ops_the_generator_wraps_still_stash():
    from automap.generate import ops
    from automap.sharding import collectives

    graph = fx.Graph()
    x = graph.placeholder("x")
    dropout = graph.call_function(ops.sharded_dropout,
                                  (torch.ops.aten.native_dropout.default, x, 0.1, True, [4]))
    shard = graph.call_function(ops.take_shard, (x, ((0, 2),)))
    gather = graph.call_function(collectives.all_reduce_sum, (x,))
    unknown = graph.call_function(print, (x,))
    assert draws_random([dropout])
    assert not draws_random([x, shard, gather])
    assert draws_random([unknown])
