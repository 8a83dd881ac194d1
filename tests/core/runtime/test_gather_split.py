"""The copy-out of gathered rows: one split per block of rows, bit for bit as per-rank copies."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from shardkit.core.runtime.buffers import FlatLayout, ShardGeometry, copy_out_unsharded
from shardkit.core.runtime.buffers import shard_geometry as geometry
from shardkit.core.runtime.gather_split import GatherSplit, SplitTarget
from shardkit.core.runtime.protocol import RowBlock, rows_of
from shardkit.tools import OpCounter

# Odd sizes leave alignment gaps in the row and the unsharded buffer; (5, 3) and (3,) are
# uneven at W=2 and W=4 (padded shards); (1, 1) is empty on most ranks at W=4.
SHAPES = [(7, 3), (8, 2), (5, 3), (3,), (16,), (1, 1), (9, 5)]


def _plan(world: int, dtype: torch.dtype) -> tuple[list[ShardGeometry], FlatLayout, FlatLayout]:
    geos = [geometry(torch.Size(s), 0, world) for s in SHAPES]
    row = FlatLayout.build([g.shard_numel for g in geos], [dtype] * len(geos))
    full = FlatLayout.build([world * g.shard_numel for g in geos], [dtype] * len(geos))
    return geos, row, full


def _targets(
    geos: list[ShardGeometry], row: FlatLayout, full: FlatLayout, buffer: torch.Tensor
) -> list[SplitTarget]:
    return [
        SplitTarget(row.offsets[i], full.view(buffer, i).view(torch.uint8).view(g.world, -1))
        for i, g in enumerate(geos)
        if g.shard_numel
    ]


def _blocks(rows: torch.Tensor, split_at: int | None) -> list[RowBlock]:
    """One block, or three with rank ``split_at``'s row on its own (a gloo exchange's)."""
    if split_at is None:
        return [RowBlock(0, rows)]
    blocks = [
        RowBlock(0, rows[:split_at]),
        RowBlock(split_at, rows[split_at : split_at + 1].clone()),
        RowBlock(split_at + 1, rows[split_at + 1 :]),
    ]
    return [b for b in blocks if b.rows.shape[0]]


# (world, the rank whose row comes on its own as in a gloo exchange, or None: one block)
BLOCKINGS = [(1, None), (1, 0), (2, None), (2, 0), (2, 1), (4, None), (4, 0), (4, 1), (4, 3)]


@pytest.mark.parametrize(("world", "own_row"), BLOCKINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_split_copies_bit_for_bit_as_per_rank_copies(
    world: int, own_row: int | None, dtype: torch.dtype
) -> None:
    geos, row, full = _plan(world, dtype)
    split_out, each_out = (torch.zeros(full.nbytes, dtype=torch.uint8) for _ in range(2))
    split = GatherSplit(row.nbytes, _targets(geos, row, full, split_out), world)
    # Random bytes everywhere, gaps included: a copy that read or wrote a gap would show.
    rows = torch.randint(0, 256, (world, row.nbytes), dtype=torch.uint8)
    split.copy(_blocks(rows, own_row))
    for i, geo in enumerate(geos):
        target = full.view(each_out, i)[: world * geo.shard_numel]
        copy_out_unsharded([row.view(r, i) for r in rows.unbind(0)], geo, target)
    assert torch.equal(split_out, each_out)  # the unsharded buffer's gaps untouched too


def test_the_targets_survive_freeing_their_memory() -> None:
    # See [Note: unsharded storage]: the views are made once, the memory comes and goes.
    geos, row, full = _plan(2, torch.float32)
    buffer = torch.zeros(full.nbytes, dtype=torch.uint8)
    split = GatherSplit(row.nbytes, _targets(geos, row, full, buffer), 2)
    for _ in range(2):
        buffer.untyped_storage().resize_(0)
        buffer.untyped_storage().resize_(full.nbytes)
        rows = torch.randint(0, 256, (2, row.nbytes), dtype=torch.uint8)
        split.copy(_blocks(rows, 1))
        for i, geo in enumerate(geos):
            got = full.view(buffer, i)[: 2 * geo.shard_numel].view(torch.uint8)
            assert torch.equal(got, torch.cat([row.view(r, i) for r in rows]).view(torch.uint8))


def test_rows_of_gives_every_rank_in_order() -> None:
    rows = torch.arange(12, dtype=torch.uint8).view(4, 3)
    assert [r.tolist() for r in rows_of(_blocks(rows, 2))] == rows.tolist()


@pytest.mark.parametrize("case", ["overlap", "past the row", "wrong world", "not bytes"])
def test_a_bad_target_is_refused(case: str) -> None:
    good = torch.empty(2, 8, dtype=torch.uint8)
    targets = [SplitTarget(0, good)]
    if case == "overlap":
        targets.append(SplitTarget(4, good))
    elif case == "past the row":
        targets = [SplitTarget(12, good)]
    elif case == "wrong world":
        targets = [SplitTarget(0, torch.empty(3, 8, dtype=torch.uint8))]
    else:
        targets = [SplitTarget(0, torch.empty(2, 2))]
    with pytest.raises(ValueError, match="split target"):
        GatherSplit(16, targets, 2)


def _ops_of_copies(world: int) -> Counter[str]:
    geos, row, full = _plan(world, torch.bfloat16)
    buffer = torch.zeros(full.nbytes, dtype=torch.uint8)
    split = GatherSplit(row.nbytes, _targets(geos, row, full, buffer), world)
    rows = torch.zeros(world, row.nbytes, dtype=torch.uint8)
    exchange, native = _blocks(rows, world // 2), _blocks(rows, None)
    split.copy(exchange)  # the first copy of each block shape makes its views
    with OpCounter() as counter:
        split.copy(exchange)
        split.copy(native)
    ops: Counter[str] = counter.by_op
    return ops


def test_a_copy_is_one_operation_per_block_at_any_world_size() -> None:
    copies = Counter({"aten.split_with_sizes_copy": 4})  # three blocks, then one
    assert _ops_of_copies(64) == _ops_of_copies(8) == copies
