"""The shared GPT: its config checks, tying, and the planner's example built from it."""

from __future__ import annotations

import pytest
import torch

from shardkit.tools.examples import gpt_small, gpt_small_inputs
from shardkit.tools.plan.gpt import GPT, GPTConfig
from shardkit.tools.plan.options import PlanOptions
from shardkit.tools.plan.planner import plan

TINY = GPTConfig(vocab_size=11, dim=8, n_layers=2, n_heads=2, max_seq_len=6)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"dim": 9}, "must divide by n_heads"),
        ({"n_layers": 0}, "n_layers must be a positive int"),
        ({"vocab_size": True}, "vocab_size must be a positive int"),
    ],
)
def test_config_is_checked(change: dict[str, object], match: str) -> None:
    sizes: dict[str, object] = {
        "vocab_size": 11,
        "dim": 8,
        "n_layers": 2,
        "n_heads": 2,
        "max_seq_len": 6,
    }
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**sizes, **change})  # type: ignore[arg-type]  # wrong values on purpose


def test_logits_and_tying() -> None:
    torch.manual_seed(0)
    model = GPT(TINY)
    assert model(torch.randint(0, 11, (3, 5))).shape == (3, 5, 11)
    assert model.head.weight is not model.tok.weight
    tied = GPT(
        GPTConfig(vocab_size=11, dim=8, n_layers=2, n_heads=2, max_seq_len=6, tie_embeddings=True)
    )
    assert tied.head.weight is tied.tok.weight
    count = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in tied.parameters()) == count - 11 * 8


def test_the_example_plans() -> None:
    model = gpt_small()
    assert sum(p.numel() for p in model.parameters()) == 8_448_512  # the benchmarks' "small"
    result = plan(gpt_small, world_size=2, options=PlanOptions(inputs=gpt_small_inputs))
    assert [g.fqn for g in result.groups] == [*(f"blocks.{i}" for i in range(8)), "<root>"]
    assert result.activations_traced
