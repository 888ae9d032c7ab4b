"""The generator (MAP section 6): a Plan and its traced graph become this rank's
parallel module, which trains exactly like the serial model.

- ``build``: the graph pass (communication, reshape localisation, inputs and outputs);
- ``state``: parameter sharding (from full weights, or shard by shard from meta);
- ``checkpoint``: the plan's activation-checkpoint blocks as nested
  ``torch.utils.checkpoint`` regions;
- ``grad_sync``: bucketed, asynchronous data-parallel gradient all-reduce;
- ``module``: the resulting ``ParallelModule`` (an fx GraphModule).
"""
