"""torch's CUDA caching allocator, replayed on the planner's allocations.

The ledger (``ledger``) counts live tensor bytes; a GPU holds more. torch's caching allocator
(``c10/cuda/CUDACachingAllocator.cpp``, with its defaults: no ``max_split_size_mb``, no
``roundup_power2_divisions``, no expandable segments, no ``empty_cache``) hands out *blocks*
cut from *segments* it gets from ``cudaMalloc``, and keeps freed blocks for reuse. Its
``allocated_bytes`` counts block sizes and ``reserved_bytes`` counts segments, so both exceed
the live bytes. The rules modelled here, as the allocator applies them:

- A request is rounded up to a multiple of 512 bytes (``MIN_BLOCK``).
- Requests of at most 1 MiB (``SMALL_REQUEST``) come from the small pool, larger ones from the
  large pool; a freed block only serves requests of its own pool.
- A request first takes the smallest free block of its pool that is large enough (equal sizes:
  the lowest address). With none, a new segment: 2 MiB for the small pool; 20 MiB for a large
  request under 10 MiB; the request rounded up to 2 MiB otherwise.
- The block taken is split, its front handed out and the rest kept free, only if the rest is
  at least 512 bytes (small pool) or more than 1 MiB (large pool). Otherwise the whole block is
  handed out, and counted as allocated, however much larger than the request it is.
- A freed block merges with free neighbours in its segment. Segments are never given back.

Not modelled: streams (the allocator keeps free blocks per stream; here all share one, so the
model may reuse a block that a side stream's request could not), the order of addresses
``cudaMalloc`` returns (new segments get increasing addresses here), and each ledger entry is
one block, where an entry that stands for many tensors (a segment's activations) is many
blocks, each rounded. See docs/guide/tools.md ("What the budget counts").
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

__all__ = [
    "LARGE_SEGMENT",
    "MIN_BLOCK",
    "MIN_LARGE_ALLOC",
    "ROUND_LARGE",
    "SMALL_REQUEST",
    "SMALL_SEGMENT",
    "CachingAllocator",
    "KeyedBlocks",
    "round_request",
    "segment_size",
]

MIN_BLOCK = 512
"""Every request is rounded up to a multiple of this (torch's ``kMinBlockSize``)."""
SMALL_REQUEST = 2**20
"""The largest request the small pool serves (``kSmallSize``)."""
SMALL_SEGMENT = 2 * 2**20
"""The small pool's segments (``kSmallBuffer``)."""
LARGE_SEGMENT = 20 * 2**20
"""The large pool's segment for a request under ``MIN_LARGE_ALLOC`` (``kLargeBuffer``)."""
MIN_LARGE_ALLOC = 10 * 2**20
"""From this size on a request gets a segment of its own size (``kMinLargeAlloc``)."""
ROUND_LARGE = 2 * 2**20
"""Such a segment is the request rounded up to a multiple of this (``kRoundLarge``)."""


def round_request(nbytes: int) -> int:
    """The block size a request of ``nbytes`` asks for (at least ``MIN_BLOCK``)."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """The segment ``cudaMalloc``'d for a rounded request of ``size`` that no free block fits."""
    if size <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False, slots=True)
class _Block:
    """A contiguous piece of one segment, free or handed out; neighbours in its segment."""

    address: int
    size: int
    small: bool
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None


class CachingAllocator:
    """The allocator's pools on sizes: ``malloc`` and ``free``, and the byte counts it reports.

    ``allocated``/``reserved`` are ``torch.cuda.memory_stats()``'s ``allocated_bytes.all`` and
    ``reserved_bytes.all`` (current), and the ``peak_*`` figures their ``.peak``.
    """

    def __init__(self) -> None:
        # Free blocks per pool (True: small), sorted as the allocator's sets are: by size,
        # then address. The tuples lead with what the best fit compares.
        self._free: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
        self._blocks: dict[int, _Block] = {}  # every block by address, free or not
        self._next_address = 0
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.segments = 0

    def malloc(self, nbytes: int) -> int:
        """Hand out a block for ``nbytes`` (> 0); returns its address, which ``free`` takes."""
        assert nbytes > 0, "the allocator hands out no block for zero bytes"
        size = round_request(nbytes)
        small = size <= SMALL_REQUEST
        pool = self._free[small]
        # Best fit: the first free block of at least ``size`` in (size, address) order.
        i = bisect.bisect_left(pool, (size, -1))
        found = i < len(pool)
        block = self._blocks[pool.pop(i)[1]] if found else self._new_segment(size, small)
        rest = block.size - size
        # The small pool splits off any usable rest; the large pool only a rest that could
        # serve a large request (over 1 MiB), so a 1 MiB sliver stays inside the block handed
        # out, counted as allocated.
        if rest >= MIN_BLOCK if small else rest > SMALL_REQUEST:
            tail = _Block(block.address + size, rest, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            self._blocks[tail.address] = tail
            bisect.insort(pool, (tail.size, tail.address))
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block.address

    def free(self, address: int) -> None:
        """Take a block back: it merges with free neighbours and stays cached."""
        block = self._blocks[address]
        assert not block.free, f"planner bug: block at {address} freed twice"
        block.free = True
        self.allocated -= block.size
        pool = self._free[block.small]
        for neighbour in (block.prev, block.next):
            if neighbour is None or not neighbour.free:
                continue
            pool.pop(bisect.bisect_left(pool, (neighbour.size, neighbour.address)))
            del self._blocks[neighbour.address]
            if neighbour is block.prev:
                del self._blocks[block.address]
                block.address, block.prev = neighbour.address, neighbour.prev
                if block.prev is not None:
                    block.prev.next = block
                self._blocks[block.address] = block
            else:
                block.next = neighbour.next
                if block.next is not None:
                    block.next.prev = block
            block.size += neighbour.size
        bisect.insort(pool, (block.size, block.address))

    def _new_segment(self, size: int, small: bool) -> _Block:
        total = segment_size(size)
        block = _Block(self._next_address, total, small)
        self._blocks[block.address] = block
        self._next_address += total
        self.reserved += total
        self.segments += 1
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block


class KeyedBlocks:
    """The ledger's buffers as the allocator's blocks: a key holds a stack of blocks.

    ``alloc``/``free``/``move`` are one block each. ``set`` changes what a key holds the way
    tensors come and go: growing adds a block for the difference (the new tensors, while the
    old ones live on), shrinking frees the newest blocks first (autograd frees saved tensors
    in reverse) and, when that frees too much, allocates the difference again.
    """

    def __init__(self, allocator: CachingAllocator | None = None) -> None:
        self.allocator = allocator if allocator is not None else CachingAllocator()
        self._held: dict[Hashable, list[tuple[int, int]]] = {}  # key: [(address, nbytes)]

    def alloc(self, key: Hashable, nbytes: int) -> None:
        """``key`` holds ``nbytes`` more (no block for zero bytes, as in torch)."""
        if nbytes > 0:
            held = self._held.setdefault(key, [])
            held.append((self.allocator.malloc(nbytes), nbytes))

    def free(self, key: Hashable) -> None:
        """Free every block of ``key``."""
        for address, _ in reversed(self._held.pop(key, [])):
            self.allocator.free(address)

    def move(self, key: Hashable, new_key: Hashable) -> None:
        """The same blocks under a new owner."""
        held = self._held.pop(key, [])
        if held:
            self._held[new_key] = held

    def merge(self, keys: Iterable[Hashable], into: Hashable) -> None:
        """The blocks of ``keys``, in their order, now held by ``into`` (on top of its own).

        For bytes the ledger re-labels without freeing them: backward's one measured level of
        activations stands for forward's per-segment records, and the tensors are the same.
        """
        merged = self._held.pop(into, [])
        for key in keys:
            merged += self._held.pop(key, [])
        if merged:
            self._held[into] = merged

    def set(self, key: Hashable, nbytes: int) -> None:
        """Make ``key`` hold ``nbytes``."""
        held = self._held.get(key, [])
        current = sum(n for _, n in held)
        while held and current > nbytes:
            address, n = held.pop()
            self.allocator.free(address)
            current -= n
        if not held:
            self._held.pop(key, None)
        self.alloc(key, nbytes - current)
