"""A tiny Hugging Face Llama, built from a config (no download), for the library tests."""

from __future__ import annotations

from typing import Any

import torch


def tiny_llama(seed: int = 0) -> Any:
    """A two-layer Llama decoder (vocabulary 64, width 32): the same weights on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    return LlamaForCausalLM(config)
