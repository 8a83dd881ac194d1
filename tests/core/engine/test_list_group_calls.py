"""Calls of a ``fully_shard([...])`` group's modules that torch's own FSDP2 tests make.

Each runs the same program on torch's ``fully_shard`` and on shardkit's, at W=2, and compares
what the program can see, bit for bit: a chunked loss reads the head's gradient after each
chunk's backward, and two forwards run before one backward (whole, or skipping the head).
Found by torch's ``test_fully_shard_training.py`` (``scripts/torch_fsdp2_tests.py``): shardkit
showed each chunk's gradient one chunk late, and crashed (a segmentation fault, or "storage of
size 0") on the two forwards.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import fsdp as torch_fsdp
from torch.distributed.tensor import DTensor

import shardkit.core as shardkit_core
from harness.pool import run_on_ranks
from tests.core.torch_releases import INSTALLED

_DIM, _VOCAB, _CHUNKS = 16, 24, 4


class _ChunkedHead(nn.Module):
    """Embedding, body, norm and head; ``skip_head`` returns the hidden states (chunked loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(_VOCAB, _DIM)
        self.body = nn.Linear(_DIM, _DIM, bias=False)
        self.norm = nn.RMSNorm(_DIM)
        self.head = nn.Linear(_DIM, _VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        hidden: torch.Tensor = self.norm(self.body(self.embed(tokens)))
        return hidden if skip_head else self.head(hidden)


def _fully_shard(engine: str) -> Any:
    """The engine's ``fully_shard``: torch's or shardkit's."""
    return torch_fsdp.fully_shard if engine == "torch" else shardkit_core.fully_shard


def _sharded(engine: str, grouping: str) -> _ChunkedHead:
    fully_shard = _fully_shard(engine)
    torch.manual_seed(0)
    model = _ChunkedHead()
    if grouping == "norm_head":
        fully_shard([model.norm, model.head])
    else:
        fully_shard([model.body, model.norm])
    fully_shard(model)
    return model


def _full(grad: torch.Tensor) -> torch.Tensor:
    assert isinstance(grad, DTensor)
    return grad.full_tensor()


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: None if p.grad is None else _full(p.grad) for name, p in model.named_parameters()}


def _chunked_loss(engine: str) -> list[Any]:
    """Two steps of a chunked loss: the head's gradient after every chunk, then all."""
    model = _sharded(engine, "norm_head")
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + dist.get_rank())
    seen: list[Any] = []
    for _ in range(2):
        tokens = torch.randint(0, _VOCAB, (2, 8))
        hidden = model(tokens, skip_head=True)
        input_grads = []
        for chunk in hidden.detach().chunk(_CHUNKS, dim=1):
            chunk = chunk.contiguous().requires_grad_(True)
            model.head(chunk).square().sum().backward()
            input_grads.append(chunk.grad)
            grad = model.head.weight.grad
            seen.append(None if grad is None else _full(grad))
        hidden.backward(torch.cat(input_grads, dim=1))
        seen.append(_grads(model))
        optim.step()
        optim.zero_grad()
    return seen


def _two_forwards(engine: str, grouping: str, skip_head: bool) -> list[Any]:
    """Two forwards, then one backward of both, twice."""
    model = _sharded(engine, grouping)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + dist.get_rank())
    seen: list[Any] = []
    for _ in range(2):
        first = model(torch.randint(0, _VOCAB, (2, 8)), skip_head=skip_head)
        second = model(torch.randint(0, _VOCAB, (2, 8)), skip_head=skip_head)
        (first.square().sum() + second.sum()).backward()
        seen.append(_grads(model))
        optim.step()
        optim.zero_grad()
    return seen


class _Tied(nn.Module):
    """An embedding and an output projection sharing one weight (one list group)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(_VOCAB, _DIM)
        self.out = nn.Linear(_DIM, _VOCAB, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.out(self.embed(tokens))
        return logits


def _read_full_weight(module: Any) -> torch.Tensor:
    module.unshard()
    weight: torch.Tensor = module.weight.detach().clone()
    module.reshard()
    return weight


def _unshard_before_forward(engine: str) -> list[Any]:
    """``unshard()`` on a module of a list group before any forward, to read the full weight,
    then training, then reading it again."""
    fully_shard = _fully_shard(engine)
    torch.manual_seed(0)
    model = _Tied()
    fully_shard([model.embed, model.out])
    fully_shard(model)
    seen: list[Any] = [_read_full_weight(model.embed)]
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(3):
        tokens = torch.randint(0, _VOCAB, (2, 8))
        loss = nn.functional.cross_entropy(model(tokens).view(-1, _VOCAB), tokens.view(-1))
        loss.backward()
        optim.step()
        optim.zero_grad()
        seen.append(loss.detach())
    seen.append(_read_full_weight(model.embed))
    return seen


def _shared_in_two_groups(engine: str) -> list[Any]:
    """A tied weight in two ``fully_shard`` calls: torch refuses at the first forward,
    shardkit at the second call, both with a ``ValueError`` that starts with torch's words."""
    fully_shard = _fully_shard(engine)
    model = _Tied()
    try:
        fully_shard(model.embed)
        fully_shard(model.out)
        fully_shard(model)
        model(torch.randint(0, _VOCAB, (2, 8)))
    except ValueError as error:
        return [str(error)]
    return []


def _both_engines(rank: int, world_size: int, case: str, **kwargs: Any) -> dict[str, list[Any]]:
    runs: dict[str, Any] = {
        "chunked": _chunked_loss,
        "two": _two_forwards,
        "unshard": _unshard_before_forward,
        "shared": _shared_in_two_groups,
    }
    run = runs[case]
    return {engine: run(engine, **kwargs) for engine in ("torch", "shardkit")}


def _assert_same(torch_seen: list[Any], ours: list[Any]) -> None:
    assert len(torch_seen) == len(ours)
    for index, (expected, got) in enumerate(zip(torch_seen, ours, strict=True)):
        if isinstance(expected, dict):
            assert expected.keys() == got.keys()
            for name in expected:
                _assert_same([expected[name]], [got[name]])
        elif expected is None:
            assert got is None, f"entry {index}: torch has no gradient there, shardkit has one"
        else:
            assert got is not None, f"entry {index}: torch has a gradient there, shardkit none"
            assert torch.equal(expected, got), f"entry {index} differs"


@pytest.mark.skipif(
    INSTALLED < (2, 13),
    reason="the oracle fails: torch's own fully_shard raises 'mixed torch.Tensor and DTensor' "
    "at the second chunk before 2.13",
)
def test_a_chunked_loss_sees_each_chunks_gradient_when_its_backward_returns() -> None:
    """The head of ``[norm, head]`` called per chunk after a forward that skipped it: its
    reduced gradient is there after each chunk's own backward (no end-of-backward callback
    runs for it), as torch's ``fully_shard`` assigns it; the step's gradients are torch's."""
    for result in run_on_ranks(2, _both_engines, case="chunked"):
        assert result["torch"][0] is not None
        _assert_same(result["torch"], result["shardkit"])


# Not ("body_norm", True): torch 2.13's own fully_shard aborts the process there.
@pytest.mark.parametrize(
    ("grouping", "skip_head"),
    [("norm_head", False), ("norm_head", True), ("body_norm", False)],
    ids=["norm_head-whole", "norm_head-skipping_the_head", "body_norm-whole"],
)
def test_two_forwards_before_one_backward_through_a_list_group(
    grouping: str, skip_head: bool
) -> None:
    """Each forward's first module call is partial when it starts; the group must stay gathered
    until the other forward's backward has read it too (it was freed early before)."""
    results = run_on_ranks(2, _both_engines, case="two", grouping=grouping, skip_head=skip_head)
    for result in results:
        _assert_same(result["torch"], result["shardkit"])


def test_unshard_on_a_list_groups_module_before_any_forward() -> None:
    """Reading a tied weight through ``unshard()`` before training: shardkit refused it (a
    list call's modules cannot be a root), torch's ``fully_shard`` makes no root there."""
    for result in run_on_ranks(2, _both_engines, case="unshard"):
        _assert_same(result["torch"], result["shardkit"])


def test_a_weight_shared_by_two_groups_is_refused_with_torchs_words() -> None:
    torchs_words = re.compile(
        r"Parameter '[\w.]+' is shared with a parameter already managed by another FSDP group\. "
        r"For shared/tied parameters, use fully_shard\(\[module_a, module_b\]\) to place them "
        r"in the same FSDP group\."
    )
    # torch finds it from 2.13 on; earlier releases accept it.
    engines = ("torch", "shardkit") if INSTALLED >= (2, 13) else ("shardkit",)
    for result in run_on_ranks(2, _both_engines, case="shared"):
        for engine in engines:
            assert len(result[engine]) == 1, f"{engine} accepted a weight in two groups"
            assert torchs_words.match(result[engine][0]), (engine, result[engine][0])
