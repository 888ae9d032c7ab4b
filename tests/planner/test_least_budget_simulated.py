"""Issue 14 point 3: a budget that a plan the planner finds runs within is a
budget the planner plans at. GPT-2 (4 layers, width 256, vocab 2048, sequence
256, batch 16, benches/vs_torch.py's model) on (4,), checkpointing off, every
speed given: planned within 156.3 MiB, the plan (parameters stored sharded,
gathered for their use) simulated at 152.0 MiB, but planning within that failed
and named 155.1 MiB, because the model over-estimated the sharded plan by 2.7 %
and the verified search trusts the model's ranking below its least. Two causes,
both fixed: the profile ran attention under the traced causal mask, whose kernel
keeps a float copy of the mask for its backward (1 MiB per layer here) that the
causal kernel the program runs does not keep; and the memory rows counted a
bucket copy of a gathered parameter's gradient, which is reduced in the graph
instead. Now the plan within 156.3 MiB is modelled at 155.64 MiB and simulates
at 155.61 MiB, and planning within any plan's simulated peak succeeds.

Below every plan, the error named 155.1 MiB (the simulated step of the model's
leanest plan), above the 152.61 MiB plan found within 153 MiB: that plan's
output projections read the attention output converted (an all-to-all) and
save the copy, which the model did not count, because attention saves the
same tensor first (1 MiB per layer here). Counted now, the least named is
151.09 MiB."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from automap import DeviceMesh
from automap.cluster.device import resolve_device_profile
from automap.errors import InfeasibleBudgetError
from automap.planner.search import plan, plan_traced
from automap.trace.profiling import profile_traced
from automap.trace.tracing import default_loss, trace

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


@pytest.mark.timeout(600)
def test_a_plan_that_runs_within_the_budget_is_found():
    model, inputs = _gpt2()
    mesh = DeviceMesh((4,), **MESH)
    loose = plan(model, inputs, mesh, 156.3 * MIB, checkpointing="off", **SPEEDS)
    fits_in = loose.predicted_peak_memory_bytes  # its simulated peak and reserve
    tight = plan(model, inputs, mesh, fits_in, checkpointing="off", **SPEEDS)
    assert tight.predicted_peak_memory_bytes <= fits_in


@pytest.mark.timeout(600)
def test_the_least_named_plans_and_no_found_plan_is_under_it():
    model, inputs = _gpt2()
    traced = trace(model, inputs, loss_fn=default_loss)
    profile = profile_traced(traced, "adamw")
    options = dict(device=resolve_device_profile(**SPEEDS), checkpointing="off")
    mesh = DeviceMesh((4,), **MESH)
    with pytest.raises(InfeasibleBudgetError) as refused:
        plan_traced(traced, profile, mesh, 140 * MIB, **options)
    least = refused.value.smallest_feasible_budget_bytes
    assert least is not None
    at_least = plan_traced(traced, profile, mesh, least, **options)
    assert at_least.predicted_peak_memory_bytes <= least
    found = plan_traced(traced, profile, mesh, 153 * MIB, **options)
    assert least <= found.predicted_peak_memory_bytes
