"""The planner's bookkeeping of live buffers, and the engine's buffer pool replayed on sizes.

Which sizes the pool keeps is the core's rule (``shardkit.core.layout.pooled_sizes``); when
buffers come and go is the planner's step model (``step``). Each device buffer is also
replayed, in order, through torch's CUDA caching allocator (``caching_allocator``): the
samples carry its allocated and reserved bytes beside the live ones.
"""

from __future__ import annotations

from shardkit.tools.plan.caching_allocator import KeyedBlocks
from shardkit.tools.plan.records import MemoryPoint
from shardkit.tools.records import Category, Phase

__all__ = ["Key", "Ledger", "Pool"]

Key = tuple[str, int]
"""Names one live buffer: (what, whose index)."""


class Ledger:
    """Live buffers by key; samples the totals at each allocation."""

    def __init__(self) -> None:
        self.live: dict[Key, tuple[Category, int]] = {}
        self.totals = dict.fromkeys(Category, 0)
        self.host: dict[Key, tuple[Category, int]] = {}  # buffers in host memory (offload)
        self.host_totals: dict[Category, int] = {}
        self.points: list[MemoryPoint] = []
        self.phase = Phase.OTHER
        self.module = ""
        self.blocks = KeyedBlocks()
        """The device buffers as the CUDA caching allocator's blocks."""

    def alloc(self, key: Key, category: Category, nbytes: int, label: str) -> None:
        """Add a live buffer and sample the totals (``label`` says what happened)."""
        assert key not in self.live, f"planner bug: {key} allocated twice"
        self.blocks.alloc(key, nbytes)
        self._add(key, category, nbytes, label)

    def _add(self, key: Key, category: Category, nbytes: int, label: str) -> None:
        self.live[key] = (category, nbytes)
        self.totals[category] += nbytes
        self._sample(label)

    def alloc_host(self, key: Key, category: Category, nbytes: int, label: str) -> None:
        """Add a buffer in host memory (CPU offload): sampled apart from the device's."""
        assert key not in self.host, f"planner bug: host {key} allocated twice"
        self.host[key] = (category, nbytes)
        self.host_totals[category] = self.host_totals.get(category, 0) + nbytes
        self._sample(label)

    def free_host(self, key: Key) -> None:
        """Drop a buffer in host memory."""
        category, nbytes = self.host.pop(key)
        self.host_totals[category] -= nbytes

    def _sample(self, label: str) -> None:
        self.points.append(
            MemoryPoint(
                label=label,
                module=self.module,
                phase=self.phase,
                by_category=dict(self.totals),
                host_by_category=dict(self.host_totals),
                allocated=self.blocks.allocator.allocated,
                reserved=self.blocks.allocator.reserved,
            )
        )

    def set(self, key: Key, category: Category, nbytes: int, label: str) -> None:
        """Make ``key`` hold ``nbytes`` (sampled only if that is more than before)."""
        before = self.live.pop(key, (category, 0))[1]
        self.totals[category] -= before
        self.blocks.set(key, nbytes)
        if nbytes > before:
            self._add(key, category, nbytes, label)
        elif nbytes:
            self.live[key] = (category, nbytes)
            self.totals[category] += nbytes

    def free(self, key: Key) -> None:
        """Drop a live buffer."""
        category, nbytes = self.live.pop(key)
        self.totals[category] -= nbytes
        self.blocks.free(key)

    def move(self, key: Key, new_key: Key, category: Category | None = None) -> None:
        """Rename a live buffer (and recategorise it): same memory, a new owner."""
        old_category, nbytes = self.live.pop(key)
        self.totals[old_category] -= nbytes
        self.blocks.move(key, new_key)
        category = category or old_category
        self.live[new_key] = (category, nbytes)
        self.totals[category] += nbytes


class Pool:
    """shardkit.core's BufferPool on sizes: at most one idle buffer per size it keeps."""

    def __init__(self, ledger: Ledger, kept: frozenset[int]) -> None:
        """``kept``: the sizes it keeps buffers of (``shardkit.core.layout.pooled_sizes``)."""
        self.ledger = ledger
        self.kept = kept
        self.idle: set[int] = set()
        self.retain = True
        """Off from the end of forward to the next forward, as in the engine."""

    def get(self, nbytes: int, key: Key, label: str) -> None:
        """Hand out an idle buffer of this size as ``key``, or allocate one."""
        if nbytes in self.idle:
            self.idle.discard(nbytes)
            self.ledger.move(("pool", nbytes), key)
        else:
            self.ledger.alloc(key, Category.COMM_BUFFERS, nbytes, label)

    def put(self, nbytes: int, key: Key) -> None:
        """Take ``key`` back: keep it idle if the pool keeps its size and has none, else free it."""
        if not self.retain or nbytes not in self.kept or nbytes in self.idle:
            self.ledger.free(key)
        else:
            self.idle.add(nbytes)
            self.ledger.move(key, ("pool", nbytes))

    def clear(self) -> None:
        """Free every idle buffer."""
        for nbytes in self.idle:
            self.ledger.free(("pool", nbytes))
        self.idle.clear()
