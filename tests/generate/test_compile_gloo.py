"""``torch.compile`` of a generated module on 2 gloo ranks: one graph, no graph
breaks (the collectives are custom ops while compiling), and the losses of
eager mode, for a tensor-parallel plan (collectives in the graph), a
data-parallel one (bucketed gradient all-reduces outside it) and a sharded
data-parallel one (``gather_shard`` in the graph)."""

from __future__ import annotations

import pytest

from automap.launch import run_on_gloo
from compile_workers import STEPS, compiled_against_eager

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan_name", ["megatron", "data_parallel", "fsdp"])
def test_compiled_module_trains_like_eager(plan_name):
    for r in run_on_gloo(compiled_against_eager, 2, plan_name, "inductor", timeout_s=500):
        assert r["graph_breaks"] == 0 and r["graphs"] == 1, r["reasons"]
        assert len(r["compiled"]) == STEPS
        assert r["compiled"] == pytest.approx(r["eager"], rel=1e-5)
        if plan_name != "data_parallel":
            assert r["collectives_in_graph"] >= 1
