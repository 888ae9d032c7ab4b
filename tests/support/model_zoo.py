"""Small models for the profiler's tests and accuracy bench, and the real-execution
measurement the estimates are checked against.

Every builder takes a device and returns ``(model, example_inputs, loss_fn)``:
``example_inputs`` in automap's forms (a tuple of positional arguments or a dict of
keyword arguments), ``loss_fn`` mapping the model's output to the scalar loss. The
Hugging Face models are built from small configs (no download) and compute their own
loss from ``labels``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from automap.trace import hf_compat
from automap.trace.profiling import OPTIMIZERS
from automap.trace.tracing import default_loss, split_inputs

BATCH, SEQ, HIDDEN, LAYERS, HEADS, VOCAB = 4, 16, 64, 2, 4, 256

# transformers warns about unused default token ids of tiny configs; not our concern.
logging.getLogger("transformers").setLevel(logging.ERROR)


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


class MLP(nn.Module):
    def __init__(self, d_in: int = 64, hidden: int = 256, d_out: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.relu(self.fc2(self.act(self.fc1(x))))))


class BasicBlock(nn.Module):
    """ResNet's basic block: conv-BN-ReLU(inplace)-conv-BN, residual add, ReLU(inplace)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.down = None
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)
        )
        self.layer1 = BasicBlock(width, width)
        self.layer2 = BasicBlock(width, 2 * width, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


class MobileNetish(nn.Module):
    """Inverted residuals: 1x1 expand, depthwise 3x3, ReLU6(inplace), 1x1 project."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 2, 1), nn.BatchNorm2d(width))
        blocks = []
        for _ in range(2):
            blocks.append(
                nn.Sequential(
                    nn.Conv2d(width, 4 * width, 1, bias=False),
                    nn.BatchNorm2d(4 * width),
                    nn.ReLU6(inplace=True),
                    nn.Conv2d(4 * width, 4 * width, 3, 1, 1, groups=4 * width, bias=False),
                    nn.BatchNorm2d(4 * width),
                    nn.ReLU6(inplace=True),
                    nn.Conv2d(4 * width, width, 1, bias=False),
                    nn.BatchNorm2d(width),
                )
            )
        self.blocks = nn.ModuleList(blocks)
        self.fc = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.fc(x.mean((2, 3)))


class TorchTransformer(nn.Module):
    """A classifier on torch's own nn.TransformerEncoder (pre-norm, GELU)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        layer = nn.TransformerEncoderLayer(
            HIDDEN, HEADS, 4 * HIDDEN, dropout=0.1, activation="gelu", batch_first=True,
            norm_first=True,
        )  # fmt: skip
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)).mean(1))


class StateParts(nn.Module):
    """Parameters a batch-split activation reads through parts of the graph
    computed from state alone: a learned position table looked up by
    ``arange`` (GPT-2's ``wpe``), scaled by a parameter that is also read
    directly, and a gate through a sigmoid. Under data parallelism their
    gradients are bucketed (``defer_parameter_gradient_sync``), not
    all-reduced where the backward reaches each read."""

    def __init__(self, width: int = HIDDEN, seq: int = SEQ, classes: int = 10) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.pos = nn.Embedding(seq, width)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.gate = nn.Parameter(torch.linspace(-1.0, 1.0, width))
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = self.pos(torch.arange(x.shape[1], device=x.device)) * self.scale
        h = torch.tanh(self.inp(x) + positions) * torch.sigmoid(self.gate)
        return self.out((h * self.scale).mean(1))


class StatePartsWholeLoss(StateParts):
    """``StateParts`` that also returns a penalty on its position table, which
    the loss adds whole: that read's gradient is not partial over the batch,
    so the table's part must not be bucketed (its batch-split read keeps its
    own all-reduce)."""

    def forward(self, x: torch.Tensor):
        positions = self.pos(torch.arange(x.shape[1], device=x.device)) * self.scale
        h = torch.tanh(self.inp(x) + positions) * torch.sigmoid(self.gate)
        return self.out((h * self.scale).mean(1)), positions.pow(2).mean()


def _images(device, n: int = BATCH, size: int = 32) -> torch.Tensor:
    return torch.randn(n, 3, size, size, device=device)


def _classes(device, n: int = BATCH) -> torch.Tensor:
    return torch.randint(0, 10, (n,), device=device)


def _tokens(device) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), device=device)


def mlp(device="cpu"):
    with torch.device(device):
        model = MLP()
    x, y = torch.randn(32, 64, device=device), _classes(device, 32)
    return model, (x,), lambda out: _cross_entropy(out, y)


def mlp_frozen(device="cpu"):
    """The MLP fine-tuned with its first layer frozen (no gradient, no
    optimizer state for it; its input needs no gradient either)."""
    model, inputs, loss_fn = mlp(device)
    model.fc1.requires_grad_(False)
    return model, inputs, loss_fn


def state_parts(device="cpu"):
    with torch.device(device):
        model = StateParts()
    x, y = torch.randn(8, SEQ, HIDDEN, device=device), _classes(device, 8)
    return model, (x,), lambda out: _cross_entropy(out, y)


def state_parts_whole_loss(device="cpu"):
    with torch.device(device):
        model = StatePartsWholeLoss()
    x, y = torch.randn(8, SEQ, HIDDEN, device=device), _classes(device, 8)
    return model, (x,), lambda out: _cross_entropy(out[0], y) + out[1]


def resnet(device="cpu"):
    with torch.device(device):
        model = ResNet()
    y = _classes(device)
    return model, (_images(device),), lambda out: _cross_entropy(out, y)


def mobilenet(device="cpu"):
    with torch.device(device):
        model = MobileNetish()
    y = _classes(device)
    return model, (_images(device),), lambda out: _cross_entropy(out, y)


def torch_transformer(device="cpu"):
    with torch.device(device):
        model = TorchTransformer()
    y = _classes(device)
    return model, (_tokens(device),), lambda out: _cross_entropy(out, y)


def gpt2(device="cpu", **overrides):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB, n_positions=SEQ,
        bos_token_id=0, eos_token_id=0, **overrides,
    )  # fmt: skip
    with torch.device(device):
        model = GPT2LMHeadModel(cfg)
    ids = _tokens(device)
    return model, {"input_ids": ids, "labels": ids}, default_loss


def dropout_free_gpt2_lm(layers: int, width: int, heads: int, vocab: int, positions: int):
    """transformers' GPT2LMHeadModel without dropout (measured runs repeat exactly)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(
        n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=positions,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def bert(device="cpu"):
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        intermediate_size=4 * HIDDEN, vocab_size=VOCAB, max_position_embeddings=SEQ,
    )  # fmt: skip
    with torch.device(device):
        model = BertForMaskedLM(cfg)
    ids = _tokens(device)
    return model, {"input_ids": ids, "labels": ids}, default_loss


def llama(device="cpu"):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_key_value_heads=2, intermediate_size=172, vocab_size=VOCAB,
        max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    ids = _tokens(device)
    return model, {"input_ids": ids, "labels": ids}, default_loss


def vit(device="cpu"):
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        intermediate_size=4 * HIDDEN, image_size=32, patch_size=8, num_labels=10,
    )  # fmt: skip
    with torch.device(device):
        model = ViTForImageClassification(cfg)
    return model, {"pixel_values": _images(device), "labels": _classes(device)}, default_loss


#: The accuracy bench's models, by name.
ZOO: dict[str, Callable[..., tuple[nn.Module, Any, Callable]]] = {
    "mlp": mlp,
    "resnet": resnet,
    "mobilenet": mobilenet,
    "torch_transformer": torch_transformer,
    "gpt2": gpt2,
    "bert": bert,
    "llama": llama,
    "vit": vit,
}


@dataclass(frozen=True)
class Measured:
    """Peak live tensor bytes and FLOPs of one real training step."""

    peak_bytes: int
    flops: int


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def allocation_peak_bytes(prof) -> int:
    """The peak of the running sum of the CPU allocator's allocation and free
    events a ``torch.profiler.profile(profile_memory=True)`` recorded: the most
    bytes allocated at once beyond what was live when it started."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def measure_step(model: nn.Module, example_inputs: Any, loss_fn: Callable, optimizer="adamw"):
    """Run real training steps of ``model`` and measure the second (steady-state) one:
    its peak of live tensor bytes and its forward+backward FLOPs.

    The peak is recorded from real allocations. On CPU, the allocator reports every
    allocation and free to the PyTorch profiler (``profile_memory=True``); the running
    sum of those ``[memory]`` events peaks at the step's peak. On CUDA it is
    ``torch.cuda.max_memory_allocated()`` minus what was allocated before the step.
    Either is added to the bytes live before the step (parameters, buffers, inputs,
    optimizer state). FLOPs are counted by ``FlopCounterMode`` on a separate real
    forward+backward.
    """
    args, kwargs = split_inputs(example_inputs)
    if hf_compat.is_hf_model(model):
        kwargs = {**hf_compat.call_kwargs(model), **kwargs}
    params = [p for p in model.parameters() if p.requires_grad]
    on_cuda = params[0].device.type == "cuda"
    opt = OPTIMIZERS[optimizer](params, {"foreach": on_cuda}) if optimizer else None

    def step() -> None:
        loss = loss_fn(model(*args, **kwargs))
        loss.backward()
        if opt is not None:
            opt.step()
        model.zero_grad(set_to_none=True)

    step()  # creates the optimizer state, as before every later step
    state = pytree.tree_leaves(opt.state_dict()["state"]) if opt else []
    before = [*model.parameters(), *model.buffers(), *pytree.tree_leaves((args, kwargs)), *state]
    baseline_bytes = _storage_bytes(before)
    if on_cuda:
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - allocated
    else:
        activities = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
            step()
        peak = allocation_peak_bytes(prof)

    with FlopCounterMode(display=False) as counter:
        loss_fn(model(*args, **kwargs)).backward()
    model.zero_grad(set_to_none=True)
    return Measured(baseline_bytes + peak, counter.get_total_flops())
