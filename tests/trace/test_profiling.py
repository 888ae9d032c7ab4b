"""Symbolic profiling: memory categories on hand-computable cases, and estimates against
real CPU execution (peak of live tensor bytes from the profiler's allocation events,
FLOPs from FlopCounterMode on real tensors)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from torch import nn

import model_zoo
from automap.cli import estimate as estimate_cli
from automap.errors import AutomapError, TraceError
from automap.trace.profiling import BACKWARD, FORWARD, profile, profile_traced
from automap.trace.tracing import TracedGraph, trace

F32 = 4


def _sum(out: torch.Tensor) -> torch.Tensor:
    return out.sum()


def _profile_and_measure(model, inputs, optimizer=None):
    estimate = profile(model, inputs, optimizer, loss_fn=_sum)
    measured = model_zoo.measure_step(model, inputs, _sum, optimizer)
    return estimate, measured


def test_one_linear_exactly():
    torch.manual_seed(0)
    model, x = nn.Linear(8, 16), torch.randn(4, 8)
    p, real = _profile_and_measure(model, (x,))
    w_bytes, b_bytes, x_bytes, y_bytes = 16 * 8 * F32, 16 * F32, 4 * 8 * F32, 4 * 16 * F32
    assert p.parameter_bytes == p.gradient_bytes == w_bytes + b_bytes
    assert p.input_bytes == x_bytes
    linear = p.by_name["linear"]
    assert linear.fwd_flops == 2 * 4 * 8 * 16
    assert linear.bwd_flops == 2 * 4 * 8 * 16  # the weight gradient; x needs none
    assert linear.fwd_in_bytes == x_bytes  # saved for the weight gradient
    assert linear.fwd_tmp_bytes == 0
    assert linear.fwd_out_bytes == y_bytes
    assert linear.bwd_out_bytes == w_bytes + b_bytes
    # Peak at the weight gradient: parameters, x, the loss, backward's seed, the weight
    # gradient, and mm's dense copy of the expanded gradient of the sum.
    expected_peak = (w_bytes + b_bytes) + x_bytes + F32 + F32 + w_bytes + y_bytes
    assert p.peak_memory_bytes == expected_peak == real.peak_bytes
    assert (p.peak_location.phase, p.peak_location.node) == (BACKWARD, "linear")
    assert p.step_flops == real.flops


@pytest.mark.parametrize("inplace", [True, False])
def test_linear_relu_inplace_keeps_the_output_once(inplace):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=inplace))
    p, real = _profile_and_measure(model, (torch.randn(4, 8),))
    params, x_bytes, y_bytes = 16 * 8 * F32 + 16 * F32, 4 * 8 * F32, 4 * 16 * F32
    linear = p.by_name["linear"]
    relu = p.by_name["relu_" if inplace else "relu"]
    assert linear.fwd_out_bytes == y_bytes
    if inplace:
        # relu_ writes into the linear's output and saves it: no new storage.
        assert (relu.fwd_in_bytes, relu.fwd_out_bytes) == (y_bytes, 0)
        forward_peak = params + x_bytes + y_bytes + F32  # ends with the loss
    else:
        # relu saves its own output; the linear's output dies after it.
        assert (relu.fwd_in_bytes, relu.fwd_out_bytes) == (0, y_bytes)
        forward_peak = params + x_bytes + 2 * y_bytes  # during relu
    assert relu.bwd_out_bytes == y_bytes
    assert p.phase_peak_bytes[FORWARD] == forward_peak
    assert p.peak_memory_bytes == real.peak_bytes


@pytest.mark.parametrize("inplace", [True, False])
def test_batch_norm_then_inplace_relu_keeps_the_output_once(inplace):
    """The paper's nuance: BatchNorm saves its input, ReLU its output. In place, the
    ReLU's output is BatchNorm's output, so that tensor exists once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(inplace=inplace))
    p, real = _profile_and_measure(model, (torch.randn(4, 8),))
    act, stats = 4 * 16 * F32, 16 * F32
    bn = p.by_name["batch_norm"]
    assert (bn.fwd_in_bytes, bn.fwd_tmp_bytes, bn.fwd_out_bytes) == (act, 2 * stats, act)
    relu = p.by_name["relu_" if inplace else "relu"]
    assert (relu.fwd_in_bytes, relu.fwd_out_bytes) == ((act, 0) if inplace else (0, act))
    persistent = p.parameter_bytes + p.buffer_bytes + p.input_bytes
    # Linear output (saved by BN), BN output, batch statistics; then either the loss
    # (in place) or, during the ReLU, a second activation.
    last = F32 if inplace else act
    assert p.phase_peak_bytes[FORWARD] == persistent + act + act + 2 * stats + last
    assert p.peak_memory_bytes == real.peak_bytes


def test_a_tensor_two_nodes_save_counts_for_the_first_and_is_shared_by_the_second():
    """tanh saves its output and the linear after it saves its input, the same
    storage: it counts once, for tanh; the linear shares it (a sharded plan
    that converts it for the linear keeps the converted copy as well)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    p, real = _profile_and_measure(model, (torch.randn(4, 8),))
    act = 4 * 16 * F32
    tanh, linear = p.by_name["tanh"], p.by_name["linear_1"]
    assert (tanh.saved_output_bytes, tanh.shared_saved_bytes) == ({0: act}, {})
    assert (linear.fwd_in_bytes, linear.saved_input_bytes) == (0, {})
    assert linear.shared_saved_bytes == {"tanh": act}
    assert p.peak_memory_bytes == real.peak_bytes


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + x


class _Softmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.fc(x), dim=-1)


def test_residual_add_exactly():
    torch.manual_seed(0)
    p, real = _profile_and_measure(_Residual(), (torch.randn(4, 8),))
    x_bytes, w_bytes, b_bytes = 4 * 8 * F32, 8 * 8 * F32, 8 * F32
    add = p.by_name["add"]
    # add saves nothing and passes its gradient through without a copy.
    assert (add.fwd_in_bytes, add.fwd_tmp_bytes, add.fwd_out_bytes) == (0, 0, x_bytes)
    assert add.bwd_out_bytes == 0
    assert p.by_name["linear"].fwd_in_bytes == x_bytes
    expected_peak = (w_bytes + b_bytes) + x_bytes + F32 + F32 + w_bytes + x_bytes
    assert p.peak_memory_bytes == expected_peak == real.peak_bytes


def test_softmax_exactly():
    torch.manual_seed(0)
    p, real = _profile_and_measure(_Softmax(), (torch.randn(4, 8),))
    params, x_bytes, y_bytes = 16 * 8 * F32 + 16 * F32, 4 * 8 * F32, 4 * 16 * F32
    softmax = p.by_name["softmax"]
    # softmax saves its output (counted as fwd_out), not its input.
    assert (softmax.fwd_in_bytes, softmax.fwd_tmp_bytes, softmax.fwd_out_bytes) == (0, 0, y_bytes)
    assert softmax.bwd_out_bytes == y_bytes
    assert p.phase_peak_bytes[FORWARD] == params + x_bytes + 2 * y_bytes
    assert p.peak_memory_bytes == real.peak_bytes


class _CrossEntropy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(x), target)


def test_a_losss_intermediate_gradient_is_a_temporary_of_its_backward():
    """cross_entropy's backward runs nll_loss's grad_fn, whose gradient
    log_softmax's then reads and replaces: one logits-sized gradient
    outlives the node's backward, the other is a temporary of it (counted
    as an output too, the loss's gradient was modelled held twice after its
    kernels: GPT-2 small on (4,4,4), checkpointed, 10.6 % over its step)."""
    torch.manual_seed(0)
    model = _CrossEntropy()
    inputs = (torch.randn(4, 8), torch.randint(0, 16, (4,)))
    p = profile(model, inputs, None, loss_fn=lambda out: out)
    measured = model_zoo.measure_step(model, inputs, lambda out: out, None)
    logits_bytes = 4 * 16 * F32
    loss = p.by_name["cross_entropy_loss"]
    assert loss.bwd_out_bytes == logits_bytes
    assert loss.bwd_tmp_bytes == logits_bytes
    assert p.peak_memory_bytes == measured.peak_bytes


@pytest.mark.parametrize(
    ("optimizer", "state_bytes"),
    [
        ("sgd", lambda p, n: 0),
        ("sgd_momentum", lambda p, n: p),
        ("adam", lambda p, n: 2 * p + F32 * n),  # two moments and a float32 step each
        ("adamw", lambda p, n: 2 * p + F32 * n),
        (None, lambda p, n: 0),
    ],
)
def test_optimizer_state_bytes(optimizer, state_bytes):
    model, inputs, loss_fn = model_zoo.mlp()
    p = profile(model, inputs, optimizer, loss_fn=loss_fn)
    param_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    n_tensors = len(list(model.parameters()))
    assert p.parameter_bytes == p.gradient_bytes == param_bytes
    assert p.optimizer_state_bytes == state_bytes(param_bytes, n_tensors)
    assert p.peak_breakdown["optimizer_state"] == p.optimizer_state_bytes


@pytest.mark.parametrize("name", ["mlp", "resnet", "gpt2"])
def test_estimate_matches_real_execution(name):
    torch.manual_seed(0)
    model, inputs, loss_fn = model_zoo.ZOO[name]()
    p = profile(model, inputs, "adamw", loss_fn=loss_fn)
    real = model_zoo.measure_step(model, inputs, loss_fn, "adamw")
    assert abs(p.peak_memory_bytes - real.peak_bytes) <= 0.05 * real.peak_bytes
    assert p.step_flops == real.flops


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["mlp", "gpt2", "llama"])
def test_estimate_matches_cuda_max_memory_allocated(name):
    torch.manual_seed(0)
    model, inputs, loss_fn = model_zoo.ZOO[name]("cuda")
    p = profile(model, inputs, "adamw", loss_fn=loss_fn, device="cuda")
    real = model_zoo.measure_step(model, inputs, loss_fn, "adamw")
    assert abs(p.peak_memory_bytes - real.peak_bytes) <= 0.05 * real.peak_bytes
    assert p.step_flops == real.flops


def test_meta_model_profiles_like_the_real_one():
    real_model, real_inputs, loss_fn = model_zoo.gpt2("cpu")
    meta_model, meta_inputs, _ = model_zoo.gpt2("meta")
    real = profile(real_model, real_inputs, loss_fn=loss_fn)
    meta = profile(meta_model, meta_inputs, loss_fn=loss_fn, device="cpu")
    assert meta.peak_memory_bytes == real.peak_memory_bytes
    assert meta.step_flops == real.step_flops
    # Tied wte/lm_head: one tensor, one gradient.
    unique = sum(t.numel() * t.element_size() for t in real_model.parameters())
    assert meta.parameter_bytes == meta.gradient_bytes == unique
    assert all(t.is_meta for t in meta_model.parameters())


def test_functional_core_aten_graph_profiles_the_same():
    """Older torch exports a functional IR whose outputs start with buffer mutations."""
    model, inputs, loss_fn = model_zoo.resnet()
    traced = trace(model, inputs, loss_fn=loss_fn)
    functional = TracedGraph(traced.exported.run_decompositions(), model, has_loss=True)
    assert functional.user_output_index > 0  # the BatchNorm running statistics come first
    a, b = profile_traced(traced), profile_traced(functional)
    assert b.step_flops == a.step_flops
    assert abs(b.peak_memory_bytes - a.peak_memory_bytes) <= 0.01 * a.peak_memory_bytes


def test_table_json_and_text():
    model, inputs, loss_fn = model_zoo.resnet()
    p = profile(model, inputs, "sgd_momentum", loss_fn=loss_fn)
    rows = p.to_dicts()
    assert [r["name"] for r in rows] == [n.name for n in p.nodes]
    bn = next(r for r in rows if r["op"] == "aten.batch_norm.default")
    assert bn["module_path"] == "stem.1" and bn["fwd_tmp_bytes"] > 0  # batch statistics
    data = json.loads(p.to_json())
    assert data["nodes"] == rows
    assert data["summary"]["peak_memory_bytes"] == p.peak_memory_bytes
    assert data["summary"]["step_flops"] == p.step_flops == p.fwd_flops + p.bwd_flops
    text = str(p)
    assert "peak of a training step" in text and "conv2d" in text
    assert sum(p.peak_breakdown.values()) == p.peak_memory_bytes


def test_profile_needs_a_loss_and_a_known_optimizer():
    model, inputs, _ = model_zoo.mlp()
    with pytest.raises(TraceError, match="loss"):
        profile_traced(trace(model, inputs))
    with pytest.raises(AutomapError, match="unknown optimizer"):
        profile(model, inputs, "lamb")


def test_estimate_cli(tmp_path, capsys):
    factory = tmp_path / "factory.py"
    factory.write_text(
        "import torch\n"
        "def build(batch_size):\n"
        "    with torch.device('meta'):\n"
        "        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU())\n"
        "        return model, (torch.randn(batch_size, 32),)\n"
    )
    parser = argparse.ArgumentParser()
    estimate_cli.register(parser.add_subparsers(dest="command"))
    out_json = tmp_path / "profile.json"
    args = parser.parse_args(
        ["estimate", f"{factory}:build", "--batch", "8", "--device", "cpu", "--json", str(out_json)]
    )
    assert args.run(args) == 0
    printed = capsys.readouterr().out
    expected = profile(*estimate_cli.load_factory(f"{factory}:build")(8), device="cpu")
    assert "Sequential on one cpu device, batch 8" in printed
    assert f"{expected.peak_memory_bytes / 1024:.2f} KiB" in printed
    assert json.loads(out_json.read_text())["summary"]["peak_memory_bytes"] == (
        expected.peak_memory_bytes
    )
    args = parser.parse_args(["estimate", f"{factory}:missing"])
    assert args.run(args) == 1
    assert "no function 'missing'" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["sgd", "sgd_momentum", "adam", "adamw"])
def test_optimizer_state_is_created_as_the_optimizers_own_kernels_would(name):
    """Issue 15: the state-creating step runs the multi-tensor kernels (half the
    FakeTensor dispatches); the state is the one the optimizer's own kernels
    create, and the optimizer keeps its own kernels for the step profiled."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from automap.trace.profiling import OPTIMIZERS, create_optimizer_state, optimizer_tensors

    def state(create):
        with FakeTensorMode():
            params = [torch.empty(shape, requires_grad=True) for shape in ((3, 5), (7,), ())]
            opt = OPTIMIZERS[name](params, {"foreach": False})
            create(opt, params)
            kernels = [group["foreach"] for group in opt.param_groups]
            return [(tuple(t.shape), t.dtype, t.stride(), t.device)
                    for t in optimizer_tensors(opt)], kernels

    def own_kernels(opt, params):
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)

    assert state(create_optimizer_state) == state(own_kernels)
    assert state(create_optimizer_state)[1] == [False]


@torch.library.custom_op("automap_test::value_scaled", mutates_args=())
def _value_scaled(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return x * s


@_value_scaled.register_fake
def _(x, s):
    return torch.empty_like(x)


def _value_scaled_backward(ctx, grad):
    (s,) = ctx.saved_tensors
    return grad * s.tolist()[0], None  # a value: unknowable on FakeTensors


_value_scaled.register_autograd(
    _value_scaled_backward,
    setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[1]))


class _ReadsAValueInBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, s):
        return _value_scaled(self.fc(x), s).sum()


def test_a_backward_that_reads_values_is_a_trace_error_naming_it(monkeypatch):
    """A custom op's backward that reads a tensor's values (transformers 5.17's
    MoE fallback calls ``.tolist()``: Mixtral on torch 2.13) raised torch's
    untyped DataDependentOutputException from ``automap.plan``. The step on
    meta tensors fails untyped and the FakeTensor step names it."""
    from automap.trace import profiling

    ran_on = []
    step = profiling._profiled_step
    monkeypatch.setattr(profiling, "_profiled_step",
                        lambda t, o, d, on: ran_on.append(on.type) or step(t, o, d, on))
    with pytest.raises(TraceError, match=r"_value_scaled_backward \(.*test_profiling\.py:\d+\)"
                                         r": it reads tensor values"):
        profile(_ReadsAValueInBackward(), (torch.randn(2, 4), torch.tensor([2.0])), "adamw",
                loss_fn=lambda out: out)
    assert ran_on == ["meta", "cpu"]
