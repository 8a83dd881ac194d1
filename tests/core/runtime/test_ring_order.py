"""The exchange reduce-scatter adds rows in gloo's order: its result is gloo's, bit for bit.

On gloo shardkit reduce-scatters by exchanging rows (half the bytes of gloo's own, which runs
an all-reduce) and adds them itself. torch's ``fully_shard`` runs gloo's, whose ring adds
the ranks in an order of its own, per chunk of segments that need not line up with the rows
(``runtime/ring_order.py``). The oracle is gloo's ``reduce_scatter_tensor`` on the same rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness.pool import run_on_ranks
from shardkit.core.runtime.ring_order import ring_fold_order, ring_owners

# Row lengths: one element, odd (the chunks split rows), even, and more than gloo's 1 MiB
# segments (several segments per rank, odd and even).
ROWS = (1, 65, 1000, 300_001, 262_144)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _mismatches(rank: int, world_size: int) -> list[tuple[str, int, int]]:
    from shardkit.core.runtime.collectives import ProcessGroupRuntime

    runtime, group = ProcessGroupRuntime(), dist.group.WORLD
    assert group is not None
    found = []
    for dtype in DTYPES:
        for row in ROWS:
            torch.manual_seed(row + 31 * rank)
            rows = (torch.randn(world_size, row) * 100).to(dtype)  # large: rounding shows
            theirs = torch.empty(row, dtype=dtype)
            dist.reduce_scatter_tensor(theirs, rows.clone().view(-1))
            ours = torch.empty(row, dtype=dtype)
            runtime.reduce_scatter(ours, rows.clone(), group).wait()
            if not torch.equal(ours, theirs):
                found.append((str(dtype), row, int((ours != theirs).sum())))
    return found


@pytest.mark.parametrize("world_size", [3, 4])
def test_the_exchange_sums_as_gloo_does(world_size: int) -> None:
    assert run_on_ranks(world_size, _mismatches, timeout_s=240) == [[]] * world_size


def test_a_row_splits_where_gloo_cuts_its_chunks() -> None:
    # W=4, 65 float32 per row: 260 elements in 8 segments of 33, two per rank (chunks of 66):
    # row 1 (65..129) is rank 0's chunk up to 65, then rank 1's up to 131.
    assert ring_owners(65, 1, 4, 4) == [(0, 1, 0), (1, 65, 1)]
    assert ring_owners(64, 1, 4, 4) == [(0, 64, 1)]  # even rows line up
    assert ring_fold_order(1, 4) == [0, 3, 2, 1]
    # Past 1 MiB the buffer takes more segments, still a whole number per rank.
    assert ring_owners(300_001, 3, 4, 4)[-1][2] == 3
