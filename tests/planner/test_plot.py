"""Pictures of a plan: the simulated step's memory timeline stored in the Plan
(its largest sample is the predicted peak, by category as the breakdown), its
JSON round trip and checks, the PNGs of ``Plan.plot`` and ``Plan.plot_memory``
(with a measured curve), ``automap explain --plot``, and the typed message
when matplotlib is missing."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import automap
from automap.errors import InvalidArgumentError, InvalidPlanError
from automap.generate.simulate import CATEGORIES
from automap.planner.plot import MeasuredMemory, PlotDependencyError, sharding_kind
from automap.planner.validate import content_fingerprint
from model_zoo import gpt2

PNG = b"\x89PNG\r\n\x1a\n"
SPEEDS = {"flops_per_s": 30e12, "memory_bandwidth_bytes_per_s": 1.5e12, "op_overhead_s": 5e-6}


@pytest.fixture(scope="module")
def tight_plan():
    """GPT-2 tiny on (2, 2) within 45 % of its unconstrained peak."""
    model, inputs, loss = gpt2("meta")
    mesh = automap.DeviceMesh((2, 2))
    free = automap.plan(model, inputs, mesh, loss_fn=loss, **SPEEDS)
    return automap.plan(model, inputs, mesh, loss_fn=loss, **SPEEDS,
                        memory_budget_bytes=0.45 * free.predicted_peak_memory_bytes)


def test_timeline_peaks_at_the_predicted_peak(tight_plan):
    timeline = tight_plan.memory_timeline
    assert timeline["categories"] == list(CATEGORIES)
    samples = timeline["samples"]
    assert 10 < len(samples) <= 400
    assert [s["at"] for s in samples] == sorted(s["at"] for s in samples)
    assert {s["phase"] for s in samples} == {"forward", "backward", "optimizer"}
    top = max(samples, key=lambda s: sum(s["bytes"]))
    assert sum(top["bytes"]) == tight_plan.predicted_peak_memory_bytes
    assert dict(zip(CATEGORIES, top["bytes"])) == tight_plan.memory_breakdown
    assert tight_plan.predicted_peak_memory_bytes <= tight_plan.memory_budget_bytes


def test_timeline_round_trips_and_is_checked(tight_plan):
    data = tight_plan.to_dict()
    again = automap.Plan.from_dict(json.loads(json.dumps(data)))
    assert again.memory_timeline == tight_plan.memory_timeline
    # A plan without the timeline (unverified, or written before it existed) loads.
    older = dict(data)
    del older["memory_timeline"]
    older["content_fingerprint"] = content_fingerprint(older)
    assert automap.Plan.from_dict(older).memory_timeline is None
    # A malformed timeline is refused, naming the field.
    bad = json.loads(json.dumps(data))
    bad["memory_timeline"]["samples"][0]["bytes"].append(1)
    bad["content_fingerprint"] = content_fingerprint(bad)
    with pytest.raises(InvalidPlanError, match=r"memory_timeline.samples\[0\].bytes"):
        automap.Plan.from_dict(bad)
    bad["memory_timeline"]["samples"][0]["bytes"].pop()
    bad["memory_timeline"]["samples"][0]["at"] = 1.5
    bad["content_fingerprint"] = content_fingerprint(bad)
    with pytest.raises(InvalidPlanError, match="fraction of the step"):
        automap.Plan.from_dict(bad)


def test_pictures_are_written(tight_plan, tmp_path):
    plan_png = tight_plan.plot(str(tmp_path / "plan.png"))
    peak = tight_plan.predicted_peak_memory_bytes
    measured = [(0.0, 0.5 * peak), (0.5, 0.9 * peak), (1.0, 0.6 * peak)]
    memory_png = tight_plan.plot_memory(str(tmp_path / "memory.png"), measured=measured)
    for path in (plan_png, memory_png):
        data = open(path, "rb").read()
        assert data.startswith(PNG) and len(data) > 20_000


def test_unknown_picture_formats_are_refused(tight_plan, tmp_path):
    with pytest.raises(InvalidArgumentError, match="'doc'.*png"):
        tight_plan.plot(str(tmp_path / "plan.doc"))
    with pytest.raises(InvalidArgumentError, match="no suffix"):
        tight_plan.plot_memory(str(tmp_path / "memory"))


def test_sharding_kinds_name_each_axis(tight_plan):
    kinds = {sharding_kind(n, 2) for n in tight_plan.nodes.values()}
    assert "replicated" in kinds
    assert any("axis" in k for k in kinds)


def test_plot_memory_needs_a_timeline(tight_plan, tmp_path):
    plan = automap.Plan.from_dict(tight_plan.to_dict())
    plan.memory_timeline = None
    with pytest.raises(InvalidArgumentError, match="memory_timeline"):
        plan.plot_memory(str(tmp_path / "memory.png"))
    assert not (tmp_path / "memory.png").exists()


def test_missing_matplotlib_names_the_extra(tight_plan, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    with pytest.raises(PlotDependencyError, match=r"pip install automap\[plot\]") as err:
        tight_plan.plot(str(tmp_path / "plan.png"))
    assert isinstance(err.value, (automap.AutomapError, ImportError))
    with pytest.raises(PlotDependencyError):
        tight_plan.plot_memory(str(tmp_path / "memory.png"))


@pytest.mark.parametrize("at, values, match", [
    ((0.0, 0.5), (1.0,), "equally long"), ((0.0, 2.0), (1.0, 1.0), "0.0 to 1.0"),
    ((0.5, 0.2), (1.0, 1.0), "must not decrease"), ((0.0,), (-1.0,), "bytes"),
])
def test_measured_memory_is_checked(at, values, match):
    with pytest.raises(InvalidArgumentError, match=match):
        MeasuredMemory(at, values)


def test_measured_memory_from_the_profiler():
    model = torch.nn.Linear(64, 64)
    x = torch.randn(32, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        model(x).square().sum().backward()
    measured = MeasuredMemory.from_profiler(prof, base_bytes=1000)
    assert measured.at[0] == 0.0 and measured.at[-1] == 1.0
    assert max(measured.bytes) >= 1000 + 32 * 64 * 4


def test_explain_plot_writes_both_pictures(tight_plan, tmp_path, capsys):
    from automap.cli import main

    path = tmp_path / "plan.json"
    tight_plan.to_json(str(path))
    out = tmp_path / "pictures"
    assert main(["explain", str(path), "--plot", str(out)]) == 0
    assert "memory.png" in capsys.readouterr().out
    for name in ("plan.png", "memory.png"):
        assert (out / name).read_bytes().startswith(PNG)


def test_a_long_timeline_keeps_the_peak(tight_plan, monkeypatch):
    """Merged down to a few samples, the largest is still the step's peak."""
    from automap.generate import simulate
    from automap.planner.reserve import HEADROOM, reserved
    from automap.trace.tracing import trace

    monkeypatch.setattr(simulate, "MAX_TIMELINE_SAMPLES", 7)
    model, inputs, loss = gpt2("meta")
    step = simulate.simulate_step(trace(model, inputs, loss_fn=loss), tight_plan)
    assert len(step.timeline) <= 7
    assert max(sum(s["bytes"]) for s in step.timeline) == step.peak_bytes
    kept = reserved(step, HEADROOM)
    assert kept.peak_bytes == tight_plan.predicted_peak_memory_bytes
    assert max(sum(s["bytes"]) for s in kept.timeline["samples"]) == kept.peak_bytes


def test_explain_plot_without_matplotlib_is_one_line(tight_plan, tmp_path, capsys, monkeypatch):
    from automap.cli import main

    path = tmp_path / "plan.json"
    tight_plan.to_json(str(path))
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["explain", str(path), "--plot", str(tmp_path / "pictures")]) == 1
    assert "pip install automap[plot]" in capsys.readouterr().err
