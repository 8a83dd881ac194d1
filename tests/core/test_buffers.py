"""Shard geometry, flat layouts, copy-out and gradient packing, in one process."""

from __future__ import annotations

import pytest
import torch

from shardkit.core.runtime.buffers import (
    FlatLayout,
    copy_out_unsharded,
    one_copy_numel,
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


def test_one_cast_copy_fills_every_slot_as_per_tensor_copies_do() -> None:
    numels = [256, 8, 64]
    src = FlatLayout.build(numels, [torch.float32] * 3)
    dst = FlatLayout.build(numels, [torch.bfloat16] * 3)
    n = one_copy_numel(src, dst)
    assert n == src.offsets[-1] // 4 + 64
    shards = torch.zeros(src.nbytes, dtype=torch.uint8)
    for i, numel in enumerate(numels):
        src.view(shards, i).copy_(torch.randn(numel))
    one, each = (torch.zeros(dst.nbytes, dtype=torch.uint8) for _ in range(2))
    one.view(torch.bfloat16)[:n].copy_(shards.view(torch.float32)[:n])
    for i in range(len(numels)):
        dst.view(each, i).copy_(src.view(shards, i))
    for i in range(len(numels)):
        assert torch.equal(dst.view(one, i), dst.view(each, i))


@pytest.mark.parametrize(
    ("numels", "dtypes"),
    [
        ([10, 8], [torch.float32, torch.float32]),  # bf16 slots start at other elements
        ([8, 8], [torch.float32, torch.float16]),  # two dtypes on the source side
    ],
)
def test_no_single_copy_when_slots_do_not_line_up(
    numels: list[int], dtypes: list[torch.dtype]
) -> None:
    src = FlatLayout.build(numels, dtypes)
    dst = FlatLayout.build(numels, [torch.bfloat16] * len(numels))
    assert one_copy_numel(src, dst) is None
