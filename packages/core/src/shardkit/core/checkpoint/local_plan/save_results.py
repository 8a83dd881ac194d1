"""What each rank of a locally planned save wrote, gathered to rank 0, checked, and filed.

``save`` plans and writes; here is the other side of its one exchange. Each rank turns
DCP's write results into int64 rows (file number, offset, length, bytes) in its items' order;
one gather brings every rank's fixed header (layout digest, item count, failure flag, message
length) and rows to rank 0, which checks every field before it uses any (a body longer than
any save's results is never received), pairs the rows with the keys each rank was due to
write, and writes ``.metadata`` as DCP's ``FileSystemWriter.finish`` does.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    FileSystemWriter,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from shardkit.core.checkpoint.local_plan.chunk_writers import SaveLayout
from shardkit.core.runtime.p2p.object_collectives import gather_rows_to_first

__all__ = [
    "ROW",
    "Gathered",
    "gather_results",
    "result_rows",
    "storage_entries",
    "write_metadata_file",
]

_FILE = re.compile(r"__(\d+)_(\d+)\.distcp")
ROW = 4  # file number, offset, length, size in bytes

Gathered = list[tuple[str, str, torch.Tensor, bool]]
"""On rank 0, per rank: (layout digest, failure text, result rows, not plannable locally)."""


def result_rows(items: list[WriteItem], results: list[WriteResult], rank: int) -> torch.Tensor:
    """This rank's results as (file number, offset, length, bytes), in its items' order."""
    by_index = {result.index: result for result in results}
    rows = torch.empty((len(items), ROW), dtype=torch.int64)
    for i, item in enumerate(items):
        result = by_index.get(item.index)
        if result is None:
            raise RuntimeError(f"no write result for {item.index.fqn} at {item.index.offset}")
        info = result.storage_data
        if not isinstance(info, _StorageInfo) or info.transform_descriptors:
            raise RuntimeError(f"{item.index.fqn}: a storage entry this save cannot describe")
        match = _FILE.fullmatch(info.relative_path)
        if match is None or int(match.group(1)) != rank:
            raise RuntimeError(f"{item.index.fqn}: written to {info.relative_path!r}")
        rows[i] = torch.tensor(
            [int(match.group(2)), info.offset, info.length, result.size_in_bytes]
        )
    return rows


def gather_results(
    layout_digest: str, rows: torch.Tensor, failure: str, not_local: bool, group: dist.ProcessGroup
) -> list[tuple[str, str, torch.Tensor, bool]] | None:
    """On rank 0: every rank's (digest, failure, rows, not plannable locally); else None."""
    message = failure.encode()[:4096]
    digest = bytes.fromhex(layout_digest)[:16]
    header = torch.tensor(
        [
            int.from_bytes(digest[:8], "little", signed=True),
            int.from_bytes(digest[8:], "little", signed=True),
            rows.shape[0],
            int(bool(failure)),
            len(message),
            int(not_local),
        ],
        dtype=torch.int64,
    )
    text = torch.tensor(list(message), dtype=torch.int64)
    payload = torch.cat([text, rows.reshape(-1)])
    gathered = gather_rows_to_first(header, payload, group)
    if gathered is None:
        return None
    out = []
    for rank, (head, body) in enumerate(gathered):
        words = head.tolist()
        sent = b"".join(int(w).to_bytes(8, "little", signed=True) for w in words[:2]).hex()
        size = int(words[4])
        if body is None:  # a length beyond any save's results: not received
            out.append((sent, f"rank {rank}: malformed results (oversized)", rows[:0], False))
            continue
        if not 0 <= size <= min(4096, body.numel()):  # a failure like any other: no raise here
            out.append((sent, f"rank {rank}: malformed results ({size} bytes)", body[:0], False))
            continue
        said = bytes(body[:size].clamp(0, 255).tolist()).decode(errors="replace")
        out.append((sent, said, body[size:], bool(words[5])))
    return out


def storage_entries(
    layout: SaveLayout, bodies: list[torch.Tensor]
) -> dict[MetadataIndex, _StorageInfo]:
    """Every item's file, offset and length, from every rank's result rows, each checked.

    The same layout saved again writes the same files at the same offsets (the same items,
    serialized to the same sizes): when every rank's rows equal the last save's, its entries
    are reused, and only the pickle of ``.metadata`` remains.
    """
    written = layout.written()
    for rank, body in enumerate(bodies):
        if body.numel() != len(written[rank]) * ROW:
            sent = body.numel() // ROW
            raise RuntimeError(f"rank {rank} sent {sent} results for {len(written[rank])} items")
    negative = [rank for rank, body in enumerate(bodies) if bool((body < 0).any())]
    if negative:
        raise RuntimeError(f"rank(s) {negative[:8]} sent a negative file number, offset or size")
    rows = torch.cat(bodies) if bodies else torch.zeros(0, dtype=torch.int64)
    last = layout.last_storage
    if last is not None and torch.equal(last[0], rows):
        return last[1]
    entries: dict[MetadataIndex, _StorageInfo] = {}
    for rank, body in enumerate(bodies):
        files: dict[int, str] = {}
        for key, (number, offset, length, _) in zip(
            written[rank], body.view(-1, ROW).tolist(), strict=True
        ):
            name = files.get(number)
            if name is None:
                name = files[number] = f"__{rank}_{number}.distcp"
            entries[key] = _StorageInfo(name, offset, length)
    layout.last_storage = (rows, entries)
    return entries


def write_metadata_file(writer: FileSystemWriter, metadata: Metadata) -> None:
    """Write ``.metadata`` as DCP's ``FileSystemWriter.finish`` does.

    The version and storage meta set, the pickle into a temporary file, flushed to disk, then
    renamed into place.
    """
    metadata.version = CURRENT_DCP_VERSION
    metadata.storage_meta = writer.storage_meta()
    folder = Path(writer.path)
    temporary = folder / ".metadata.tmp"
    with open(temporary, "wb") as stream:
        pickle.dump(metadata, stream)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, folder / ".metadata")
