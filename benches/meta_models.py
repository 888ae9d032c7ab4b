"""Large models on the meta device (no weights) for the planning benches,
and the bench process's peak resident set."""

from __future__ import annotations

import resource

import torch


def peak_rss_bytes() -> int:
    """This process's peak resident set: VmHWM, which starts afresh at exec.
    (``ru_maxrss`` keeps the parent's resident set from before exec, so a
    bench spawned by a large process, e.g. a test run, read as large.)"""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _lm_inputs(vocab_size: int, batch: int, seq: int) -> dict:
    with torch.device("meta"):
        ids = torch.randint(0, vocab_size, (batch, seq))
    return {"input_ids": ids, "labels": ids}


def gpt2_lm(batch: int, seq: int, dtype=torch.float32, **config):
    """A GPT-2-architecture LM of ``config`` (n_layer, n_embd, n_head, ...)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_positions=seq, **config)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg).to(dtype)
    return model, _lm_inputs(cfg.vocab_size, batch, seq)


def llama_lm(batch: int, seq: int, dtype=torch.bfloat16, **config):
    """A Llama-architecture LM of ``config`` (num_hidden_layers, hidden_size, ...)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(max_position_embeddings=seq, **config)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(dtype)
    return model, _lm_inputs(cfg.vocab_size, batch, seq)


def gpt3(batch: int = 8, seq: int = 2048):
    """GPT-3 175B in bf16."""
    return gpt2_lm(batch, seq, torch.bfloat16, n_layer=96, n_embd=12288, n_head=96,
                   vocab_size=50257)


def llama70b(batch: int = 8, seq: int = 2048):
    return llama_lm(batch, seq, num_hidden_layers=80, hidden_size=8192,
                    intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                    vocab_size=32000)


def llama7b(batch: int = 4, seq: int = 2048):
    return llama_lm(batch, seq, num_hidden_layers=32, hidden_size=4096,
                    intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
                    vocab_size=32000)
