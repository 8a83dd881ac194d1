"""Shard geometry, flat layouts, copy-out and gradient packing, in one process."""

from __future__ import annotations

import pytest
import torch

from shardkit.core.runtime.buffers import (
    FlatLayout,
    ShardGeometry,
    copy_out_unsharded,
    one_copy_numel,
    pack_even_dim0_grads,
    pack_grads_rank_major,
    row_split,
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


def _rows_of(layout: FlatLayout, world: int) -> list[torch.Tensor]:
    """W random uint8 rows (gaps included): a copy that read a gap would show."""
    return [torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8) for _ in range(world)]


def _indexed(
    shapes: list[tuple[int, ...]], world: int, dims: list[int] | None = None
) -> list[tuple[int, ShardGeometry]]:
    dims = dims or [0] * len(shapes)
    return [
        (i, shard_geometry(torch.Size(s), d, world))
        for i, (s, d) in enumerate(zip(shapes, dims, strict=True))
    ]


# Odd sizes leave alignment gaps in the row and the unsharded buffer; (5, 3) and (3,) are
# uneven at W=2 and W=4 (padded shards); (1, 1) is empty on most ranks at W=4.
COPY_SHAPES = [(7, 3), (8, 2), (5, 3), (3,), (16,), (1, 1), (9, 5)]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_row_split_copies_bit_for_bit_as_per_parameter_copies(
    world: int, dtype: torch.dtype
) -> None:
    geometries = _indexed(COPY_SHAPES, world)
    row_layout = FlatLayout.build([g.shard_numel for _, g in geometries], [dtype] * 7)
    layout = FlatLayout.build([world * g.shard_numel for _, g in geometries], [dtype] * 7)
    split = row_split(row_layout, geometries, layout)
    assert split is not None and split.world == world
    assert None in split.starts  # the layouts have gaps, and those are pieces too
    rows = _rows_of(row_layout, world)
    fast, each = (torch.zeros(layout.nbytes, dtype=torch.uint8) for _ in range(2))
    split.copy(rows, split.outputs(fast))
    for i, geo in geometries:
        target = layout.view(each, i)[: world * geo.shard_numel]
        copy_out_unsharded([row_layout.view(row, i) for row in rows], geo, target)
    assert torch.equal(fast, each)  # gaps of the unsharded buffer untouched too


def test_row_split_outputs_survive_freeing_the_storage() -> None:
    # See [Note: unsharded storage]: the views are made once, the memory comes and goes.
    geometries = _indexed([(6, 5), (3,)], 2)
    row_layout = FlatLayout.build([15, 2], [torch.float32] * 2)
    layout = FlatLayout.build([30, 4], [torch.float32] * 2)
    split = row_split(row_layout, geometries, layout)
    assert split is not None
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    outputs = split.outputs(buffer)
    buffer.untyped_storage().resize_(0)
    buffer.untyped_storage().resize_(layout.nbytes)
    rows = _rows_of(row_layout, 2)
    split.copy(rows, outputs)
    for i, (_, geo) in enumerate(geometries):
        full = torch.cat([row_layout.view(row, i) for row in rows])
        got = layout.view(buffer, i)[: 2 * geo.shard_numel]
        assert torch.equal(got.view(torch.uint8), full.view(torch.uint8))


@pytest.mark.parametrize(
    "case", ["dim1", "hook slot", "two dtypes", "rows cast", "unsharded too small", "empty"]
)
def test_no_row_split_where_the_layouts_do_not_allow_it(case: str) -> None:
    f32, bf16 = torch.float32, torch.bfloat16
    geometries = _indexed([(4, 6), (8,)], 2, [1, 0] if case == "dim1" else [0, 0])
    numels = [g.shard_numel for _, g in geometries]
    row_dtypes = [f32, bf16] if case == "two dtypes" else [f32, f32]
    row_layout = FlatLayout.build(numels, row_dtypes)
    out_dtypes = [bf16, bf16] if case == "rows cast" else row_dtypes
    out_numels = [2 * n for n in numels]
    if case == "unsharded too small":
        out_numels[1] -= 1
    layout = FlatLayout.build(out_numels, out_dtypes)
    if case == "hook slot":  # a third slot (a hook's bytes) that no geometry covers
        row_layout = FlatLayout.build([*numels, 32], [f32, f32, torch.uint8])
    if case == "empty":
        geometries = []
    assert row_split(row_layout, geometries, layout) is None


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize(
    ("grad_dtype", "out_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float32),
    ],
)
def test_pack_even_dim0_is_bit_identical_to_the_general_pack(
    world: int, grad_dtype: torch.dtype, out_dtype: torch.dtype
) -> None:
    shapes = [(4, 3), (8,), (12, 5), (4, 2, 3)]
    geometries = [shard_geometry(torch.Size(s), 0, world) for s in shapes]
    offsets = [sum(g.shard_numel for g in geometries[:k]) for k in range(len(shapes))]
    width = offsets[-1] + geometries[-1].shard_numel
    # Values with more mantissa bits than bf16 keeps: a cast that rounded otherwise would show.
    grads: list[torch.Tensor | None] = [torch.randn(s).to(grad_dtype) for s in shapes]
    grads[2] = torch.randn(5, 12).to(grad_dtype).t()  # not contiguous: reshape copies
    fast, each = (torch.full((world, width), float("nan"), dtype=out_dtype) for _ in range(2))
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
    grads: list[torch.Tensor | None] = [torch.randn(s) for s in shapes]
    fast, each = (torch.full((world, cursor), float("nan"), dtype=out_dtype) for _ in range(2))
    assert pack_even_dim0_grads(grads, fast, gaps_after)
    pack_grads_rank_major(grads, geometries, offsets, each)
    filled = torch.zeros(cursor, dtype=torch.bool)
    for offset, geo in zip(offsets, geometries, strict=True):
        filled[offset : offset + geo.shard_numel] = True
    assert torch.equal(fast[:, filled].view(torch.uint8), each[:, filled].view(torch.uint8))
    assert bool((fast[:, ~filled] == 0).all())


def test_pack_even_dim0_leaves_missing_and_recorded_grads_to_the_general_path() -> None:
    rows = torch.full((2, 4), 7.0)
    assert not pack_even_dim0_grads([torch.ones(4), None], rows)
    recorded = torch.ones(4, requires_grad=True) * 2
    assert not pack_even_dim0_grads([recorded], torch.empty(2, 2))
    assert rows.eq(7).all()  # nothing written
    with torch.no_grad():
        out = torch.empty(2, 2)
        assert pack_even_dim0_grads([recorded], out)
    assert torch.equal(out, torch.full((2, 2), 2.0))


def test_unsharded_copy_out_reuses_its_views_until_the_buffer_or_layout_changes() -> None:
    from shardkit.core.unsharded import UnshardedBuffer

    geometries = _indexed(COPY_SHAPES, 2)
    dtypes = [torch.bfloat16] * len(COPY_SHAPES)
    row_layout = FlatLayout.build([g.shard_numel for _, g in geometries], dtypes)
    layout = FlatLayout.build([2 * g.shard_numel for _, g in geometries], dtypes)
    buffer = UnshardedBuffer([], ())  # no parameters to bind: the copy-out alone

    def expect(rows: list[torch.Tensor], tensor: torch.Tensor) -> None:
        for i, geo in geometries:
            full = torch.cat([row_layout.view(row, i) for row in rows])
            got = layout.view(tensor, i)[: 2 * geo.shard_numel]
            assert torch.equal(got.view(torch.uint8), full.view(torch.uint8))  # NaNs too

    first = buffer.allocate(layout, torch.device("cpu"))
    for _ in range(2):  # a reshard and an unshard in between: same storage, new memory
        rows = _rows_of(row_layout, 2)
        buffer.copy_out(rows, row_layout, geometries, layout)
        expect(rows, first)
        buffer.free()
        assert buffer.allocate(layout, torch.device("cpu")) is first
    buffer.forget()  # a new buffer: the old views must not be written through
    second = buffer.allocate(layout, torch.device("cpu"))
    before = first.clone()
    rows = _rows_of(row_layout, 2)
    buffer.copy_out(rows, row_layout, geometries, layout)
    expect(rows, second)
    assert torch.equal(first, before)
    # Another layout object (a re-layout): planned again for it, here one with dim-1 shards.
    dim1 = _indexed([(4, 6), (2, 10)], 2, [1, 1])
    row_layout = FlatLayout.build([12, 10], [torch.bfloat16] * 2)
    layout = FlatLayout.build([24, 20], [torch.bfloat16] * 2)
    buffer.forget()
    tensor = buffer.allocate(layout, torch.device("cpu"))
    rows = _rows_of(row_layout, 2)
    buffer.copy_out(rows, row_layout, dim1, layout)
    for i, geo in dim1:
        out = torch.empty(2 * geo.shard_numel, dtype=torch.bfloat16)
        copy_out_unsharded([row_layout.view(row, i) for row in rows], geo, out)
        assert torch.equal(layout.view(tensor, i).view(torch.uint8), out.view(torch.uint8))
