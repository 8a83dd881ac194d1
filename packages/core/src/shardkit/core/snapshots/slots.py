"""Where memory snapshots live: slot files in the node's shared memory, and whose are where.

A file under ``/dev/shm`` is memory that outlives the process that wrote it (until the node
reboots or someone removes it): a worker killed and started again by ``torchrun
--max-restarts`` finds its snapshots where it left them, with no read from storage. Each rank
has a fixed number of slots for its own snapshots and as many for the replicas it holds of one
other rank's (its source), each a file named by rank and slot in a directory named by the run:

    /dev/shm/shardkit-<run id>/rank00001.slot0.snap
    /dev/shm/shardkit-<run id>/replica-of-rank00000.slot1.snap

A rank's replicas go to the same local rank on the next node (``Topology.peer``), so a node
that is lost takes with it no snapshot that is not also on another node.

Files are mapped with ``torch.from_file(shared=True)``: the slot's bytes are a uint8 tensor,
so a copy into it is a tensor copy and a transfer to a peer sends from it directly.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardkit.core.snapshots.format import (
    JSON_AT,
    MAGIC,
    REGION_AT,
    STATE_AT,
    data_offset,
    header_region,
)

__all__ = ["SlotFile", "SnapshotDirectory", "Topology", "default_directory", "map_existing"]

_SHARED_MEMORY = Path("/dev/shm")
_MAGIC = np.frombuffer(MAGIC, dtype=np.uint8)


def default_directory(run_id: str) -> Path:
    """``/dev/shm/shardkit-<run id>`` (the temporary directory where there is no /dev/shm)."""
    base = _SHARED_MEMORY if _SHARED_MEMORY.is_dir() else Path(tempfile.gettempdir())
    return base / f"shardkit-{run_id}"


class SlotFile:
    """One slot's file, mapped: its header region and data as views of one uint8 tensor."""

    def __init__(self, path: Path, raw: torch.Tensor, capacity: int, data_bytes: int) -> None:
        self.path, self.raw = path, raw
        self.capacity, self.data_bytes = capacity, data_bytes
        # The same bytes as a numpy array, for the few bytes the background thread writes:
        # a numpy store keeps the GIL (nanoseconds), where a torch op releases and retakes it,
        # and each retake waits for the training thread to give it up.
        self._bytes: Any = raw.numpy()

    @staticmethod
    def create(path: Path, *, capacity: int, data_bytes: int) -> SlotFile:
        """The slot at ``path``, sized for a header of ``capacity`` and ``data_bytes`` of data.

        An existing file keeps its bytes where the size is unchanged (the snapshot a restart
        restored from stays valid until a newer one replaces it).
        """
        size = data_offset(capacity) + data_bytes
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(descriptor).st_size != size:
                os.ftruncate(descriptor, 0)  # another size: nothing of it can be valid
                os.ftruncate(descriptor, size)
        finally:
            os.close(descriptor)
        raw = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        return SlotFile(path, raw, capacity, data_bytes)

    def data(self) -> torch.Tensor:
        """The data bytes (a view)."""
        start = data_offset(self.capacity)
        return self.raw[start : start + self.data_bytes]

    def region(self) -> torch.Tensor:
        """The header region's bytes (a view)."""
        return self.raw[REGION_AT : JSON_AT + self.capacity]

    def span(self) -> torch.Tensor:
        """The header region through the data's end (a view): what travels to a peer.

        One message instead of two: the page of padding between them is cheaper to send than
        a second message's handshakes. A replica slot has its source's geometry, so the
        span received fits its span exactly.
        """
        return self.raw[REGION_AT : data_offset(self.capacity) + self.data_bytes]

    def mark_writing(self) -> None:
        """Mark the slot incomplete: done before any byte of a new snapshot is written."""
        self._bytes[STATE_AT] = 0
        self._bytes[: len(MAGIC)] = _MAGIC

    def write_header(self, json_bytes: bytes) -> None:
        """Write the header (its checksum, length and JSON) into the slot."""
        region = header_region(json_bytes, self.capacity)
        self._bytes[REGION_AT : REGION_AT + len(region)] = np.frombuffer(region, dtype=np.uint8)

    def mark_complete(self) -> None:
        """Mark the snapshot complete: the last byte written, after data and header."""
        self._bytes[STATE_AT] = 1


@dataclass(frozen=True, slots=True)
class Topology:
    """This rank, the world, and who holds whose replicas."""

    run_id: str
    rank: int
    world_size: int
    ranks_per_node: int

    @property
    def replicated(self) -> bool:
        """Whether another node exists to hold replicas."""
        return self.world_size > self.ranks_per_node

    def peer(self, rank: int) -> int:
        """The rank holding ``rank``'s replicas: the same local rank on the next node."""
        return (rank + self.ranks_per_node) % self.world_size

    def source(self, rank: int) -> int:
        """The rank whose replicas ``rank`` holds."""
        return (rank - self.ranks_per_node) % self.world_size


def map_existing(path: Path) -> torch.Tensor | None:
    """The bytes of an existing slot file, mapped (None if it is gone or empty)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    if size == 0:
        return None
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)


@dataclass(frozen=True, slots=True)
class SnapshotDirectory:
    """The slot files of one rank in a directory of the node's shared memory."""

    root: Path
    rank: int

    def own(self, slot: int) -> Path:
        """The file of this rank's own snapshot in ``slot``."""
        return self.root / f"rank{self.rank:05d}.slot{slot}.snap"

    def replica(self, owner: int, slot: int) -> Path:
        """The file of the replica of ``owner``'s snapshot in ``slot``, held here."""
        return self.root / f"replica-of-rank{owner:05d}.slot{slot}.snap"

    def log(self, owner: int, slot: int) -> Path:
        """The file of a log entry of ``owner``'s in ``slot``, held here (``gradient_log``)."""
        return self.root / f"log-of-rank{owner:05d}.slot{slot}.snap"

    def own_files(self) -> Iterator[tuple[int, Path]]:
        """(slot, path) of every own snapshot file of this rank, in slot order."""
        return self._slots(f"rank{self.rank:05d}.slot")

    def replica_files(self, owner: int) -> Iterator[tuple[int, Path]]:
        """(slot, path) of every replica file of ``owner`` held here, in slot order."""
        return self._slots(f"replica-of-rank{owner:05d}.slot")

    def log_files(self, owner: int) -> Iterator[tuple[int, Path]]:
        """(slot, path) of every log entry file of ``owner`` held here, in slot order."""
        return self._slots(f"log-of-rank{owner:05d}.slot")

    def held_files(self, owner: int) -> list[Path]:
        """Every file this rank holds for ``owner``: its replicas and log entries."""
        found = [path for _, path in self.replica_files(owner)]
        return found + [path for _, path in self.log_files(owner)]

    def _slots(self, prefix: str) -> Iterator[tuple[int, Path]]:
        if not self.root.is_dir():
            return
        found = []
        for path in self.root.glob(f"{prefix}*.snap"):
            number = path.name.removeprefix(prefix).removesuffix(".snap")
            if number.isdigit():
                found.append((int(number), path))
        yield from sorted(found)

    def prepare(self) -> None:
        """Create the directory (readable by this user only)."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
