"""Plans are checked on load and against the graph, planning arguments before
any work, and ``explain`` says what the plan does without cutting or hiding it."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import automap
from automap import (
    DeviceMesh,
    InvalidArgumentError,
    InvalidPlanError,
    LimitExceededError,
    StalePlanError,
)
from automap.planner.plan import Plan, format_bytes
from automap.planner.validate import content_fingerprint
from automap.trace.tracing import trace


class _LongNames(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a_projection_with_a_really_long_descriptive_name = nn.Linear(16, 32)
        self.act = nn.ReLU()
        self.another_projection_whose_name_is_long_too = nn.Linear(32, 8)

    def forward(self, x):
        return self.another_projection_whose_name_is_long_too(
            self.act(self.a_projection_with_a_really_long_descriptive_name(x)))


def _loss(out):
    return out.pow(2).mean()


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    model, x = _LongNames(), torch.randn(8, 16)
    mesh = DeviceMesh((2,))
    p = automap.plan(model, (x,), mesh, loss_fn=_loss, flops_per_s=1e6)
    return model, x, mesh, p, trace(model, (x,), loss_fn=_loss)


def test_a_saved_plan_loads_and_matches(case, tmp_path):
    model, x, mesh, p, traced = case
    path = tmp_path / "plan.json"
    p.to_json(str(path))
    again = Plan.from_json(str(path))
    assert again.to_dict() == p.to_dict()
    again.check_matches(traced, mesh)


def _edited(p: Plan, edit, refingerprint: bool = False) -> dict:
    data = copy.deepcopy(p.to_dict())
    edit(data)
    if refingerprint:
        data["content_fingerprint"] = content_fingerprint(data)
    return data


def _node(data: dict, op: str) -> dict:
    return next(n for n in data["nodes"] if n["op"] == op)


def test_an_edited_plan_is_refused(case):
    _, _, _, p, traced = case

    def partial(data):
        _node(data, "linear")["partial_axes"] = [0]

    with pytest.raises(InvalidPlanError, match="content_fingerprint"):
        Plan.from_dict(_edited(p, partial))
    # Edited with the fingerprint recomputed: the graph check still refuses it,
    # since no strategy of a linear layer has these specs with these reductions.
    forged = Plan.from_dict(_edited(p, partial, refingerprint=True))
    with pytest.raises(InvalidPlanError, match="is not a strategy"):
        forged.check_matches(traced)


@pytest.mark.parametrize("edit, error, needle", [
    (lambda d: d.update(schema_version="1.0"), StalePlanError, "'1.0'"),
    (lambda d: d.update(schema_version=True), StalePlanError, "True"),
    (lambda d: d["mesh"].update(shape="22"), InvalidPlanError, "'22'"),
    (lambda d: d.update(predicted_step_s=math.nan), InvalidPlanError, "predicted_step_s"),
    (lambda d: d.update(memory_binding="yes"), InvalidPlanError, "memory_binding"),
    (lambda d: d.update(extra_field=1), InvalidPlanError, "extra_field"),
    (lambda d: d["nodes"][0].update(outputs=["S9"]), InvalidPlanError, "outputs"),
    (lambda d: d["nodes"][0].pop("kind"), InvalidPlanError, "kind"),
    (lambda d: d["edges"][0].update(producer="nowhere"), InvalidPlanError, "producer"),
    (lambda d: d["edges"][0].update(dtype_bytes=0), InvalidPlanError, "dtype_bytes"),
    (lambda d: _node(d, "linear").update(partial_axes=[5]), InvalidPlanError, "mesh axes"),
    (lambda d: d["inputs"]["args"][0].update(dtype="float99"), InvalidPlanError, "dtype"),
])
def test_malformed_plans_name_the_field(case, edit, error, needle):
    _, _, _, p, _ = case
    with pytest.raises(error) as err:
        Plan.from_dict(_edited(p, edit, refingerprint=True))
    assert needle in str(err.value)


def test_planning_arguments_are_checked_first(case):
    model, x, mesh, _, _ = case
    for kwargs, needle in [
        (dict(memory_budget_bytes=-1), "memory_budget_bytes"),
        (dict(memory_budget_bytes=math.nan), "memory_budget_bytes"),
        (dict(memory_budget_bytes=math.inf), "memory_budget_bytes"),
        (dict(flops_per_s=math.nan), "flops_per_s"),
        (dict(flops_per_s=1e-300), "flops_per_s"),
        (dict(flops_per_s=-5.0), "flops_per_s"),
        (dict(optimizer="lamb"), "optimizer"),
        (dict(time_limit_s=0), "time_limit_s"),
        (dict(checkpointing="sometimes", memory_budget_bytes=1e6), "checkpointing"),
    ]:
        with pytest.raises(InvalidArgumentError, match=needle):
            automap.plan(model, (x,), mesh, loss_fn=_loss, **kwargs)


def test_what_cannot_be_trained_is_a_typed_error(case, tmp_path):
    """Found by a sweep as a new user: a loss that is no scalar, a model with
    nothing to train, a mesh string naming no file and a binary plan file raised
    torch's or Python's own errors from deep inside planning."""
    model, x, mesh, _, _ = case
    for loss_fn, needle in [(lambda out: out.pow(2), r"shape \[8, 8\]"),
                            (lambda out: 3, "int")]:
        with pytest.raises(automap.TraceError, match="floating-point scalar") as err:
            automap.plan(model, (x,), mesh, loss_fn=loss_fn, flops_per_s=1e6)
        assert err.match(needle)
    with pytest.raises(InvalidArgumentError, match="nothing to train"):
        automap.plan(nn.ReLU(), (x,), mesh, loss_fn=_loss, flops_per_s=1e6)
    # A loss that is no callable was torch.export's TypeError, worded as a trace failure.
    with pytest.raises(InvalidArgumentError, match="loss_fn must be .* got int"):
        automap.plan(model, (x,), mesh, loss_fn=3, flops_per_s=1e6)
    with pytest.raises(automap.InvalidMeshError, match="path to a cluster JSON"):
        automap.plan(model, (x,), "2x2", loss_fn=_loss, flops_per_s=1e6)
    binary = tmp_path / "plan.json"
    binary.write_bytes(bytes(range(256)))
    with pytest.raises(InvalidPlanError, match="not UTF-8"):
        Plan.from_json(str(binary))


def test_from_json_takes_the_text_to_json_returns(case):
    """``to_json()`` without a path returns the text; ``from_json`` of that text
    raised ``OSError: File name too long`` with the whole plan in its message
    (a new-user sweep)."""
    _, _, _, p, _ = case
    assert Plan.from_json(p.to_json()).to_dict() == p.to_dict()
    with pytest.raises(InvalidPlanError, match="JSON text given is not a plan"):
        Plan.from_json(p.to_json()[:-40])


def test_no_optimizer_state_is_a_valid_plan(case):
    model, x, mesh, p, _ = case
    none = automap.plan(model, (x,), mesh, loss_fn=_loss, flops_per_s=1e6, optimizer=None)
    assert none.predicted_peak_memory_bytes < p.predicted_peak_memory_bytes


def test_slow_links_out_of_range_are_refused():
    with pytest.raises(automap.InvalidMeshError, match="bandwidth_bytes_per_s"):
        DeviceMesh((2,), bandwidth_bytes_per_s=1e-300)
    with pytest.raises(LimitExceededError, match="at most 1048576"):
        DeviceMesh((10**6, 10**6))


def test_explain_shows_full_names_counts_and_what_is_left_out(case):
    _, _, _, p, _ = case
    text = p.explain(max_rows=3)
    longest = max((n for n in p.nodes.values() if n.kind != "output"),
                  key=lambda n: len(n.name)).name
    assert len(longest) > 28
    full = p.explain(max_rows=None)
    assert longest in full
    listed = len([n for n in p.nodes.values() if n.kind != "output"])
    assert f"... and {listed - 3} more nodes" in text
    assert "more nodes" not in full
    assert "inside nodes" in text and "between nodes" in text
    # The peak by category: the simulated step's breakdown, summing to the peak.
    assert "from the simulated step" in text
    for category, nbytes in p.memory_breakdown.items():
        if nbytes > 0:
            assert f"  {category} " in text
    assert abs(sum(p.memory_breakdown.values()) - p.predicted_peak_memory_bytes) <= 1
    for n in p.nodes.values():
        outputs = [tuple(a["outputs"]) for a in n.alternatives]
        assert len(outputs) == len(set(outputs)), n.name
        assert tuple(n.outputs) not in outputs


def test_verbose_planning_names_the_budget(case, capsys):
    model, x, mesh, fastest, _ = case
    with pytest.raises(automap.InfeasibleBudgetError) as err:
        automap.plan(model, (x,), mesh, 100, loss_fn=_loss, flops_per_s=1e6)
    least = err.value.smallest_feasible_budget_bytes
    budget = (least + fastest.predicted_peak_memory_bytes) / 2  # binds, yet fits
    capsys.readouterr()
    automap.plan(model, (x,), mesh, budget, loss_fn=_loss, flops_per_s=1e6, verbose=True)
    printed = capsys.readouterr().err  # progress goes to stderr; stdout is for results
    assert "unlimited" not in printed
    assert "no memory limit" in printed  # the fastest plan, solved first
    assert f"memory budget of {format_bytes(budget)}" in printed, printed


def test_checkpoint_counts_are_worded(case):
    from automap.checkpoint.record import CheckpointPlan

    ck = CheckpointPlan(stages=[["a"], ["b"]], blocks=[{"start_stage": 0, "end_stage": 0,
                                                        "children": []}],
                        activation_budget_bytes=100, persistent_bytes=10,
                        predicted_activation_peak_bytes=90, recompute_s=1e-3,
                        ilp_budget_bytes=None, timeline=[("forward_checkpoint", 0, 50)])
    assert "1 checkpoint block," in ck.describe()[0]
    ck.blocks = []
    lines = ck.describe()
    assert lines[0].startswith("activation checkpointing: none needed")
    assert not any("timeline" in line for line in lines)


def test_an_input_of_another_dtype_than_the_model_is_refused_when_traced():
    """Eager PyTorch refuses a float32 input to a float64 Linear; fake tensors
    do not, so the plan was made and the first call failed inside torch."""
    model = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    with pytest.raises(automap.TraceError, match=r"linear .* \['float32', 'float64'\]"):
        automap.plan(model, (torch.randn(4, 16),), DeviceMesh((2,)), loss_fn=_loss,
                     flops_per_s=1e6)


def test_planning_inside_no_grad_plans_the_training_step(case):
    """Planning from an evaluation loop (under ``torch.no_grad()``) plans the
    training step as it does outside (it failed with autograd's raw error)."""
    model, x, mesh, p, traced = case
    with torch.no_grad():
        inside = automap.plan(model, (x,), mesh, loss_fn=_loss, flops_per_s=1e6)
        again = trace(model, (x,), loss_fn=_loss)
    assert inside.to_dict()["nodes"] == p.to_dict()["nodes"]
    assert inside.predicted_step_s == p.predicted_step_s
    inside.check_matches(again, mesh)
