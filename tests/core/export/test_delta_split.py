"""A delta's changes cut into tensors on the gathering rank: every rank's ascending positions
in its part, placed run by run where every cut is along dim 0, equal what cutting them tensor
by tensor gives (``AxisGather.global_index`` per rank and tensor, then joined)."""

from __future__ import annotations

import math

import pytest
import torch

from shardkit.core.export import delta_transfer
from shardkit.core.export.axis_gathers import AxisGather, TensorSource
from shardkit.core.export.delta_encoding import Decoded

SHAPES = [(37, 5), (64,), (300, 7), (3, 2), (1000,)]


def _sources(ranks: int) -> tuple[list[TensorSource], list[int]]:
    sources, starts, at = [], [], 0
    for i, shape in enumerate(SHAPES):
        gather = AxisGather(0, 0, ranks, shape)
        tensor = torch.zeros(shape)
        sources.append(TensorSource(f"t{i}", f"t{i}", tensor, torch.bfloat16, shape, (gather,)))
        starts.append(at)
        at += -(-gather.padded_numel * 2 // 8) * 8 // 2
    return sources, starts


def _decoded(sources: list[TensorSource], starts: list[int], rank: int, share: float) -> Decoded:
    """Random changes in this rank's real rows (padding never changes), as decoded."""
    generator = torch.Generator().manual_seed(100 * rank + int(share * 100))
    positions = []
    for source, start in zip(sources, starts, strict=True):
        gather = source.gathers[0]
        numel = math.prod(gather.piece_shape(rank))
        chosen = torch.nonzero(torch.rand(numel, generator=generator) < share).view(-1)
        positions.append(chosen + start)
    every = torch.cat(positions)
    stepped = every[torch.rand(every.numel(), generator=generator) < 0.8]
    kept = torch.ones(every.numel(), dtype=torch.bool)
    kept[torch.searchsorted(every, stepped)] = False
    given = every[kept]
    values = torch.randn(given.numel(), generator=generator).to(torch.bfloat16)
    steps = torch.randint(-127, 128, (stepped.numel(),), generator=generator).to(torch.int8)
    return Decoded(given, values, stepped, steps)


@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("share", [0.0, 0.05, 0.5])
def test_runs_placed_at_once_equal_the_tensor_by_tensor_cut(ranks: int, share: float) -> None:
    sources, starts = _sources(ranks)
    decoded = [_decoded(sources, starts, rank, share) for rank in range(ranks)]
    placed = delta_transfer.split_changes(sources, starts, decoded)
    each = delta_transfer._split_each(sources, starts, decoded)
    assert list(placed) == list(each)
    for key, changes in placed.items():
        oracle = each[key]
        assert changes.stepped is not None and oracle.stepped is not None
        assert changes.steps is not None and oracle.steps is not None
        assert torch.equal(changes.indices, oracle.indices), key
        assert torch.equal(changes.values.view(torch.int16), oracle.values.view(torch.int16))
        assert torch.equal(changes.stepped, oracle.stepped), key
        assert torch.equal(changes.steps, oracle.steps), key
        assert bool((changes.indices.diff() > 0).all()) and bool((changes.stepped.diff() > 0).all())
