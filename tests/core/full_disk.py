"""A disk that fills up: files that take a number of bytes, then fail as a full disk does."""

from __future__ import annotations

import builtins
import errno
import os
from collections.abc import Callable
from typing import IO, Any


class FullDiskFile:
    """A file that takes ``room`` bytes, then fails every write with ``ENOSPC``."""

    def __init__(self, file: IO[Any], room: int) -> None:
        self._file, self._room = file, room

    def write(self, data: bytes | memoryview) -> int:
        """Write, or raise what a write to a full disk raises (no file name in it)."""
        size = memoryview(data).nbytes
        if size > self._room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._room -= size
        return self._file.write(data)

    def __getattr__(self, name: str) -> object:
        return getattr(self._file, name)


def full_disk_open(room: int) -> Callable[..., FullDiskFile]:
    """An ``open`` whose files take ``room`` bytes each (to patch into a writer's module)."""

    def opener(path: Any, mode: str = "r") -> FullDiskFile:
        return FullDiskFile(builtins.open(path, mode), room)

    return opener
