"""Stage 1, the intra-op sharding search: each traced op's signature
(``signatures``), its strategies priced on the mesh (``strategies``, generated in
the Rust core), repeated blocks (``blocks``, ``depth``) and the HiGHS ILP under a
memory budget (``ilp``). Receives a TracedGraph, Profile and DeviceMesh; hands
a ``StrategyTable`` and an ``IlpSolution`` (one strategy per node) on."""
