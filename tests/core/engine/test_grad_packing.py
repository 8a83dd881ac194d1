"""Packing full gradients rank-major for a reduce-scatter: every way writes the same bytes."""

from __future__ import annotations

import pytest
import torch

from shardkit.core.engine.reduce.packing import (
    pack_dim0_grads_fused,
    pack_even_dim0_grads,
    pack_grads_rank_major,
)
from shardkit.core.runtime.buffers import copy_out_unsharded, shard_geometry
from shardkit.tools import OpCounter
from tests.core.torch_releases import INSTALLED


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


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_even_dim0_is_bit_identical_to_the_general_pack(
    world: int, dtype: torch.dtype
) -> None:
    shapes = [(4, 3), (8,), (12, 5), (4, 2, 3)]
    geometries = [shard_geometry(torch.Size(s), 0, world) for s in shapes]
    offsets = [sum(g.shard_numel for g in geometries[:k]) for k in range(len(shapes))]
    width = offsets[-1] + geometries[-1].shard_numel
    # Values with more mantissa bits than bf16 keeps: a cast that rounded otherwise would show.
    grads: list[torch.Tensor | None] = [torch.randn(s).to(dtype) for s in shapes]
    grads[2] = torch.randn(5, 12).to(dtype).t()  # not contiguous: reshape copies
    fast, each = (torch.full((world, width), float("nan"), dtype=dtype) for _ in range(2))
    assert pack_even_dim0_grads(grads, fast)
    pack_grads_rank_major(grads, geometries, offsets, each)
    assert torch.equal(fast.view(torch.uint8), each.view(torch.uint8))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_pack_even_dim0_with_gaps_writes_zeros_between_as_the_general_pack_does(
    out_dtype: torch.dtype,
) -> None:
    world = 2
    shapes = [(4, 3), (6,), (2, 5)]
    geometries = [shard_geometry(torch.Size(s), 0, world) for s in shapes]
    gaps_after = [1, 0, 3]  # a flat-shard layout's alignment, and a trailing gap
    offsets, cursor = [], 0
    for geo, gap in zip(geometries, gaps_after, strict=True):
        offsets.append(cursor)
        cursor += geo.shard_numel + gap
    grads: list[torch.Tensor | None] = [torch.randn(s).to(out_dtype) for s in shapes]
    fast, each = (torch.full((world, cursor), float("nan"), dtype=out_dtype) for _ in range(2))
    assert pack_even_dim0_grads(grads, fast, gaps_after)
    pack_grads_rank_major(grads, geometries, offsets, each, gaps_after)
    assert torch.equal(fast.view(torch.uint8), each.view(torch.uint8))  # gaps zeroed by both
    filled = torch.zeros(cursor, dtype=torch.bool)
    for offset, geo in zip(offsets, geometries, strict=True):
        filled[offset : offset + geo.shard_numel] = True
    assert bool((fast[:, ~filled] == 0).all())


def test_pack_even_dim0_leaves_missing_cast_and_recorded_grads_to_the_general_path() -> None:
    rows = torch.full((2, 4), 7.0)
    assert not pack_even_dim0_grads([torch.ones(4), None], rows)
    assert not pack_even_dim0_grads([torch.ones(8, dtype=torch.bfloat16)], rows)
    recorded = torch.ones(4, requires_grad=True) * 2
    assert not pack_even_dim0_grads([recorded], torch.empty(2, 2))
    assert rows.eq(7).all()  # nothing written
    with torch.no_grad():
        out = torch.empty(2, 2)
        assert pack_even_dim0_grads([recorded], out)
    assert torch.equal(out, torch.full((2, 2), 2.0))


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize(
    ("grad_dtype", "out_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float16),
    ],
)
def test_the_general_pack_puts_each_rank_shard_in_its_row(
    world: int, grad_dtype: torch.dtype, out_dtype: torch.dtype
) -> None:
    # Even, uneven and dim-1 shards, a missing gradient, a cast and gaps in one group.
    shapes, dims = [(5, 3), (4, 8), (8,), (3,), (1, 2)], [0, 1, 0, 0, 0]
    geometries = [
        shard_geometry(torch.Size(s), d, world) for s, d in zip(shapes, dims, strict=True)
    ]
    gaps_after = [2, 0, 1, 0, 3]
    offsets, cursor = [], 0
    for geo, gap in zip(geometries, gaps_after, strict=True):
        offsets.append(cursor)
        cursor += geo.shard_numel + gap
    grads: list[torch.Tensor | None] = [torch.randn(s).to(grad_dtype) for s in shapes]
    grads[3] = None
    out = torch.full((world, cursor), float("nan"), dtype=out_dtype)
    pack_grads_rank_major(grads, geometries, offsets, out, gaps_after)
    expected = torch.zeros(world, cursor, dtype=out_dtype)
    for grad, geo, offset, d in zip(grads, geometries, offsets, dims, strict=True):
        if grad is None:
            continue
        for rank, chunk in enumerate(torch.chunk(grad, world, d)):
            shard = torch.zeros(geo.padded_shard_shape, dtype=out_dtype)
            shard.narrow(d, 0, chunk.shape[d]).copy_(chunk)
            expected[rank, offset : offset + geo.shard_numel] = shard.reshape(-1)
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))


# Uneven dim-0 shards (5 and 3 rows at W=4 and W=8, 1 row: empty shards past the first rank)
# and even ones, as a group of one dtype packs them.
FUSED_SHAPES = [(5, 3), (8,), (3,), (1, 2), (16, 4)]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize(
    ("grad_dtype", "out_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
    ],
)
def test_the_fused_pack_is_bit_identical_to_the_general_pack(
    world: int, grad_dtype: torch.dtype, out_dtype: torch.dtype
) -> None:
    geometries = [shard_geometry(torch.Size(s), 0, world) for s in FUSED_SHAPES]
    offsets = [sum(g.shard_numel for g in geometries[:k]) for k in range(len(geometries))]
    width = offsets[-1] + geometries[-1].shard_numel
    grads: list[torch.Tensor | None] = [torch.randn(s).to(grad_dtype) for s in FUSED_SHAPES]
    fused, each = (torch.full((world, width), float("nan"), dtype=out_dtype) for _ in range(2))
    assert pack_dim0_grads_fused(grads, fused)
    pack_grads_rank_major(grads, geometries, offsets, each)
    assert torch.equal(fused.view(torch.uint8), each.view(torch.uint8))  # padding zeroed too


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_a_group_of_two_gradient_dtypes_packs_fused_from_torch_2_15(world: int) -> None:
    # bf16 gradients beside fp32 ones (TP-replicated parameters keep autograd's upcast from
    # torch 2.15 on): one kernel as torch's, else left to the general pack, nothing written.
    geometries = [shard_geometry(torch.Size(s), 0, world) for s in FUSED_SHAPES]
    offsets = [sum(g.shard_numel for g in geometries[:k]) for k in range(len(geometries))]
    width = offsets[-1] + geometries[-1].shard_numel
    dtypes = [torch.bfloat16, torch.float32] * len(FUSED_SHAPES)
    grads: list[torch.Tensor | None] = [
        torch.randn(s).to(dtype) for s, dtype in zip(FUSED_SHAPES, dtypes, strict=False)
    ]
    fused, each = (torch.full((world, width), float("nan")) for _ in range(2))
    pack_grads_rank_major(grads, geometries, offsets, each)
    with OpCounter() as counter:
        packed = pack_dim0_grads_fused(grads, fused)
    if INSTALLED < (2, 15):
        assert not packed and fused.isnan().all()
        return
    assert packed and counter.total == 1
    assert torch.equal(fused.view(torch.uint8), each.view(torch.uint8))


def test_the_fused_pack_leaves_what_it_cannot_do_to_the_others() -> None:
    rows = torch.full((2, 4), 7.0)
    assert not pack_dim0_grads_fused([torch.ones(4), None], rows)
    recorded = torch.ones(8, requires_grad=True) * 2
    assert not pack_dim0_grads_fused([recorded], rows)
    assert rows.eq(7).all()  # nothing written


def _general_pack_ops(world: int) -> int:
    # 2W + 3 rows in chunks of 3: whole shards, one cut short and empty ones at any W.
    shapes = [(2 * world + 3, 3), (2 * world + 3,), (world, 2)]
    geometries = [shard_geometry(torch.Size(s), 0, world) for s in shapes]
    offsets = [sum(g.shard_numel for g in geometries[:k]) for k in range(len(geometries))]
    grads: list[torch.Tensor | None] = [torch.randn(s) for s in shapes]
    out = torch.empty(world, offsets[-1] + geometries[-1].shard_numel)
    with OpCounter() as counter:
        pack_grads_rank_major(grads, geometries, offsets, out)
    return counter.total


def test_uneven_shards_pack_in_as_many_operations_at_any_world_size() -> None:
    # Packing rank by rank would grow with W: a step of many ranks is then launch-bound.
    assert _general_pack_ops(64) == _general_pack_ops(8)
