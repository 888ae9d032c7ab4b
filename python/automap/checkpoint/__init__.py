"""Stage 2, activation checkpointing: the graph linearized into stages
(``linearize``), the chain of a sharding plan's per-stage times and sharded
bytes (``chain``), the rotor DP with communication costs (Rust core), and the
checkpoint record a Plan carries (``record``). Receives the strategy table and
an ILP choice; hands a ``CheckpointPlan`` to the planner."""
