"""Acceptance bench of the symbolic profiler (issue 3): estimated vs measured peak
memory and FLOPs of a training step, and the cost of profiling large models on meta.

    python benches/profile_accuracy.py            # CPU accuracy table (+ CUDA if present)
    python benches/profile_accuracy.py --scale    # also GPT-2 XL and Llama-7B on meta

Accuracy: for each model of ``tests/support/model_zoo.py`` (MLP, ResNet-style convnet with
BatchNorm + inplace ReLU, MobileNet-style convnet, torch.nn.TransformerEncoder, and
GPT-2, BERT, Llama, ViT from small transformers configs), ``automap.trace.profiling.profile``
estimates one AdamW training step without allocating; then the same step runs for real
(after a first step that creates the optimizer state) and its peak of live tensor bytes
is recorded from real allocations: on CPU the allocator's allocation/free events in the
PyTorch profiler (``profile_memory=True``), on CUDA ``torch.cuda.max_memory_allocated``.
FLOPs: ``FlopCounterMode`` on the real forward+backward, which must equal the estimate
exactly. Exit status 1 when a peak is off by more than 5 % or FLOPs differ.

Scale: trace + profile of a GPT-2 XL-sized (48 layers, hidden 1600) and a Llama-7B-sized
config on the meta device with a batch of 8 x 1024 tokens; prints wall time, RSS growth
(targets: 30 s and 1 GiB each) and the real bytes of parameter memory (0).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

import model_zoo  # noqa: E402
from automap.trace.profiling import format_bytes, profile  # noqa: E402

MAX_PEAK_ERROR = 0.05
SCALE_TIME_S, SCALE_RSS_BYTES = 30.0, 2**30


def accuracy(device: str) -> bool:
    print(f"\nestimate vs real training step (AdamW) on {device}")
    head = f"{'model':18} {'estimated':>12} {'measured':>12} {'error':>8}  "
    print(head + f"{'est. FLOPs':>12} {'real FLOPs':>12}  FLOPs  peak at")
    ok = True
    for name, build in model_zoo.ZOO.items():
        torch.manual_seed(0)
        model, inputs, loss_fn = build(device)
        estimate = profile(model, inputs, "adamw", loss_fn=loss_fn, device=device)
        real = model_zoo.measure_step(model, inputs, loss_fn, "adamw")
        error = (estimate.peak_memory_bytes - real.peak_bytes) / real.peak_bytes
        flops_equal = estimate.step_flops == real.flops
        ok &= abs(error) <= MAX_PEAK_ERROR and flops_equal
        loc = estimate.peak_location
        print(
            f"{name:18} {estimate.peak_memory_bytes:>12,} {real.peak_bytes:>12,} "
            f"{error:>+8.2%}  {estimate.step_flops:>12.4g} {real.flops:>12.4g}  "
            f"{'equal' if flops_equal else 'DIFFER'}  {loc.phase} {loc.node}"
        )
    return ok


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def scale() -> bool:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    configs = {
        "GPT-2 XL": (GPT2LMHeadModel, GPT2Config(n_layer=48, n_embd=1600, n_head=25)),
        "Llama-7B": (
            LlamaForCausalLM,
            LlamaConfig(
                num_hidden_layers=32,
                hidden_size=4096,
                intermediate_size=11008,
                num_attention_heads=32,
                num_key_value_heads=32,
                vocab_size=32000,
            ),  # fmt: skip
        ),
    }
    print("\ntrace + profile on the meta device, batch 8 x 1024 tokens, AdamW")
    head = f"{'model':10} {'params':>8} {'time':>7} {'RSS growth':>11}"
    print(head + f" {'real param bytes':>17}  peak")
    ok = True
    for name, (cls, config) in configs.items():
        rss_before = _rss_bytes()
        start = time.perf_counter()
        with torch.device("meta"):
            model = cls(config)
            ids = torch.randint(0, config.vocab_size, (8, 1024))
        result = profile(model, {"input_ids": ids, "labels": ids}, "adamw", device="cpu")
        elapsed_s = time.perf_counter() - start
        growth = _rss_bytes() - rss_before
        real_param_bytes = sum(
            p.numel() * p.element_size() for p in model.parameters() if not p.is_meta
        )
        n_params = sum(p.numel() for p in model.parameters())
        ok &= elapsed_s < SCALE_TIME_S and growth < SCALE_RSS_BYTES and real_param_bytes == 0
        print(
            f"{name:10} {n_params / 1e9:>7.2f}B {elapsed_s:>6.1f}s {format_bytes(growth):>11} "
            f"{real_param_bytes:>17}  {format_bytes(result.peak_memory_bytes)}"
        )
        del model, result
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", action="store_true", help="also GPT-2 XL and Llama-7B")
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    start = time.perf_counter()
    ok = accuracy("cpu")
    if torch.cuda.is_available():
        ok &= accuracy("cuda")
    else:
        print("\nCUDA comparison (torch.cuda.max_memory_allocated) skipped: no GPU")
    print(f"\naccuracy bench: {time.perf_counter() - start:.1f}s")
    if args.scale:
        ok &= scale()
    print("\nOK" if ok else "\nFAILED: a peak error above 5 %, differing FLOPs or a scale target")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
