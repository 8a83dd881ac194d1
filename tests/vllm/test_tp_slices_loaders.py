"""The TP-sliced windows against vLLM's own weight loaders, at engine degrees this machine
cannot run as engines (4 and 8; 2 runs for real in test_tp_sliced.py).

vLLM's parallel layers of a Qwen2 decoder (fused q/k/v with 2 kv heads, so replicated past
K=2; gate/up; o and down row-parallel; the embedding and LM head vocab-parallel over a padded
vocabulary) are built as engine rank r of K would build them (the TP rank and size vLLM asks
for are answered r and K), then loaded twice through their own ``weight_loader``: once from
the full checkpoint tensors, as vLLM loads a checkpoint, once from this rank's windows alone
(``WindowedWeight``). Every parameter must come out bit for bit the same.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
import torch

from shardkit.core.export.tp_slices import EngineTP, engine_window
from shardkit.core.export.windowed_weight import windowed

HIDDEN, HEADS, KV, HEAD_DIM, INTERMEDIATE, VOCAB = 64, 8, 2, 8, 128, 100
DTYPE = torch.bfloat16


@contextmanager
def _as_engine_rank(rank: int, degree: int) -> Iterator[None]:
    """vLLM's layers built and loaded as engine rank ``rank`` of ``degree`` builds them."""
    names = ("linear", "vocab_parallel_embedding")
    modules = [importlib.import_module(f"vllm.model_executor.layers.{n}") for n in names]
    modules.append(importlib.import_module("vllm.model_executor.parameter"))
    answers = {
        "get_tensor_model_parallel_rank": rank,
        "get_tensor_model_parallel_world_size": degree,
    }
    patches = [
        mock.patch.object(module, name, lambda value=value: value)
        for module in modules
        for name, value in answers.items()
        if hasattr(module, name)
    ]
    for patch in patches:
        patch.start()
    try:
        yield
    finally:
        for patch in reversed(patches):
            patch.stop()


def _layers() -> dict[str, Any]:
    linear = importlib.import_module("vllm.model_executor.layers.linear")
    vocab = importlib.import_module("vllm.model_executor.layers.vocab_parallel_embedding")
    made = {
        "self_attn.qkv_proj": linear.QKVParallelLinear(
            HIDDEN, HEAD_DIM, HEADS, KV, bias=True, params_dtype=DTYPE
        ),
        "self_attn.o_proj": linear.RowParallelLinear(
            HEADS * HEAD_DIM, HIDDEN, bias=False, params_dtype=DTYPE
        ),
        "mlp.gate_up_proj": linear.MergedColumnParallelLinear(
            HIDDEN, [INTERMEDIATE] * 2, bias=False, params_dtype=DTYPE
        ),
        "mlp.down_proj": linear.RowParallelLinear(
            INTERMEDIATE, HIDDEN, bias=False, params_dtype=DTYPE
        ),
        "embed_tokens": vocab.VocabParallelEmbedding(VOCAB, HIDDEN, params_dtype=DTYPE),
        "lm_head": vocab.ParallelLMHead(VOCAB, HIDDEN, params_dtype=DTYPE),
    }
    with torch.no_grad():
        for layer in made.values():
            for param in layer.parameters():
                param.zero_()
    return made


# Checkpoint name -> (vLLM layer, its parameter, the loader's shard id).
_CHECKPOINT = {
    "model.layers.0.self_attn.q_proj.weight": ("self_attn.qkv_proj", "weight", "q"),
    "model.layers.0.self_attn.k_proj.weight": ("self_attn.qkv_proj", "weight", "k"),
    "model.layers.0.self_attn.v_proj.weight": ("self_attn.qkv_proj", "weight", "v"),
    "model.layers.0.self_attn.q_proj.bias": ("self_attn.qkv_proj", "bias", "q"),
    "model.layers.0.self_attn.k_proj.bias": ("self_attn.qkv_proj", "bias", "k"),
    "model.layers.0.self_attn.v_proj.bias": ("self_attn.qkv_proj", "bias", "v"),
    "model.layers.0.self_attn.o_proj.weight": ("self_attn.o_proj", "weight", None),
    "model.layers.0.mlp.gate_proj.weight": ("mlp.gate_up_proj", "weight", 0),
    "model.layers.0.mlp.up_proj.weight": ("mlp.gate_up_proj", "weight", 1),
    "model.layers.0.mlp.down_proj.weight": ("mlp.down_proj", "weight", None),
    "model.embed_tokens.weight": ("embed_tokens", "weight", None),
    "lm_head.weight": ("lm_head", "weight", None),
}


def _checkpoint() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    kv_rows = KV * HEAD_DIM
    shapes = {
        "q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
        "k_proj.weight": (kv_rows, HIDDEN),
        "v_proj.weight": (kv_rows, HIDDEN),
        "q_proj.bias": (HEADS * HEAD_DIM,),
        "k_proj.bias": (kv_rows,),
        "v_proj.bias": (kv_rows,),
        "o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
        "gate_proj.weight": (INTERMEDIATE, HIDDEN),
        "up_proj.weight": (INTERMEDIATE, HIDDEN),
        "down_proj.weight": (HIDDEN, INTERMEDIATE),
        "embed_tokens.weight": (VOCAB, HIDDEN),
        "lm_head.weight": (VOCAB, HIDDEN),
    }
    out = {}
    for name in _CHECKPOINT:
        shape = next(s for suffix, s in shapes.items() if name.endswith(suffix))
        out[name] = torch.randn(shape, generator=generator).to(DTYPE)
    return out


def _load(layers: dict[str, Any], name: str, tensor: torch.Tensor) -> None:
    layer, kind, shard = _CHECKPOINT[name]
    param = getattr(layers[layer], kind)
    with torch.no_grad():
        if shard is None:
            param.weight_loader(param, tensor)
        else:
            param.weight_loader(param, tensor, shard)


@pytest.mark.parametrize("degree", [2, 4, 8])
def test_windows_load_as_vllms_loaders_take_full_tensors(degree: int) -> None:
    tp = EngineTP(
        degree=degree, num_heads=HEADS, num_kv_heads=KV, head_dim=HEAD_DIM, vocab_size=VOCAB
    )
    checkpoint = _checkpoint()
    for rank in range(degree):
        with _as_engine_rank(rank, degree):
            from_full, from_windows = _layers(), _layers()
            for name, full in checkpoint.items():
                _load(from_full, name, full)
                window = engine_window(tp, name, tuple(full.shape), rank)
                part = full[tuple(slice(a, b) for a, b in window.box)].clone()
                _load(from_windows, name, windowed(window, part))
        for layer, module in from_full.items():
            for kind, expected in module.named_parameters():
                got = dict(from_windows[layer].named_parameters())[kind]
                assert torch.equal(got, expected), f"rank {rank} of {degree}: {layer}.{kind}"


def test_a_window_that_is_not_the_engines_is_refused_by_its_loader() -> None:
    tp = EngineTP(degree=2, num_heads=HEADS, num_kv_heads=KV, head_dim=HEAD_DIM, vocab_size=VOCAB)
    full = _checkpoint()["model.layers.0.mlp.up_proj.weight"]
    window = engine_window(tp, "model.layers.0.mlp.up_proj.weight", tuple(full.shape), 0)
    with _as_engine_rank(1, 2), pytest.raises(ValueError, match="takes \\[64, 128\\) along dim 0"):
        # Rank 0's rows handed to engine rank 1's loader.
        _load(_layers(), "model.layers.0.mlp.up_proj.weight", windowed(window, full[:64]))
