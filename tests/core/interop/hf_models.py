"""Tiny Hugging Face decoders (Llama, Qwen2), built from a config (no download), for tests."""

from __future__ import annotations

from typing import Any

import torch

_TINY: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16,
}


def tiny_llama(seed: int = 0) -> Any:
    """A two-layer Llama decoder (vocabulary 64, width 32): the same weights on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**_TINY))


def tiny_qwen2(seed: int = 0) -> Any:
    """A two-layer Qwen2 decoder of the same size (q/k/v with biases; head not tied)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**_TINY, tie_word_embeddings=False))
