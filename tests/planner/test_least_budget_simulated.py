"""Issue 14 point 3, a case still open: the smallest feasible budget an error
names should be the least that runs. Under a budget the model's leanest plan
does not fit, the verified search simulates that plan and names its peak; but
the memory model over-estimates some plans more than others (a parameter that
is stored sharded and gathered for its use keeps no gradient bucket copy, which
the model counts: the ILP prices its edge per spec pair, the bucket depends on
the consumer's strategy), so a faster plan the model puts above its least can
run in less. GPT-2 (4 layers, width 256, vocab 2048, sequence 256, batch 16,
benches/vs_torch.py's model) on (4,), checkpointing off, every speed given:
planned within 156.3 MiB, a sharded plan modelled at 156.1 MiB simulates at
152.0 MiB; planning within 153 MiB fails and names 155.1 MiB, the model's
leanest plan. This test states what should hold and is expected to fail until
the memory rows price the gathered parameter's missing bucket copy."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from automap import DeviceMesh
from automap.planner.search import plan

MIB = 2**20
#: A device profile and links measured on this machine under load (benches/vs_torch.py).
SPEEDS = dict(flops_per_s=1.489e10, memory_bandwidth_bytes_per_s=6.493e9,
              op_overhead_s=2.515e-5, shared_slowdown=4.2)
MESH = dict(alpha_s=[9.91e-4], bandwidth_bytes_per_s=[3.6e8])


def _gpt2():
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=2048, n_positions=256,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 2048, (16, 256), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


@pytest.mark.xfail(strict=True, reason="the ILP counts a bucket copy that a gathered "
                   "parameter's gradient does not make (issue 14 point 3, open)")
@pytest.mark.timeout(600)
def test_a_plan_that_runs_within_the_budget_is_found():
    model, inputs = _gpt2()
    mesh = DeviceMesh((4,), **MESH)
    loose = plan(model, inputs, mesh, 156.3 * MIB, checkpointing="off", **SPEEDS)
    fits_in = loose.predicted_peak_memory_bytes * 1.002  # the verified search's headroom
    assert fits_in < loose.solver["modelled_peak_bytes"]  # the model over-estimates it
    tight = plan(model, inputs, mesh, fits_in, checkpointing="off", **SPEEDS)
    assert tight.predicted_peak_memory_bytes * 1.001 <= fits_in
