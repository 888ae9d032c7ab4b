"""A CPU step is profiled on meta tensors (issue 15: GPT-2 small's profile
about 2.5x faster than on FakeTensors): every figure of the profile is the
FakeTensor step's; a graph whose kernels choose by device is profiled on
FakeTensors (and a step meta kernels refuse: ``test_profiling.py``'s
``test_a_backward_that_reads_values_is_a_trace_error_naming_it``)."""

from __future__ import annotations

import dataclasses

import pytest

from automap.trace import profiling
from automap.trace.tracing import trace
from model_matrix import build

_FIELDS = ("device", "optimizer", "parameter_bytes", "gradient_bytes", "optimizer_state_bytes",
           "buffer_bytes", "input_bytes", "peak_memory_bytes", "peak_location",
           "peak_breakdown", "phase_peak_bytes", "fwd_flops", "bwd_flops", "nodes")


def _recording_where_it_runs(monkeypatch) -> list[str]:
    """The device type of each step ``profile_traced`` runs, from now on."""
    ran_on: list[str] = []
    step = profiling._profiled_step
    monkeypatch.setattr(profiling, "_profiled_step",
                        lambda t, o, d, on: ran_on.append(on.type) or step(t, o, d, on))
    return ran_on


def _profiles(monkeypatch, traced, optimizer="adamw"):
    ran_on = _recording_where_it_runs(monkeypatch)
    on_meta = profiling.profile_traced(traced, optimizer)
    monkeypatch.setattr(profiling, "PROFILE_CPU_ON_META", False)
    fake = profiling.profile_traced(traced, optimizer)
    return on_meta, fake, ran_on


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, optimizer", [
    ("gpt2", "adamw"), ("mixtral", "sgd_momentum"), ("t5", "adam"), ("complex_rotary", "sgd"),
    ("dropout", None)])
def test_a_cpu_profile_on_meta_tensors_is_the_fake_profile(monkeypatch, name, optimizer):
    model, inputs, loss_fn = build(name)
    traced = trace(model, inputs, loss_fn=loss_fn)
    on_meta, fake, ran_on = _profiles(monkeypatch, traced, optimizer)
    assert ran_on == ["meta", "cpu"]
    for name_ in _FIELDS:
        assert getattr(on_meta, name_) == getattr(fake, name_), name_
    assert [dataclasses.asdict(n) for n in on_meta.nodes] == \
        [dataclasses.asdict(n) for n in fake.nodes]


@pytest.mark.parametrize("name", ["lstm", "convnext"])
def test_graphs_whose_kernels_choose_by_device_are_profiled_on_fake_tensors(monkeypatch, name):
    model, inputs, loss_fn = build(name)
    traced = trace(model, inputs, loss_fn=loss_fn)
    ran_on = _recording_where_it_runs(monkeypatch)
    profiling.profile_traced(traced, "adamw")
    assert ran_on == ["cpu"]
