"""Tracing: torch.export graphs with shapes, dtypes, module paths, parameters, ties."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import model_zoo
from automap.errors import TraceError
from automap.trace import hf_compat
from automap.trace.tracing import default_loss, normalize_module_path, trace


def _ops(traced) -> list[str]:
    return [n.op for n in traced.nodes.values() if n.op.startswith("aten.")]


def test_mlp_nodes_have_shape_dtype_and_module_path():
    model, inputs, _ = model_zoo.mlp()
    traced = trace(model, inputs)
    fc1 = next(n for n in traced.nodes.values() if n.module_path == "fc1" and n.module_type)
    assert fc1.op == "aten.linear.default"
    assert fc1.module_type == "Linear"
    assert [o.shape for o in fc1.outputs] == [(32, 256)]
    assert fc1.outputs[0].dtype == torch.float32
    assert fc1.outputs[0].nbytes == 32 * 256 * 4
    assert set(traced.parameters) == {n for n, _ in model.named_parameters()}
    assert traced.parameters["fc2.weight"].shape == (256, 256)
    assert traced.parameters["fc2.weight"].module_path == "fc2"
    assert traced.parameters["fc2.weight"].requires_grad
    assert not traced.buffers and not traced.tied_parameters and not traced.has_loss


def test_trace_keeps_each_submodule_mode():
    model, inputs, loss_fn = model_zoo.resnet()
    model.layer1.bn1.eval()  # e.g. a frozen BatchNorm in a training model
    traced = trace(model, inputs, loss_fn=loss_fn)
    assert model.training and not model.layer1.bn1.training
    # The frozen BatchNorm normalises with its running statistics: no batch statistics
    # and no update of its running mean in the graph.
    frozen = [n for n in traced.nodes.values() if n.module_path == "layer1.bn1"]
    assert [n.op for n in frozen] == ["placeholder"] * 5 + ["aten.batch_norm.default"]


def test_resnet_keeps_batch_norm_buffers_and_inplace_relu():
    model, inputs, loss_fn = model_zoo.resnet()
    traced = trace(model, inputs, loss_fn=loss_fn)
    assert "layer1.bn1.running_mean" in traced.buffers
    assert traced.buffers["layer1.bn1.num_batches_tracked"].dtype == torch.int64
    ops = _ops(traced)
    assert "aten.relu_.default" in ops and "aten.conv2d.default" in ops
    relu = [n for n in traced.nodes.values() if n.op == "aten.relu_.default"]
    assert {n.module_path for n in relu} >= {"stem.2", "layer1.relu", "layer2.relu"}
    # With the loss in the graph, its single output is the scalar loss.
    output = next(n for n in traced.graph.nodes if n.op == "output")
    (loss,) = output.args[0]
    assert traced.has_loss and tuple(loss.meta["val"].shape) == ()


def test_gpt2_on_meta_device_ties_wte_and_lm_head():
    model, inputs, loss_fn = model_zoo.gpt2("meta")
    traced = trace(model, inputs, loss_fn=loss_fn)
    assert traced.tied_parameters == [("transformer.wte.weight", "lm_head.weight")]
    wte, head = traced.parameters["transformer.wte.weight"], traced.parameters["lm_head.weight"]
    assert wte.canonical == head.canonical == "transformer.wte.weight"
    assert wte.shape == (model_zoo.VOCAB, model_zoo.HIDDEN)
    assert traced.device.type == "meta"
    # Nothing was materialised: the model still has no weights.
    assert all(p.is_meta for p in model.parameters())
    sdpa = [n for n in traced.nodes.values() if "scaled_dot_product" in n.op]
    assert [n.module_path for n in sdpa] == ["transformer.h.0.attn", "transformer.h.1.attn"]


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "vit"])
def test_hugging_face_models_trace_from_small_configs(name):
    model, inputs, loss_fn = model_zoo.ZOO[name]("meta")
    traced = trace(model, inputs, loss_fn=loss_fn)
    assert traced.has_loss
    n_params = len(dict(model.named_parameters(remove_duplicate=False)))
    assert len(traced.parameters) == n_params
    matmuls = [
        n for n in traced.nodes.values() if n.op in ("aten.linear.default", "aten.addmm.default")
    ]
    assert len(matmuls) >= 4 * model_zoo.LAYERS
    assert all(n.module_path for n in matmuls)


def test_hf_adjustments_do_not_change_the_model():
    model, inputs, loss_fn = model_zoo.gpt2("meta")
    before = model.config._attn_implementation
    traced = trace(model, inputs, loss_fn=loss_fn, attn_implementation="eager")
    assert model.config._attn_implementation == before
    ops = _ops(traced)
    assert "aten.softmax.int" in ops
    assert not any("scaled_dot_product" in op for op in ops)


def test_hf_compat_helpers():
    model, _, _ = model_zoo.gpt2("meta")
    assert hf_compat.is_hf_model(model) and not hf_compat.is_hf_model(nn.Linear(2, 2))
    assert hf_compat.call_kwargs(model) == {"use_cache": False, "return_dict": True}
    before = model.config._attn_implementation
    with hf_compat.adjusted(model, "eager"):
        assert model.config._attn_implementation == "eager"
    assert model.config._attn_implementation == before
    loss = torch.tensor(1.0)
    assert hf_compat.loss_from_output({"loss": loss}) is loss
    assert hf_compat.loss_from_output(torch.ones(2)) is None


def test_graph_is_retargeted_to_another_device():
    model, inputs, loss_fn = model_zoo.gpt2("meta")
    traced = trace(model, inputs, loss_fn=loss_fn)

    def devices(gm):
        found = set()
        for node in gm.graph.nodes:
            for value in (*node.args, *node.kwargs.values()):
                if isinstance(value, torch.device):
                    found.add(value.type)
        return found

    assert devices(traced.graph_module) == {"meta"}
    moved = traced.graph_module_on("cpu")
    assert devices(moved) == {"cpu"}
    assert [n.name for n in moved.graph.nodes] == [n.name for n in traced.graph.nodes]


def test_ordinary_model_is_traced_without_real_compute():
    seen = []

    class Spy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(isinstance(x, FakeTensor))
            return self.fc(x)

    traced = trace(Spy(), (torch.randn(2, 4),))
    assert seen and all(seen)
    assert traced.device.type == "cpu"


def test_untraceable_model_raises_trace_error_with_advice():
    class DataDependent(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # branches on a value, not on a shape
                return x * 2
            return x

    with pytest.raises(TraceError, match="could not trace DataDependent.*Try:"):
        trace(DataDependent(), (torch.randn(3),))


def test_default_loss_forms():
    scalar = torch.tensor(2.0)
    assert default_loss(scalar) is scalar
    assert default_loss({"loss": scalar, "logits": torch.ones(2)}) is scalar
    assert default_loss((torch.ones(2, 3),)).item() == 6.0
    # A loss returned first in a tuple is the loss, not summed (a pipeline
    # weighed the sum as a sum-reduced loss: twice the loss on two microbatches).
    assert default_loss((scalar, torch.ones(2, 3))) is scalar
    with pytest.raises(TraceError, match="loss_fn"):
        default_loss(torch.ones(2, dtype=torch.int64))


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("transformer.h.0.attn", "transformer.h.0.attn"),
        ("L['self'].transformer.h[0].attn", "transformer.h.0.attn"),
        ("L['self']._modules['layer1']", "layer1"),
        ("model.encoder.layers.1", "encoder.layers.1"),
        ("model", ""),
    ],
)
def test_module_paths_are_normalised(raw, expected):
    assert normalize_module_path(raw) == expected


def test_one_tensor_passed_twice_stays_two_inputs():
    class Two(torch.nn.Module):
        def forward(self, a, b):
            return (a * 2 - b).sum()

    x = torch.randn(3)
    traced = trace(Two(), (x, x))
    assert len(traced.user_input_nodes) == 2


def test_operands_of_two_dtypes_are_refused_where_eager_refuses_them():
    """Fake tensors do not check a matmul's operand dtypes: a float32 input through
    a LayerNorm without weights into a float64 model's Linear traced and planned,
    and failed at the generated module's first call on every rank."""
    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(8, elementwise_affine=False)
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(self.norm(x)).sum()

    model = Normed().double()
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 8))  # eager refuses it
    with pytest.raises(TraceError, match="float32"):
        trace(model, (torch.randn(2, 8),))
    trace(model, (torch.randn(2, 8, dtype=torch.float64),))  # one dtype: traced


class _MaskedSum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return h[h > 0].sum()  # a shape known only from the data


class _RebindsBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))
        self.register_buffer("cache", torch.zeros(1), persistent=False)

    def forward(self, x):
        h = self.fc(x)
        self.cache = torch.ones(2)  # a cache rebuilt: not state, allowed
        self.ema = 0.9 * self.ema + 0.1 * h.mean(0).detach()  # state, and lost
        return h.sum()


def test_a_data_dependent_shape_is_a_trace_error():
    with pytest.raises(TraceError, match="depends on the data"):
        trace(_MaskedSum(), (torch.randn(8, 4),))


def test_a_buffer_rebound_in_forward_is_a_trace_error():
    """Export records no update for ``self.ema = ...``: the generated module's
    buffer silently never changed (a new-user sweep)."""
    with pytest.raises(TraceError, match=r"buffer\(s\) \['ema'\]"):
        trace(_RebindsBuffer(), (torch.randn(8, 4),))


class _MixedEinsum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 12)
        self.w = nn.Parameter(torch.randn(12, 12))

    def forward(self, x):
        c = torch.cumsum(self.fc(x), dim=1)  # bf16 under autocast, beside fp32 w and x
        return torch.einsum("bi,ij,bj->b", c, self.w, x).pow(2).mean()


def test_mixed_precision_casts_the_inputs_of_an_op_autocast_casts_inside():
    """Autocast casts a 3-operand einsum's operands only inside it (its bmm's);
    the graph, run without autocast, gave the einsum mixed dtypes and tracing
    failed with an untyped RuntimeError. Its inputs are cast to the dtype
    autocast computed it in."""
    torch.manual_seed(0)
    traced = trace(_MixedEinsum(), (torch.randn(8, 12),), loss_fn=default_loss,
                   mixed_precision="bf16")
    einsum = next(n for n in traced.graph.nodes if n.name == "einsum")
    assert {a.meta["val"].dtype for a in einsum.args[1]} == {torch.bfloat16}


def test_inputs_on_another_device_than_the_model_name_both():
    """A GPU run's bench passed its batch on the GPU with the model still on the
    CPU: export's error named a FakeTensor device propagation in aten.mm."""
    with pytest.raises(TraceError, match=r"inputs are on meta and the model's parameters on "
                                         r"cpu: .*pass example inputs on cpu"):
        trace(nn.Linear(4, 2), (torch.randn(8, 4, device="meta"),), loss_fn=default_loss)
