"""Shard geometry and flat layouts, in one process."""

from __future__ import annotations

import pytest
import torch

from shardkit.core.runtime.buffers import FlatLayout, one_copy_numel, shard_geometry


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


@pytest.mark.parametrize("numels", [[10, 8, 3], [1, 1, 1], [16, 4], [7]])
@pytest.mark.parametrize(
    ("src_dtype", "dst_dtype"),
    [
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
    ],
)
def test_a_retyped_layout_lines_up_for_one_copy(
    numels: list[int], src_dtype: torch.dtype, dst_dtype: torch.dtype
) -> None:
    # Where independent 16-byte layouts would not line up (10 fp32 elements end at byte 40;
    # in bf16 the next slot would start at element 16, not 12), the retyped one does.
    src = FlatLayout.build(numels, [src_dtype] * len(numels))
    dst = src.retyped(dst_dtype)
    assert dst.numels == src.numels
    # As many whole elements as the source holds (the end not rounded up to 16 bytes: every
    # rank of an all-gather would send and hold the difference).
    assert dst.nbytes == src.nbytes // src_dtype.itemsize * dst_dtype.itemsize
    n = one_copy_numel(src, dst)
    assert n is not None
    shards = torch.zeros(src.nbytes, dtype=torch.uint8)
    for i, numel in enumerate(numels):
        src.view(shards, i).copy_(torch.randn(numel))
    one = torch.zeros(dst.nbytes, dtype=torch.uint8)
    one.view(dst_dtype)[:n].copy_(shards.view(src_dtype)[:n])
    for i in range(len(numels)):
        assert torch.equal(dst.view(one, i), src.view(shards, i).to(dst_dtype))
