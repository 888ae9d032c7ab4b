"""Issue 5, acceptance 1-3: the generated parallel module trains exactly like
the serial model. On meshes (4,) and (2,2) of 4 gloo ranks (one spawn per mesh,
every model inside it), five steps of SGD and of AdamW give the serial losses at
every step, the serial gradients at the first step and the serial parameters
after the last; each rank holds exactly the plan's shard bytes.

Plans: the solver's (``solver``: default FLOP/s, ``solver_slow``: FLOP/s so slow
that it splits the compute) and forced ones for every communication path
(``generate_workers.FORCED``)."""

from __future__ import annotations

import pytest

from automap import DeviceMesh
from automap.launch import run_on_gloo
from generate_workers import COLLECTIVE_NAMES, train_cases

pytestmark = pytest.mark.multiprocess

#: Relative tolerance of losses and first-step gradients, and of parameters after
#: SGD; absolute tolerance of parameters after AdamW, or the distance between the
#: serial model in fp32 and in fp64 where that is larger. That exception is for
#: the ResNet under sharded plans alone: after three AdamW steps a few
#: pre-activations sit within rounding of ReLU's kink, so the order of a sum flips
#: a gradient element's sign (serial -3.0e-6, parallel -6.1e-4 for one
#: layer2.conv2 weight at step 4) and Adam's normalised step turns that into an
#: lr-sized difference; the serial fp32 model is 1.6e-3 away from its own fp64
#: run. The same case in float64 (test below) meets 1e-5 outright.
TOL = 1e-5

CASES = {
    (4,): [
        ("mlp", "solver"), ("mlp", "dp"), ("mlp", "megatron"), ("mlp", "reshard"),
        ("mlp", "solver_slow"),
        ("resnet", "solver_slow"), ("gpt2", "solver_slow"), ("gpt2", "vocab"),
        ("llama", "solver_slow"), ("block", "heads"), ("resnet", "solver"), ("gpt2", "solver"),
        ("llama", "solver"),
    ],
    (2, 2): [
        ("mlp", "solver"), ("mlp", "2d"), ("mlp", "dp"), ("resnet", "solver_slow"),
        ("gpt2", "solver_slow"), ("gpt2", "dp_tokens"), ("llama", "solver_slow"),
        ("block", "batch_heads"),
    ],
}

#: Collectives a forced plan must put in the module's code (one of each tuple;
#: bucketed_grad_sync: the data-parallel gradient all-reduce, outside the graph).
MUST_USE = {
    "dp": [("bucketed_grad_sync",), ("take_shard",), ("loss_denominator",)],
    "megatron": [("all_reduce_sum", "reduce_scatter_dim")],
    "reshard": [("all_to_all_dims",), ("loss_denominator",)],
    "2d": [("all_reduce_sum", "reduce_scatter_dim"), ("bucketed_grad_sync",), ("take_shard",)],
    "vocab": [("vocab_parallel_embedding",)],
    "heads": [("all_reduce_sum", "reduce_scatter_dim")],
    "batch_heads": [("all_reduce_sum", "reduce_scatter_dim"), ("bucketed_grad_sync",)],
}

def _report(mesh_shape, results) -> list[str]:
    failures = []
    for i, case in enumerate(results[0]):
        label = f"{case['case']['model']}/{case['case']['plan']} on {mesh_shape}"
        sgd, adamw = case["sgd"], case["adamw"]
        print(f"{label}: loss rel {max(sgd['max_rel_loss'], adamw['max_rel_loss']):.1e}, grad rel "
              f"{sgd['max_rel_grad']:.1e}, params rel (SGD) {sgd['max_rel_param']:.1e}, abs "
              f"(AdamW) {adamw['max_abs_param']:.1e} (fp32 vs fp64 serial: "
              f"{adamw['fp32_noise_abs_param']:.1e}), bytes/rank {case['bytes']} "
              f"(plan {case['expected_bytes']}), {case['buckets']} gradient buckets, "
              f"{case['seconds']:.1f} s")
        checks = [
            (max(sgd["max_rel_loss"], adamw["max_rel_loss"]) <= TOL, "losses differ"),
            (sgd["max_rel_grad"] <= TOL, f"gradient {sgd['worst_grad']} differs"),
            (sgd["max_rel_param"] <= TOL, f"SGD parameter {sgd['worst_param']} differs"),
            (adamw["max_abs_param"] <= max(TOL, adamw["fp32_noise_abs_param"]),
             f"AdamW parameter {adamw['worst_param']} differs"),
            (all(r[i]["bytes"] == case["expected_bytes"] for r in results),
             f"parameter bytes {[r[i]['bytes'] for r in results]} != {case['expected_bytes']}"),
            (sgd["grads_compared"] > 0 and sgd["compared"] > 0, "nothing compared"),
        ]
        used = {n for n in COLLECTIVE_NAMES if n + "(" in case["code"]}
        if case["buckets"]:
            used.add("bucketed_grad_sync")
        missing = [names for names in MUST_USE.get(case["case"]["plan"], [])
                   if not used.intersection(names)]
        checks.append((not missing, f"the plan does not exercise {missing}"))
        failures += [f"{label}: {msg}" for ok, msg in checks if not ok]
    return failures


@pytest.mark.parametrize("mesh_shape", sorted(CASES))
def test_parallel_training_equals_serial(mesh_shape):
    mesh = DeviceMesh(mesh_shape)
    cases = [{"model": m, "mesh": mesh.to_dict(), "plan": p} for m, p in CASES[mesh_shape]]
    results = run_on_gloo(train_cases, mesh.size, cases, timeout_s=600)
    failures = _report(mesh_shape, results)
    assert not failures, "\n".join(failures)


def test_adamw_on_the_rounding_sensitive_resnet_in_float64():
    """The ResNet case whose fp32 AdamW parameters are rounding-chaotic (see TOL),
    in float64: plan, generated module and serial model agree within 1e-5."""
    mesh = DeviceMesh((4,))
    cases = [{"model": "resnet", "mesh": mesh.to_dict(), "plan": "solver_slow",
              "dtype": "float64"}]
    results = run_on_gloo(train_cases, mesh.size, cases, timeout_s=600)
    adamw = results[0][0]["adamw"]
    assert adamw["fp32_noise_abs_param"] == 0  # the reference is the float64 serial run
    failures = _report((4,), results)
    assert not failures, "\n".join(failures)
    assert adamw["max_abs_param"] <= TOL
