"""The simulated step of a CPU plan runs on meta tensors (issue 15: half the
time of FakeTensors, GPT-2 small on (2,2,2) 1.2 s against 2.0-2.7 s): every
byte of its timeline is the FakeTensor step's, whatever the model (dropout's
generator states, checkpoint regions, attention's kernels, experts, each
optimizer's kernels; graphs whose kernels choose by device run on FakeTensors)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import automap
from automap import DeviceMesh
from automap.generate import simulate
from automap.generate.simulate import simulate_step
from automap.trace.cpu_on_meta import cpu_attention, runs_as_on_cpu
from automap.trace.tracing import trace
from model_matrix import build as build_matrix_model
from model_zoo import gpt2, mlp, resnet
from speeds import speeds

SPEEDS = speeds(1e9)


def _both(monkeypatch, traced, found, **options):
    on_meta = simulate_step(traced, found, **options)
    monkeypatch.setattr(simulate, "SIMULATE_CPU_ON_META", False)
    fake = simulate_step(traced, found, **options)
    monkeypatch.setattr(simulate, "SIMULATE_CPU_ON_META", True)
    return on_meta, fake


@pytest.mark.timeout(300)
@pytest.mark.parametrize("build, mesh, budget_fraction, optimizer, impl", [
    (gpt2, (2, 2), 0.5, "adamw", "auto"),
    (resnet, (2,), 0.8, "sgd_momentum", "foreach"),
    (mlp, (2, 2), None, "adamw", "fused"),
    (mlp, (4,), None, "sgd", "auto"),
], ids=["gpt2-dropout-checkpointed", "resnet-batchnorm", "mlp-fused", "mlp-sgd"])
def test_a_cpu_step_on_meta_tensors_is_the_fake_step(monkeypatch, build, mesh, budget_fraction,
                                                     optimizer, impl):
    model, inputs, loss_fn = build()
    mesh = DeviceMesh(mesh, backend="gloo")
    options = dict(loss_fn=loss_fn, optimizer=optimizer, optimizer_impl=impl, **SPEEDS)
    found = automap.plan(model, inputs, mesh, **options)
    if budget_fraction is not None:
        # The fastest plan checkpointed: its regions (and RNG stashes) run again.
        found = automap.plan(model, inputs, mesh,
                             found.predicted_peak_memory_bytes * budget_fraction,
                             checkpointing="only", **options)
        assert found.checkpoint is not None
    traced = trace(model, inputs, loss_fn=loss_fn)
    on_meta, fake = _both(monkeypatch, traced, found, optimizer=optimizer, optimizer_impl=impl)
    assert on_meta.peak_bytes == fake.peak_bytes
    assert on_meta.phase == fake.phase
    assert on_meta.breakdown == fake.breakdown
    assert on_meta.phase_peak_bytes == fake.phase_peak_bytes
    assert [s["bytes"] for s in on_meta.timeline] == [s["bytes"] for s in fake.timeline]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["mixtral", "t5", "bart", "complex_rotary", "convnext",
                                  "lstm"])
def test_the_model_matrix_steps_on_meta_as_on_fake_tensors(monkeypatch, name):
    """Experts, encoder-decoders, unbatched attention; ConvNeXt's depthwise
    convolutions and recurrent layers (simulated on FakeTensors: their
    kernels choose by device)."""
    model, inputs, loss_fn = build_matrix_model(name)
    found = automap.plan(model, inputs, DeviceMesh((2, 2), backend="gloo"), loss_fn=loss_fn,
                         verify=False, **SPEEDS)
    traced = trace(model, inputs, loss_fn=loss_fn)
    assert runs_as_on_cpu(traced.graph) == (name not in ("convnext", "lstm"))
    on_meta, fake = _both(monkeypatch, traced, found)
    assert on_meta.peak_bytes == fake.peak_bytes
    assert [s["bytes"] for s in on_meta.timeline] == [s["bytes"] for s in fake.timeline]


class _Allocations(TorchDispatchMode):
    """The shapes and strides of every tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is not torch.ops.prim.device.default:
            self.made += [(str(func), tuple(t.shape), t.stride())
                          for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


@pytest.mark.parametrize("q_shape, kv_heads, mask_shape, mask_dtype, dropout_p, causal", [
    ((2, 4, 17, 16), 4, None, None, 0.0, True),
    ((2, 4, 17, 16), 4, (1, 1, 17, 17), torch.bool, 0.0, False),
    ((2, 4, 17, 16), 4, (17, 17), torch.float32, 0.0, False),
    ((4, 17, 16), 4, (17, 17), torch.bool, 0.0, False),
    ((2, 4, 17, 16), 4, None, None, 0.1, False),
    ((2, 4, 17, 16), 2, None, None, 0.0, True),
], ids=["causal", "bool-mask", "float-mask", "unbatched", "dropout-math", "grouped-query"])
def test_attention_on_meta_runs_the_cpus_kernel(q_shape, kv_heads, mask_shape, mask_dtype,
                                                 dropout_p, causal):
    """``cpu_attention`` on meta tensors makes, forward and backward, what the
    composite makes on FakeTensors of the CPU."""
    kv_shape = q_shape[:-3] + (kv_heads,) + q_shape[-2:]

    def run(device, attention):
        q = torch.empty(q_shape, device=device, requires_grad=True)
        k = torch.empty(kv_shape, device=device, requires_grad=True)
        v = torch.empty(kv_shape, device=device, requires_grad=True)
        mask = None if mask_shape is None else torch.empty(mask_shape, dtype=mask_dtype,
                                                           device=device)
        with _Allocations() as record:
            out = attention(q, k, v, mask, dropout_p, causal, enable_gqa=kv_heads != q_shape[-3])
            out.sum().backward()
        return record.made

    with torch.random.fork_rng():
        on_meta = run("meta", cpu_attention)
    with FakeTensorMode(), torch.random.fork_rng():
        fake = run("cpu", torch.ops.aten.scaled_dot_product_attention.default)
    assert on_meta == fake
