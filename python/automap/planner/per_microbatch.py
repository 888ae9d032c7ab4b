"""The strategy table a pipeline stage's intra-op plan is chosen on: the
stage runs one microbatch's forward and backward ``M`` times per step but
all-reduces its parameters' gradients and steps the optimizer once, after
the last microbatch (``pipeline_partition.stage_sync_s``). The ILP prices a
node's strategy as one step, so on the plain table it weighs a parameter
sharded over a slow axis (its all-gather paid per microbatch, ``M`` times)
one for one against the parameter replicated (its gradient all-reduced once):
on GPT-3 13B cut in 2 stages of (2, 8) with 8 microbatches it sharded weights
over the 25 GB/s node axis, and the stage's collectives per microbatch came
to 115 ms against 63 ms on the (8,) submesh. Here those once-per-step costs
are divided by ``M``: the objective is the stage's step over ``M``."""

from __future__ import annotations

import dataclasses

from automap.solve.strategies import ShardCounts, StrategyTable


def per_microbatch_table(table: StrategyTable, microbatches: int) -> StrategyTable:
    """A copy of ``table`` whose once-per-step costs are divided by
    ``microbatches``: each node's all-reduce of a trainable parameter's
    gradient (read directly; a parameter read through a cast keeps its full
    price) and the parameters' optimizer steps. Strategies keep their order,
    so a choice on the copy is a choice on ``table``."""
    if microbatches <= 1:
        return table
    share = 1.0 / microbatches
    mesh, shard_count = table.mesh, ShardCounts(table.mesh)
    nodes = dict(table.nodes)
    for name, node in table.nodes.items():
        if node.optimizer_s is not None:
            nodes[name] = dataclasses.replace(node, optimizer_s=node.optimizer_s * share)
        if node.reductions is None:
            continue
        params = [k for k, (producer, _) in enumerate(node.inputs)
                  if table.nodes[producer].kind == "parameter"
                  and table.nodes[producer].grad_bytes.any()]
        if not params:
            continue
        backward = node.backward_comm_s.copy()
        for s, (_, _, grad_axes) in enumerate(node.reductions):
            for k in params:
                axes = grad_axes[k]
                if not axes:
                    continue
                producer, o = node.inputs[k]
                local = table.nodes[producer].outputs[o].nbytes / shard_count(node.in_specs[s][k])
                once = mesh.all_reduce_cost_s(local, tuple(axes))
                backward[s] -= min(backward[s], once) * (1 - share)
        nodes[name] = dataclasses.replace(nodes[name], backward_comm_s=backward)
    return dataclasses.replace(table, nodes=nodes)
