"""Buffers under collectives in flight: the lifetime checks (``SHARDKIT_DEBUG_LIFETIMES=1``).

An asynchronous collective reads its input and writes its output until its work is waited
for: gloo's threads (NCCL's stream) hold raw pointers into that memory meanwhile. A buffer
released in that window (the unsharded buffer's ``resize_(0)``, a buffer given back to the
pool for the next group to fill) is read as garbage or written after it was freed: heap
corruption that surfaces later and elsewhere, if at all (glibc's "double free or corruption").

With the checks on, the runtime records for each collective it issues the byte ranges it
reads and writes (:func:`track`), until its wait (:meth:`Flight.landed`). The engine asks
:func:`check_release` before every release of a buffer that a collective may use, and a
release that overlaps a collective not yet waited for raises :class:`BufferLifetimeError`,
naming the buffer, the collective, its module and its process group. The other direction
is checked at the wait (:meth:`Flight.landing`): a storage whose memory was freed or moved
since the issue (by code that does not ask: the user's, torch's) is named there.

Off (the default), the runtime pays one flag check per collective and per release. On, a
few microseconds per collective (measured in ``docs/debugging.md``). The records are
process-wide: collectives are issued from the training thread. See [Note: unsharded storage].
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardkit.core.errors import BufferLifetimeError
from shardkit.core.runtime.device import holds_no_memory
from shardkit.core.runtime.watch.progress import CollectiveInfo

__all__ = ["Flight", "check_release", "in_flight", "track"]


@dataclass(frozen=True, slots=True)
class _Span:
    """Bytes a collective reads or writes, and the storage they lie in as it was at issue."""

    role: str  # "input", "output", "input and output"
    start: int  # data_ptr of the first byte
    stop: int  # one past the last byte
    device: torch.device
    storage: torch.UntypedStorage  # held: the wait looks whether its memory is still there
    base: int  # the storage's data_ptr at issue
    nbytes: int  # the storage's bytes at issue

    @staticmethod
    def of(tensor: torch.Tensor, role: str) -> _Span | None:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0 or holds_no_memory(tensor):
            return None
        storage = tensor.untyped_storage()
        start = tensor.data_ptr()
        base, held = storage.data_ptr(), storage.nbytes()
        return _Span(role, start, start + nbytes, tensor.device, storage, base, held)

    def describe(self) -> str:
        return f"its {self.role} ({self.stop - self.start} bytes at {self.start:#x})"


@dataclass(eq=False, slots=True, weakref_slot=True)
class Flight:
    """One collective issued and not yet waited for: the memory it may touch."""

    info: CollectiveInfo
    group: dist.ProcessGroup
    spans: tuple[_Span, ...]
    order: int  # issue order, process-wide

    def describe(self) -> str:
        """The collective, its module (label) and its process group."""
        try:
            ranks = dist.get_process_group_ranks(self.group)
            backend = dist.get_backend(self.group)
            where = f"the process group of ranks {ranks} ({backend})"
        except (RuntimeError, ValueError):  # a group destroyed since: its size at least
            where = f"a process group of {self.group.size()} ranks"
        return f"{self.info.detail()} on {where}"

    def landing(self) -> None:
        """Before the wait: raise if memory the collective uses was freed or moved meanwhile."""
        for span in self.spans:
            if span.storage.data_ptr() != span.base or span.storage.nbytes() < span.nbytes:
                raise BufferLifetimeError(
                    f"{self.describe()}: {span.describe()} was released before the "
                    "collective was waited for (its storage now holds "
                    f"{span.storage.nbytes()} bytes at {span.storage.data_ptr():#x}); a "
                    "collective's buffers must stay allocated until its wait returns"
                )

    def landed(self) -> None:
        """The wait returned: its memory is the engine's again."""
        _IN_FLIGHT.discard(self)


# Collectives issued and not yet waited for (a handful at a time: prefetches). Held through
# their handles: a collective abandoned by an error stays while its handle does (its messages
# may still arrive); once nothing can wait for it, nothing can release its buffers either
# (the pool gets them back from the handle), and c10d's work keeps their memory until done.
_IN_FLIGHT: weakref.WeakSet[Flight] = weakref.WeakSet()
_ISSUED = itertools.count()


def track(
    info: CollectiveInfo,
    group: dist.ProcessGroup,
    *,
    reads: Sequence[torch.Tensor] = (),
    writes: Sequence[torch.Tensor] = (),
    reads_and_writes: Sequence[torch.Tensor] = (),
) -> Flight:
    """Record a collective just issued: the tensors it reads and writes until its wait."""
    roles = (("input", reads), ("output", writes), ("input and output", reads_and_writes))
    spans = (_Span.of(t, role) for role, tensors in roles for t in tensors)
    flight = Flight(info, group, tuple(s for s in spans if s is not None), next(_ISSUED))
    _IN_FLIGHT.add(flight)
    return flight


def check_release(buffer: torch.Tensor, what: str) -> None:
    """Raise if a collective not yet waited for reads or writes ``buffer``'s storage.

    Called just before the storage's memory is freed or handed to another user. ``what``
    names the buffer and whose it is (a module, a pool).

    Raises:
        BufferLifetimeError: naming ``what``, the collective and the bytes it still uses.
    """
    if holds_no_memory(buffer):
        return
    storage = buffer.untyped_storage()
    start = storage.data_ptr()
    stop = start + storage.nbytes()
    if stop == start:
        return
    for flight in tuple(_IN_FLIGHT):
        for span in flight.spans:
            if span.start < stop and start < span.stop and span.device == buffer.device:
                raise BufferLifetimeError(
                    f"{what} ({stop - start} bytes at {start:#x}) is released while "
                    f"{flight.describe()} still uses {span.describe()}: wait for the "
                    "collective first, or keep the buffer until it was waited for"
                )


def in_flight() -> tuple[Flight, ...]:
    """The collectives issued and not yet waited for, oldest first (tests, reports)."""
    return tuple(sorted(_IN_FLIGHT, key=lambda flight: flight.order))
