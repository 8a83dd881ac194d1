"""Muon on a transformers Qwen2 decoder, sharded per layer: torch's Muon's bits, 10 steps, W=2.

A tiny ``Qwen2ForCausalLM`` built from a config (no download), ``fully_shard`` on each decoder
layer and the root, by each engine. ``split_matrices`` gives Muon the layers' 2-D matrices
(attention and MLP projections) and AdamW the rest: the embedding (by its type), the head
(``get_output_embeddings()``), the norms and the q/k/v biases. The single process steps
``torch.optim.Muon`` and AdamW on the sharded run's reduced gradients (``muon_paths``).
"""

from __future__ import annotations

import pytest

from harness.pool import run_on_ranks
from tests.core.optim.muon_paths import Path, paths_body

pytest.importorskip("transformers")

STEPS = 10
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("impl", ["shardkit", "torch"])
def test_muon_on_qwen2_matches_torch_muon(impl: str) -> None:
    results = run_on_ranks(2, paths_body, impl=impl, path=Path(model="qwen2"), steps=STEPS)
    expected = {
        f"model.layers.{i}.{part}.{name}.weight"
        for i in range(2)
        for part, names in (("self_attn", PROJECTIONS[:4]), ("mlp", PROJECTIONS[4:]))
        for name in names
    }
    for rank, out in enumerate(results):
        assert set(out["muon"]) == expected, (rank, out["muon"])
        assert out["equal"] == [True] * STEPS, (rank, out["max_diff"])
