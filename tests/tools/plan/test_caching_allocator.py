"""The CUDA caching allocator's model (``plan.caching_allocator``), rule by rule, on traces
computed by hand from torch's ``c10/cuda/CUDACachingAllocator.cpp``; then the planner's step
replayed through it.

Each trace starts from an empty allocator and says, in its comments, which block each request
gets and why. ``allocated`` is torch's ``allocated_bytes.all.current`` (block sizes) and
``reserved`` its ``reserved_bytes.all.current`` (segments).
"""

from __future__ import annotations

import pytest

from shardkit.tools.plan import plan
from shardkit.tools.plan.caching_allocator import (
    LARGE_SEGMENT,
    MIN_BLOCK,
    SMALL_SEGMENT,
    CachingAllocator,
    KeyedBlocks,
    round_request,
    segment_size,
)
from shardkit.tools.plan.examples import gpt_demo, gpt_demo_inputs
from shardkit.tools.plan.options import PlanOptions

MiB = 2**20


@pytest.mark.parametrize(
    ("nbytes", "size"),
    [(1, 512), (511, 512), (512, 512), (513, 1024), (MiB + 1, MiB + 512), (3 * MiB, 3 * MiB)],
)
def test_requests_round_up_to_512_bytes(nbytes: int, size: int) -> None:
    assert round_request(nbytes) == size


@pytest.mark.parametrize(
    ("size", "segment"),
    [
        (512, SMALL_SEGMENT),  # the small pool's 2 MiB
        (MiB, SMALL_SEGMENT),  # 1 MiB is still small
        (MiB + 512, LARGE_SEGMENT),  # over 1 MiB and under 10 MiB: 20 MiB
        (10 * MiB - 512, LARGE_SEGMENT),
        (10 * MiB, 10 * MiB),  # from 10 MiB on: its own size, rounded to 2 MiB
        (10 * MiB + 512, 12 * MiB),
        (21 * MiB, 22 * MiB),
    ],
)
def test_segment_sizes_by_pool(size: int, segment: int) -> None:
    assert segment_size(size) == segment


def test_small_requests_share_a_2_mib_segment() -> None:
    alloc = CachingAllocator()
    alloc.malloc(1000)  # 1024 bytes, cut from a new 2 MiB segment
    alloc.malloc(1000)  # the next 1024, from the rest of that segment
    assert (alloc.allocated, alloc.reserved, alloc.segments) == (2048, SMALL_SEGMENT, 1)


def test_a_free_large_block_never_serves_a_small_request() -> None:
    alloc = CachingAllocator()
    alloc.free(alloc.malloc(3 * MiB))  # a 20 MiB large segment, all of it free again
    alloc.malloc(512 * 1024)  # small: the large pool's 20 MiB do not serve it
    assert (alloc.reserved, alloc.segments) == (LARGE_SEGMENT + SMALL_SEGMENT, 2)
    alloc.malloc(2 * MiB)  # large: cut from the free 20 MiB, no new segment
    assert alloc.reserved == LARGE_SEGMENT + SMALL_SEGMENT


def test_best_fit_takes_the_smallest_free_block_large_enough() -> None:
    alloc = CachingAllocator()
    a, b, c = alloc.malloc(12 * MiB), alloc.malloc(16 * MiB), alloc.malloc(14 * MiB)
    for address in (a, b, c):
        alloc.free(address)
    # 13 MiB: the 14 MiB block (not the first freed, not the largest); its 1 MiB rest is not
    # split off, so the whole 14 MiB counts as allocated.
    assert alloc.malloc(13 * MiB) == c
    assert (alloc.allocated, alloc.reserved) == (14 * MiB, 42 * MiB)


def test_best_fit_among_equal_sizes_takes_the_lowest_address() -> None:
    alloc = CachingAllocator()
    first, second = alloc.malloc(12 * MiB), alloc.malloc(12 * MiB)
    alloc.free(second)
    alloc.free(first)
    assert alloc.malloc(12 * MiB) == first < second


def test_the_small_pool_splits_off_any_rest_of_512_bytes() -> None:
    alloc = CachingAllocator()
    alloc.malloc(MiB)  # 2 MiB segment: 1 MiB handed out, 1 MiB rest split off
    alloc.malloc(MiB - MIN_BLOCK)  # from the 1 MiB rest: 512 bytes left, split off too
    assert alloc.allocated == 2 * MiB - MIN_BLOCK
    alloc.malloc(1)  # the last 512 bytes: the segment is full, no new one
    assert (alloc.allocated, alloc.reserved, alloc.segments) == (2 * MiB, 2 * MiB, 1)


def test_the_large_pool_splits_only_a_rest_over_1_mib() -> None:
    alloc = CachingAllocator()
    alloc.malloc(9 * MiB)  # a 20 MiB segment: 9 MiB handed out, the 11 MiB rest split off
    assert alloc.allocated == 9 * MiB
    alloc.malloc(10 * MiB)  # the 11 MiB block: a 1 MiB rest is not over 1 MiB: all 11 MiB
    assert (alloc.allocated, alloc.reserved) == (20 * MiB, 20 * MiB)

    split = CachingAllocator()
    split.malloc(9 * MiB)
    split.malloc(10 * MiB - MIN_BLOCK)  # a rest of 1 MiB + 512 bytes: split off
    assert split.allocated == 19 * MiB - MIN_BLOCK


def test_a_request_of_its_own_segment_gets_the_whole_segment_when_the_rest_is_small() -> None:
    alloc = CachingAllocator()
    alloc.malloc(11 * MiB + MiB // 2)  # segment 12 MiB; a 0.5 MiB rest stays in the block
    assert (alloc.allocated, alloc.reserved) == (12 * MiB, 12 * MiB)


def test_freed_neighbours_merge_within_their_segment() -> None:
    alloc = CachingAllocator()
    a, b, c = (alloc.malloc(4 * MiB) for _ in range(3))  # one 20 MiB segment, 8 MiB left
    alloc.free(a)
    alloc.free(c)  # merges with the 8 MiB rest: 12 MiB
    alloc.free(b)  # merges with both: the whole 20 MiB again
    alloc.malloc(18 * MiB)  # fits only because they merged
    assert (alloc.reserved, alloc.segments) == (LARGE_SEGMENT, 1)


def test_blocks_of_different_segments_do_not_merge() -> None:
    alloc = CachingAllocator()
    a, b = alloc.malloc(12 * MiB), alloc.malloc(12 * MiB)  # two segments, side by side
    alloc.free(a)
    alloc.free(b)
    alloc.malloc(24 * MiB)  # no 24 MiB block: a third segment
    assert (alloc.reserved, alloc.segments) == (48 * MiB, 3)


def test_reserved_segments_are_kept_and_peaks_remembered() -> None:
    alloc = CachingAllocator()
    alloc.free(alloc.malloc(50 * MiB))
    assert (alloc.allocated, alloc.reserved) == (0, 50 * MiB)  # no empty_cache
    assert (alloc.peak_allocated, alloc.peak_reserved) == (50 * MiB, 50 * MiB)


def test_keyed_blocks_grow_by_new_blocks_and_shrink_newest_first() -> None:
    blocks = KeyedBlocks()
    alloc = blocks.allocator
    blocks.set("act", 12 * MiB)
    blocks.set("act", 24 * MiB)  # 12 MiB more: a second block while the first lives on
    assert (alloc.allocated, alloc.segments) == (24 * MiB, 2)
    blocks.set("act", 13 * MiB)  # frees the newest 12 MiB; the 1 MiB short is a small block
    assert (alloc.allocated, alloc.reserved) == (13 * MiB, 24 * MiB + SMALL_SEGMENT)
    blocks.merge(["act"], "backward")  # the same tensors, a new owner
    blocks.free("act")  # nothing left under the old key
    assert alloc.allocated == 13 * MiB
    blocks.free("backward")
    assert (alloc.allocated, alloc.reserved) == (0, 24 * MiB + SMALL_SEGMENT)


def test_the_planned_step_replayed_allocates_at_least_the_live_bytes_and_reserves_more() -> None:
    planned = plan(gpt_demo(), world_size=8, options=PlanOptions(inputs=gpt_demo_inputs))
    memory = planned.memory
    # At every sample: the blocks hold the live bytes, rounded up; the segments hold them.
    assert all(p.reserved >= p.allocated >= p.total for p in memory.timeline)
    assert memory.reserved_peak >= memory.allocated_peak >= memory.peak.total > 0
    assert memory.allocated_peak == max(p.allocated for p in memory.timeline)
    # Segments of 20 MiB for a model whose largest buffers are a few MiB: well above live.
    assert memory.reserved_peak > memory.peak.total
    assert memory.reserved_peak % SMALL_SEGMENT == 0  # every segment size is a 2 MiB multiple
    document = planned.to_dict()["memory"]
    assert (document["allocated_peak"], document["reserved_peak"]) == (
        memory.allocated_peak,
        memory.reserved_peak,
    )
