"""Partial gradients of one tensor summed locally before one reduction (issue 14,
point 5): q, k and v projections that read one replicated hidden state under
Megatron's head split each leave its gradient partial over the tensor-parallel
axis; the generated program all-reduces their sum once, and the planner prices
one all-reduce, not three (the ILP's objective, the reported step time and the
bytes per axis alike). Training equality of such plans is in
tests/generate/test_generate_gloo.py (the "heads" and "batch_heads" cases)."""

from __future__ import annotations

import pytest
import torch

from automap import DeviceMesh
from automap.generate.build import generate_graph
from automap.planner import search, traffic
from automap.planner.step_time import shared_gradient_savings, step_time
from automap.planner.traffic import collective_bytes_per_axis
from automap.sharding.collectives import identity_all_reduce_grad
from automap.sharding.process_groups import SimulatedGroups
from automap.solve.shared_gradients import plan_readings, shared_gradients
from forced_plans import forced_plan
from generate_workers import FORCED
from serial import build

MESH = DeviceMesh((4,), alpha_s=1e-5, bandwidth_bytes_per_s=1e9)


def _heads_plan():
    """The forced head-split plan of a GPT-2 block, and the strategy table it chose from."""
    model, inputs, loss_fn = build("block")
    tables = []
    original = search.build_strategy_table

    def keep_table(*args, **kwargs):
        tables.append(original(*args, **kwargs))
        return tables[-1]

    search.build_strategy_table = keep_table
    try:
        traced, plan = forced_plan(model, inputs, loss_fn, MESH, **FORCED["heads"](MESH))
    finally:
        search.build_strategy_table = original
    return traced, plan, tables[-1]


def test_readers_of_one_activation_share_one_all_reduce():
    traced, plan, table = _heads_plan()
    groups = shared_gradients(plan_readings(plan), lambda s: MESH.size if "S" in s else 1)
    readers = {len(g.readers): g for g in groups}
    assert 3 in readers, groups  # the block's normalised input, read by q, k and v
    qkv = readers[3]
    assert qkv.axes == (0,) and qkv.spec == "RRR"
    assert {plan.nodes[c].op for c, _ in qkv.readers} == {"linear"}

    # The program wraps it once: one backward all-reduce for the three readers.
    graph = generate_graph(traced, plan, SimulatedGroups(MESH, 0, "gloo"), 0,
                           torch.device("cpu")).graph
    wraps = [n for n in graph.nodes if n.target is identity_all_reduce_grad]
    shared_wrap = [n for n in wraps if len(n.users) == 3]
    assert len(shared_wrap) == 1
    assert all("linear" in str(u.target) for u in shared_wrap[0].users)

    # Priced once: the step time takes back two of the three all-reduces.
    one = MESH.all_reduce_cost_s(qkv.local_bytes, (0,))
    choice = {name: next(i for i in range(len(node))
                         if list(node.in_specs[i]) == plan.nodes[name].inputs
                         and list(node.out_specs[i]) == plan.nodes[name].outputs)
              for name, node in table.nodes.items()}
    saved = shared_gradient_savings(table, choice)
    assert sum(saved.values()) >= 2 * one * (1 - 1e-9)
    full = step_time(None, table, choice)
    assert plan.predicted_step_s == pytest.approx(full.step_s, rel=1e-12)
    node_sum = sum(float(table.nodes[n].backward_comm_s[choice[n]]) for n in table.nodes)
    assert sum(n.backward_comm_s for n in plan.nodes.values()) == \
        pytest.approx(node_sum - sum(saved.values()), rel=1e-12)

    # The bytes on the axis count one all-reduce of the hidden state, not three.
    shared = collective_bytes_per_axis(plan)[0]
    original = traffic.shared_gradients
    traffic.shared_gradients = lambda readings, shard_count: []
    try:
        unshared = collective_bytes_per_axis(plan)[0]
    finally:
        traffic.shared_gradients = original
    assert unshared - shared == pytest.approx(2 * 2 * 3 / 4 * qkv.local_bytes)


def test_the_ilp_objective_counts_the_shared_all_reduce_once():
    _, plan, _ = _heads_plan()
    # The ILP's objective is the sequential step time of its choice: with the
    # shared all-reduce priced once it equals the packaged plan's sequential time.
    assert abs(plan.solver["objective_s"] - plan.step_time["sequential_s"]) <= \
        1e-6 * plan.step_time["sequential_s"] + 1e-9


def test_a_tied_weights_readers_share_one_all_reduce_in_the_search():
    """A parameter read by several nodes is one tensor too: GPT-2's tied
    embedding, read by the token lookup and the LM head, each leaving its
    gradient partial over the batch axis, is all-reduced once (in a bucket).
    Priced per reader, the batch-split lookup looked an all-reduce dearer than
    a replicated one followed by a split, so on 2 ranks with slow links the
    plan computed the lookup on the whole batch, all-gathered its gradient
    in the backward and all-reduced the head's share of the weight's gradient
    on its own, out of the buckets (profiled: 54 ms of blocking all-reduce per
    step); now the lookup is batch-split and the weight bucketed."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from automap import plan
    from automap.solve.shared_gradients import plan_readings, shared_gradients

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=2048, n_positions=256,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0)
    ids = torch.randint(0, 2048, (8, 256), generator=torch.Generator().manual_seed(1))
    mesh = DeviceMesh((2,), alpha_s=5e-3, bandwidth_bytes_per_s=5e8, backend="gloo")
    found = plan(GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}, mesh,
                 flops_per_s=3e10, memory_bandwidth_bytes_per_s=2e10, op_overhead_s=1e-5)
    lookup = found.nodes["embedding"]
    assert lookup.inputs == ["RR", "S0R"] and lookup.grad_reduce_axes[0] == [0]
    tied = [g for g in shared_gradients(plan_readings(found), lambda s: 2 if "S" in s else 1)
            if found.nodes[g.producer].kind == "parameter"]
    assert [sorted(c for c, _ in g.readers) for g in tied] == [["embedding", "linear"]]
