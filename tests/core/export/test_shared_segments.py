"""A sender's shared-memory segment outlives neither the sender nor its receivers.

The receiving process maps the sender's segment without taking over its cleanup. The case
that matters is a receiving process forked from the sender's (vLLM's engine core started from
a trainer rank): they share one resource tracker, and a receiver that unregistered the segment
after mapping it (the usual repair before Python 3.13) dropped the sender's registration, so a
sender killed later left its segments in ``/dev/shm`` for good.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import pytest

from shardkit.core.export.shared_segments import attach, release

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /dev/shm, where Linux keeps segments"
)

ROOT = Path(__file__).resolve().parents[3]


def test_a_killed_senders_segment_is_unlinked_once_a_forked_receiver_ends(
    tmp_path: Path,
) -> None:
    # The sender is a process of its own (as a torchrun rank is), with its own resource
    # tracker: a process made by multiprocessing from this one would share the tracker this
    # test process may have started, which lives as long as this process.
    done_file = tmp_path / "done"
    sender = subprocess.Popen(
        [sys.executable, "-m", "tests.core.export.segment_sender", str(done_file)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    name = ""
    try:
        assert sender.stdout is not None
        name = sender.stdout.readline().strip()
        assert name, "the sender never created its segment"
        assert sender.stdout.readline().split() == ["mapped", "True"], (
            "the receiver did not read the sender's bytes"
        )
        assert os.path.exists(f"/dev/shm/{name}")
        sender.send_signal(signal.SIGKILL)  # mid-export, as a crashed trainer rank
        sender.wait(30)
        done_file.touch()  # the receiver unmaps and ends: the tracker's last holder is gone
        deadline = time.monotonic() + 30
        while os.path.exists(f"/dev/shm/{name}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/dev/shm/{name}"), (
            f"segment {name} outlived its killed sender and the receiver"
        )
    finally:
        done_file.touch()
        if sender.poll() is None:
            sender.kill()
        if name:
            _unlink(name)  # what the code under test should have done


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"/dev/shm/{name}")


def test_a_segment_still_viewed_stays_mapped_and_closes_later() -> None:
    segment = SharedMemory(create=True, size=4096)
    try:
        mapped = attach(segment.name)
        assert mapped.buf is not None and mapped.size == 4096
        segment.buf[:4] = b"abcd"  # type: ignore[index]
        view = memoryview(mapped.buf)  # as a receiver's tensor over the bytes holds it
        release(mapped, unlink=False)  # warns, leaves the memory mapped
        assert bytes(view[:4]) == b"abcd"
        view.release()
        release(mapped, unlink=False)  # now unmapped
        assert mapped.buf is None
    finally:
        release(segment, unlink=True)
    assert not os.path.exists(f"/dev/shm/{segment.name}")


class _Untouched:
    """A receiver that fails the test if a bucket reaches it."""

    def receive(self, bucket: object) -> None:
        raise AssertionError(f"a bucket reached the receiver: {bucket!r}")


@pytest.mark.parametrize(
    ("segment", "why"),
    [
        ("psm_no_such_segment", "FileNotFoundError"),
        ("../../etc/passwd", "Error"),  # not a name: shm_open refuses a path
        ("", "malformed bucket message"),
        (None, "malformed bucket message"),
    ],
)
def test_a_bucket_naming_no_segment_of_the_sender_is_refused(segment: object, why: str) -> None:
    from shardkit.core.export.messages import ExportManifest
    from shardkit.core.export.shared_memory import _ServingSession

    session = _ServingSession(None, _Untouched())  # type: ignore[arg-type]
    session.manifest = ExportManifest(export_id=0, kind="full", tensors=(), bucket_count=1)
    control = {"op": "bucket", "payload_bytes": 64, "slot": 0, "segment": segment}
    error = session._handle("bucket", control, b"")
    assert error is not None and why in error, error
    assert session.segments == {}  # nothing mapped, nothing handed on


def test_a_segment_smaller_than_its_bucket_is_refused() -> None:
    from shardkit.core.export.messages import ExportManifest
    from shardkit.core.export.shared_memory import _ServingSession

    small = SharedMemory(create=True, size=4096)
    try:
        session = _ServingSession(None, _Untouched())  # type: ignore[arg-type]
        session.manifest = ExportManifest(export_id=0, kind="full", tensors=(), bucket_count=1)
        control = {"op": "bucket", "payload_bytes": 1 << 20, "slot": 0, "segment": small.name}
        error = session._handle("bucket", control, b"")
        assert error is not None and "holds 4096 bytes, not 1048576" in error, error
        for mapped in session.segments.values():
            release(mapped, unlink=False)
    finally:
        release(small, unlink=True)
