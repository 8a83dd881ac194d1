"""split_matrices: hidden matrices for Muon, the rest for AdamW, by module type."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardkit.core.optim import split_matrices
from tests.core import models


def _names(pairs: list[tuple[str, nn.Parameter]]) -> list[str]:
    return [n for n, _ in pairs]


def test_the_gpt_gives_its_blocks_matrices_and_keeps_embeddings_and_head_apart() -> None:
    model = models.build("gpt")
    split = split_matrices(model, head=model.head)
    assert _names(split.matrices) == [
        f"blocks.{i}.{m}.weight"
        for i in range(2)
        for m in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")
    ]
    others = _names(split.others)
    assert {"tok.weight", "pos.weight", "head.weight", "ln_f.weight"} <= set(others)
    assert len(others) + len(split.matrices) == len(list(model.parameters()))


def test_without_head_the_head_is_a_matrix_unless_tied_to_the_embedding() -> None:
    assert "head.weight" in _names(split_matrices(models.build("gpt")).matrices)
    tied = models.build("gpt_tied")
    split = split_matrices(tied)
    assert "tok.weight" in _names(split.others)  # one tensor, listed once, with the embedding
    assert all(p is not tied.tok.weight for _, p in split.matrices)


def test_transformers_heads_are_found_by_get_output_embeddings() -> None:
    pytest.importorskip("transformers")
    from tests.core.interop.hf_models import tiny_qwen2

    split = split_matrices(tiny_qwen2())
    others = _names(split.others)
    assert "lm_head.weight" in others and "model.embed_tokens.weight" in others
    assert all(".layers." in n and n.endswith("proj.weight") for n in _names(split.matrices))


def test_frozen_parameters_are_left_out_and_stacks_are_asked_for() -> None:
    model = nn.Module()
    model.frozen = nn.Linear(3, 3)
    model.frozen.requires_grad_(False)
    model.experts = nn.Parameter(torch.zeros(4, 6, 3))
    assert _names(split_matrices(model).others) == ["experts"]
    assert _names(split_matrices(model, stacks=True).matrices) == ["experts"]
