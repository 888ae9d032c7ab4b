"""The model matrix (issue 16): current Hugging Face, torchvision and
hand-written models in tiny configs with random weights (no download), each
``(model, example_inputs, loss_fn)`` like ``model_zoo``'s builders, grouped by
family. Batches are 4 (or 8) so that a (2, 2) mesh can split them; dropout is
off except in the model that tests it.

``MATRIX`` maps family -> {name: builder}; ``CI_MODELS`` is the third of it
that the test suite trains (``benches/train_model_matrix.py`` runs all of it).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

BATCH, SEQ, HIDDEN, LAYERS, HEADS, VOCAB = 4, 8, 32, 2, 4, 128

logging.getLogger("transformers").setLevel(logging.ERROR)


def _tokens(n: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(1, VOCAB, (n, seq))


def _images(n: int = BATCH, size: int = 32) -> torch.Tensor:
    return torch.randn(n, 3, size, size)


def _classes(n: int = BATCH, classes: int = 10) -> torch.Tensor:
    return torch.randint(0, classes, (n,))


def _hf_loss(output):
    return output.loss


def _next_token_loss(ids: torch.Tensor):
    """Causal LM loss in the model's dtype (Hugging Face's own upcasts the logits
    to float32, whose rounding would blur a float64 comparison): labels shifted
    by padding, the padded position ignored."""
    labels = F.pad(ids, (0, 1), value=-100)[:, 1:]
    return lambda out: F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())


def _lm(config_cls, model_cls, **cfg):
    import transformers

    config = getattr(transformers, config_cls)(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, max_position_embeddings=4 * SEQ, **cfg)
    model = getattr(transformers, model_cls)(config)
    ids = _tokens()
    if model_cls.endswith("CausalLM"):
        return model, {"input_ids": ids}, _next_token_loss(ids)
    return model, {"input_ids": ids, "labels": ids.clone()}, _hf_loss


_DECODER_COMMON = dict(intermediate_size=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB,
                     n_positions=4 * SEQ, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    ids = _tokens()
    return GPT2LMHeadModel(cfg), {"input_ids": ids}, _next_token_loss(ids)


def llama():
    return _lm("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2, **_DECODER_COMMON)


def mistral():
    return _lm("MistralConfig", "MistralForCausalLM", num_key_value_heads=2,
               sliding_window=None, **_DECODER_COMMON)


def qwen2():
    return _lm("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, **_DECODER_COMMON)


def phi3():
    # Full rotary: the "pass" half of Phi-3's partial rotary is an empty slice.
    return _lm("Phi3Config", "Phi3ForCausalLM", num_key_value_heads=2, resid_pdrop=0.0,
               embd_pdrop=0.0, **_DECODER_COMMON)


def gemma():
    return _lm("GemmaConfig", "GemmaForCausalLM", num_key_value_heads=2, head_dim=8,
               **_DECODER_COMMON)


def falcon():
    return _lm("FalconConfig", "FalconForCausalLM", hidden_dropout=0.0, attention_dropout=0.0,
               bos_token_id=0, eos_token_id=0, pad_token_id=0)


def mixtral():
    from transformers.integrations import moe

    # torch's grouped matmul has no float64 CPU kernel; Hugging Face's own
    # fallback (the op traced under export) runs in every dtype.
    moe._can_use_grouped_mm = lambda *args: False
    return _lm("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=2,
               num_local_experts=4, num_experts_per_tok=2, **_DECODER_COMMON)


def bert():
    return _lm("BertConfig", "BertForMaskedLM", intermediate_size=64, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0)


def roberta():
    return _lm("RobertaConfig", "RobertaForMaskedLM", intermediate_size=64,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)


def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=LAYERS,
                   num_heads=HEADS, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    ids = _tokens()
    return T5ForConditionalGeneration(cfg), {"input_ids": ids, "labels": _tokens()}, _hf_loss


def bart():
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=LAYERS,
                     decoder_layers=LAYERS, encoder_attention_heads=HEADS,
                     decoder_attention_heads=HEADS, encoder_ffn_dim=64, decoder_ffn_dim=64,
                     max_position_embeddings=4 * SEQ, dropout=0.0, attention_dropout=0.0,
                     activation_dropout=0.0, pad_token_id=0, bos_token_id=0, eos_token_id=2,
                     decoder_start_token_id=2, forced_eos_token_id=None)
    ids = _tokens()
    return BartForConditionalGeneration(cfg), {"input_ids": ids, "labels": _tokens()}, _hf_loss


def whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, encoder_layers=LAYERS,
                        decoder_layers=LAYERS, encoder_attention_heads=HEADS,
                        decoder_attention_heads=HEADS, encoder_ffn_dim=64, decoder_ffn_dim=64,
                        d_model=HIDDEN, max_source_positions=SEQ, max_target_positions=4 * SEQ,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                        pad_token_id=0, bos_token_id=0, eos_token_id=0,
                        decoder_start_token_id=0)
    features = torch.randn(BATCH, 8, 2 * SEQ)
    return (WhisperForConditionalGeneration(cfg),
            {"input_features": features, "labels": _tokens()}, _hf_loss)


def _image_classifier(config_cls, model_cls, **cfg):
    import transformers

    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**cfg))
    return model, {"pixel_values": _images(), "labels": _classes()}, _hf_loss


def vit():
    return _image_classifier("ViTConfig", "ViTForImageClassification", num_hidden_layers=LAYERS,
                             hidden_size=HIDDEN, num_attention_heads=HEADS,
                             intermediate_size=64, image_size=32, patch_size=8, num_labels=10,
                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def swin():
    return _image_classifier("SwinConfig", "SwinForImageClassification", image_size=32,
                             patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
                             window_size=4, num_labels=10, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0, drop_path_rate=0.0)


def convnext():
    return _image_classifier("ConvNextConfig", "ConvNextForImageClassification",
                             num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10,
                             drop_path_rate=0.0)


def resnet():
    return _image_classifier("ResNetConfig", "ResNetForImageClassification", embedding_size=16,
                             hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic",
                             num_labels=10)


def _cross_entropy_with(labels):
    return lambda out: F.cross_entropy(out, labels)


def _torchvision_classifier(model):
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model, (_images(),), _cross_entropy_with(_classes())


def mobilenet_v3():
    from torchvision.models import mobilenet_v3_small

    return _torchvision_classifier(mobilenet_v3_small(num_classes=10, width_mult=0.25))


def efficientnet():
    from torchvision.models.efficientnet import EfficientNet, _efficientnet_conf

    setting, last = _efficientnet_conf("efficientnet_b0", width_mult=0.25, depth_mult=0.25)
    # Stochastic depth draws per-sample random numbers: off, like dropout.
    return _torchvision_classifier(EfficientNet(setting, 0.0, stochastic_depth_prob=0.0,
                                                num_classes=10, last_channel=last))


def densenet():
    from torchvision.models import DenseNet

    return _torchvision_classifier(DenseNet(growth_rate=8, block_config=(2, 2),
                                            num_init_features=16, bn_size=2, num_classes=10))


class UNet(nn.Module):
    """Two-level U-Net: conv blocks, max-pool down, transposed-conv and bilinear
    upsampling up, skip connections by concatenation."""

    def __init__(self, width: int = 8, classes: int = 3) -> None:
        super().__init__()

        def block(c_in, c_out):
            return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out),
                                 nn.ReLU(inplace=True))

        self.down1, self.down2 = block(3, width), block(width, 2 * width)
        self.bottom = block(2 * width, 4 * width)
        self.up2 = nn.ConvTranspose2d(4 * width, 2 * width, 2, stride=2)
        self.dec2 = block(4 * width, 2 * width)
        self.up1 = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.dec1 = block(3 * width, width)
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, x):
        d1 = self.down1(x)
        d2 = self.down2(F.max_pool2d(d1, 2))
        b = self.bottom(F.max_pool2d(d2, 2))
        u2 = self.dec2(torch.cat([self.up2(b), d2], 1))
        return self.head(self.dec1(torch.cat([self.up1(u2), d1], 1)))


def unet():
    target = torch.randint(0, 3, (BATCH, 16, 16))
    return UNet(), (torch.randn(BATCH, 3, 16, 16),), _cross_entropy_with(target)


class Recurrent(nn.Module):
    def __init__(self, cell: type[nn.RNNBase]) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.rnn = cell(HIDDEN, HIDDEN, num_layers=2, batch_first=True)
        self.head = nn.Linear(HIDDEN, 10)

    def forward(self, ids):
        out, _ = self.rnn(self.embed(ids))
        return self.head(out[:, -1])


def lstm():
    return Recurrent(nn.LSTM), (_tokens(),), _cross_entropy_with(_classes())


def gru():
    return Recurrent(nn.GRU), (_tokens(),), _cross_entropy_with(_classes())


class TiedLM(nn.Module):
    """An LM whose output layer is its embedding (one tensor, two uses)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mix = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def tied():
    ids = _tokens()
    return TiedLM(), (ids,), lambda out: F.cross_entropy(out.flatten(0, 1), ids.flatten())


class RoundSTE(torch.autograd.Function):
    """Rounds in the forward, passes the gradient straight through: its backward
    is not the derivative of its forward (which is zero almost everywhere)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class Quantized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(RoundSTE.apply(torch.relu(self.fc1(x))))


def straight_through():
    return Quantized(), (torch.randn(8, 16),), _cross_entropy_with(_classes(8))


class ComplexRotary(nn.Module):
    """Rotary position embedding through complex multiplication (Llama's original
    ``view_as_complex`` form) in a one-head attention."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)
        angles = torch.outer(torch.arange(SEQ, dtype=torch.float64),
                             1.0 / 10000 ** (torch.arange(0, HIDDEN, 2) / HIDDEN))
        self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles))

    def rotate(self, x):
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(pairs * self.freqs.to(pairs.dtype)).flatten(-2)

    def forward(self, ids):
        q, k, v = self.qkv(self.embed(ids)).chunk(3, -1)
        attn = F.scaled_dot_product_attention(self.rotate(q), self.rotate(k), v, is_causal=True)
        return self.head(attn)


def complex_rotary():
    ids = _tokens()
    return ComplexRotary(), (ids,), lambda out: F.cross_entropy(out.flatten(0, 1), ids.flatten())


class EmptySliceCat(nn.Module):
    """Phi-3's partial rotary at factor 1: the passed-through part is empty."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 10)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(torch.cat([h[..., :64] * 2, h[..., 64:]], -1))


def empty_slice_cat():
    return EmptySliceCat(), (torch.randn(8, 16),), _cross_entropy_with(_classes(8))


class DropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 10)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        h = self.drop(F.gelu(self.fc1(x)))
        return self.fc3(self.drop(F.gelu(self.fc2(h))))


def dropout():
    return DropoutMLP(), (torch.randn(8, 16),), _cross_entropy_with(_classes(8))


class FFTLayer(nn.Module):
    """A global filter (FNet/GFNet style): FFT along the sequence, a learned
    complex weight, inverse FFT."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        # complex128: Module.double() leaves complex tensors as they are.
        self.filter = nn.Parameter(torch.randn(SEQ // 2 + 1, 16, dtype=torch.complex128) / 4)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        h = self.fc(x)
        spectrum = torch.fft.rfft(h, dim=1) * self.filter
        return self.head(torch.fft.irfft(spectrum, n=x.shape[1], dim=1).mean(1))


def fft():
    return FFTLayer(), (torch.randn(8, SEQ, 16),), _cross_entropy_with(_classes(8))


MATRIX = {
    "decoder": {"gpt2": gpt2, "llama": llama, "mistral": mistral, "qwen2": qwen2, "phi3": phi3,
                "gemma": gemma, "falcon": falcon},
    "moe": {"mixtral": mixtral},
    "encoder": {"bert": bert, "roberta": roberta},
    "encoder_decoder": {"t5": t5, "bart": bart, "whisper": whisper},
    "vision": {"vit": vit, "swin": swin, "convnext": convnext, "resnet": resnet,
               "mobilenet_v3": mobilenet_v3, "efficientnet": efficientnet,
               "densenet": densenet, "unet": unet},
    "recurrent": {"lstm": lstm, "gru": gru},
    "handwritten": {"tied": tied, "straight_through": straight_through,
                    "complex_rotary": complex_rotary, "empty_slice_cat": empty_slice_cat,
                    "dropout": dropout, "fft": fft},
}

#: The representative third the test suite trains (every family, every op kind
#: the others add: vocab-parallel loss, experts, convolutions up and down,
#: recurrence, custom Functions, complex numbers, RNG).
CI_MODELS = {
    "decoder": ["gpt2", "phi3"],
    "moe": ["mixtral"],
    "encoder_decoder": ["t5"],
    "vision": ["mobilenet_v3", "unet"],
    "recurrent": ["lstm"],
    "handwritten": ["straight_through", "complex_rotary", "empty_slice_cat", "dropout"],
}


def build(name: str, seed: int = 0):
    """The model ``name`` of the matrix, built from ``seed``."""
    torch.manual_seed(seed)
    for models in MATRIX.values():
        if name in models:
            return models[name]()
    raise KeyError(f"no model {name!r} in the matrix")


def family_of(name: str) -> str:
    return next(f for f, models in MATRIX.items() if name in models)


def count(models=MATRIX) -> int:
    return sum(len(m) for m in models.values())


