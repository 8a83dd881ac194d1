"""The shared-memory segments' lifetime: the sender creates and unlinks, the receiver maps.

A segment the sender creates is registered with its process's ``multiprocessing`` resource
tracker, which unlinks it if the sender dies without doing so (killed mid-export, say): a
segment left behind holds its bytes in ``/dev/shm``, that is in memory, until the host
reboots. The receiving side must map the segment without touching that registration. Before
Python 3.13, mapping a segment by name registers it with the mapping process's tracker too,
and the usual repair, unregistering it right after, goes to the same tracker as the sender's
registration wherever the receiving process was forked from the sender's (vLLM's engine core
started from a trainer rank): the tracker keeps one entry per name, so the receiver's
unregister dropped the sender's, and a sender killed later left its segments behind for good.
So on those versions the receiving side maps the segment itself, and no tracker hears of it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import mmap
import os
import sys
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Protocol

__all__ = ["MappedSegment", "attach", "release"]

logger = logging.getLogger(__name__)


class MappedSegment(Protocol):
    """What the serving side uses of a segment it maps (``SharedMemory`` has all of it)."""

    @property
    def name(self) -> str:
        """The segment's name, without the leading slash."""
        ...

    @property
    def size(self) -> int:
        """Its bytes."""
        ...

    @property
    def buf(self) -> memoryview | None:
        """Its memory; None once closed."""
        ...

    def close(self) -> None:
        """Unmap it; ``BufferError`` while a tensor still views the memory."""
        ...


class _UntrackedSegment:
    """A segment mapped by name with no resource tracker told (POSIX, Python < 3.13)."""

    def __init__(self, name: str) -> None:
        # CPython's own binding of shm_open, which SharedMemory opens segments with (no stub).
        posix_shm: Any = importlib.import_module("_posixshmem")
        fd: int = posix_shm.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            self._size = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, self._size)
        finally:
            os.close(fd)  # the mapping keeps the memory; the descriptor is not needed
        self._name = name
        self._buf: memoryview | None = memoryview(self._mmap)

    @property
    def name(self) -> str:
        return self._name

    @property
    def size(self) -> int:
        return self._size

    @property
    def buf(self) -> memoryview | None:
        return self._buf

    def close(self) -> None:
        """Unmap; ``BufferError`` while a tensor still views the memory (as ``SharedMemory``)."""
        if self._buf is not None:
            self._buf.release()
            self._buf = None
        self._mmap.close()


def attach(name: str) -> MappedSegment:
    """Map the sender's segment ``name`` without taking over its cleanup (the sender owns it)."""
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, track=False)
    if os.name == "posix":
        return _UntrackedSegment(name)
    return SharedMemory(name=name)  # elsewhere attaching registers nothing


def release(segment: MappedSegment, *, unlink: bool) -> None:
    """Unmap ``segment``, and unlink it where this process created it (``unlink``)."""
    try:
        segment.close()
    except BufferError:  # a receiver kept a tensor of it: mapped until that is freed
        logger.warning("shared segment %s is still viewed; left mapped", segment.name)
    if unlink:
        assert isinstance(segment, SharedMemory), "only the creator unlinks"
        with contextlib.suppress(FileNotFoundError):
            segment.unlink()
