"""Shard geometry, flat layouts, copy-out and gradient packing, in one process."""

from __future__ import annotations

import pytest
import torch

from shardkit.core.runtime.buffers import (
    FlatLayout,
    copy_out_unsharded,
    pack_grads_rank_major,
    shard_geometry,
)


@pytest.mark.parametrize(("size", "world"), [(8, 2), (3, 2), (5, 4), (1, 4), (2, 4)])
def test_geometry_follows_torch_chunk(size: int, world: int) -> None:
    full = torch.arange(size * 3.0).view(size, 3)
    geo = shard_geometry(full.shape, 0, world)
    chunks = list(torch.chunk(full, world))
    for rank in range(world):
        expected = chunks[rank].shape if rank < len(chunks) else torch.Size([0, 3])
        assert geo.local_shape(rank) == expected


def test_layout_aligns_mixed_dtypes() -> None:
    layout = FlatLayout.build([3, 5], [torch.float16, torch.float32])
    assert layout.offsets == (0, 16)
    buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
    layout.view(buf, 1).copy_(torch.arange(5.0))
    assert layout.view(buf, 1).tolist() == [0, 1, 2, 3, 4]
    assert layout.view(buf, 0).dtype == torch.float16


@pytest.mark.parametrize(
    ("shape", "dim", "world"), [((6, 4), 0, 2), ((5, 3), 0, 4), ((4, 8), 1, 4)]
)
def test_pack_then_gather_round_trips(shape: tuple[int, int], dim: int, world: int) -> None:
    full = torch.randn(shape)
    geo = shard_geometry(full.shape, dim, world)
    rows = torch.empty(world, geo.shard_numel)
    pack_grads_rank_major([full], [geo], [0], rows)
    # Each row is that rank's padded shard; copy-out must rebuild the full tensor.
    out = torch.empty(world * geo.shard_numel)
    copy_out_unsharded(list(rows.unbind(0)), geo, out)
    rebuilt = out[: full.numel()].view(shape) if dim == 0 else out.view(shape)
    assert rebuilt.equal(full)
    for rank, chunk in enumerate(torch.chunk(full, world, dim)):
        padded = rows[rank].view(geo.padded_shard_shape).narrow(dim, 0, chunk.shape[dim])
        assert padded.equal(chunk)


def test_missing_grad_packs_zeros() -> None:
    geo = shard_geometry(torch.Size([4]), 0, 2)
    rows = torch.full((2, 2), 7.0)
    pack_grads_rank_major([None], [geo], [0], rows)
    assert rows.eq(0).all()
