"""A sender of one shared-memory segment and a receiver forked from it, for
``test_shared_segments.py``: run as a process of its own (as a torchrun rank is), so that it
starts its own resource tracker, which the receiver then shares.

Usage: ``python -m tests.core.export.segment_sender DONE_FILE``. Prints the segment's name,
then ``mapped True`` once the receiver has read the sender's bytes through its own mapping;
the receiver unmaps and ends when ``DONE_FILE`` appears; the sender waits to be killed.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from multiprocessing.shared_memory import SharedMemory

from shardkit.core.export.shared_segments import attach, release

PATTERN = bytes(range(256)) * 16


def _receiver(name: str, done_file: str) -> None:
    segment = attach(name)
    assert segment.buf is not None
    print("mapped", bytes(segment.buf[: len(PATTERN)]) == PATTERN, flush=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(done_file) and time.monotonic() < deadline:
        time.sleep(0.01)
    release(segment, unlink=False)


def main() -> None:
    done_file = sys.argv[1]
    segment = SharedMemory(create=True, size=len(PATTERN))
    assert segment.buf is not None
    segment.buf[: len(PATTERN)] = PATTERN
    print(segment.name, flush=True)
    receiver = multiprocessing.get_context("fork").Process(
        target=_receiver, args=(segment.name, done_file)
    )
    receiver.start()
    time.sleep(120)  # killed long before


if __name__ == "__main__":
    main()
