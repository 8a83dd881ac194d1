"""Each rank's index of its own data files: where each item it wrote lies.

DCP's ``FileSystemWriter`` writes a rank's items into ``__<rank>_<n>.distcp`` one after the
other, each framed by ``torch.save`` (values that are not tensors pickled), so an item's
length is not a function of its shape and dtype alone, and the offsets are not either.
``.metadata`` gathers every item's (file, offset, length) to rank 0; here each rank writes its
own instead, beside its data files, for the loads planned from the layout record
(``layout_record``, ``local_load``).

The index lists the rows in the order of the rank's items, the order ``SaveLayout.items_of``
gives; no keys, because the record's layout names them. The file: 8 bytes of magic, the
SHA-256 of the rows, their count (int64), then (file number, offset, length) int64 rows,
little-endian. Read with numpy, every field checked, each item inside its file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch

from shardkit.core.errors import StateDictFileError

__all__ = ["check_inside", "data_file", "index_name", "read_index", "write_index"]

_MAGIC = b"SKINDEX1"
_HEAD = len(_MAGIC) + 32 + 8
_COLUMNS = 3  # file number, offset, length


def index_name(rank: int) -> str:
    """The index file of ``rank`` (beside its ``__<rank>_<n>.distcp`` files)."""
    return f"__{rank}.index"


def data_file(rank: int, number: int) -> str:
    """The data file ``number`` of ``rank``, as DCP's writer names it."""
    return f"__{rank}_{number}.distcp"


def write_index(folder: Path, rank: int, rows: torch.Tensor) -> None:
    """Write ``rank``'s index from its result rows (``save_results.result_rows``)."""
    table = np.ascontiguousarray(rows[:, :_COLUMNS].numpy().astype("<i8"))
    body = table.tobytes()
    head = _MAGIC + hashlib.sha256(body).digest() + np.int64(table.shape[0]).astype("<i8").tobytes()
    temporary = folder / f".{index_name(rank)}.tmp"
    with open(temporary, "wb") as stream:
        stream.write(head + body)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, folder / index_name(rank))


def read_index(folder: Path, rank: int, items: int) -> np.ndarray:
    """``rank``'s (items, 3) rows: file number, offset, length; each checked.

    Args:
        folder: the checkpoint's directory.
        rank: the rank (of the save's world) whose index it is.
        items: how many items the layout says ``rank`` wrote.

    Raises:
        StateDictFileError: naming the file: missing, truncated, corrupt, of another count
            of items than the layout's, or an item past its data file's end.
    """
    path = folder / index_name(rank)
    try:
        size = path.stat().st_size
        if size != _HEAD + items * _COLUMNS * 8:
            raise ValueError(f"{size} bytes, where {items} items take {_HEAD + items * 24}")
        data = path.read_bytes()
        if data[: len(_MAGIC)] != _MAGIC:
            raise ValueError("not a rank's index (its magic differs)")
        body = data[_HEAD:]
        if hashlib.sha256(body).digest() != data[len(_MAGIC) : len(_MAGIC) + 32]:
            raise ValueError("its checksum does not match its rows (corrupt)")
        count = int(np.frombuffer(data[_HEAD - 8 : _HEAD], dtype="<i8")[0])
        if count != items:
            raise ValueError(f"it lists {count} items, the layout {items}")
        rows = np.frombuffer(body, dtype="<i8").reshape(items, _COLUMNS).astype(np.int64)
        _inside(folder, rank, rows)
        return rows
    except (OSError, ValueError) as error:
        raise StateDictFileError(f"{path}: damaged index: {error}") from None


def check_inside(folder: Path, rank: int, rows: np.ndarray) -> None:
    """Every one of ``rank``'s (file number, offset, length) ``rows`` inside its data file.

    Raises:
        StateDictFileError: naming the data file an item reaches past (or that is missing).
    """
    try:
        _inside(folder, rank, rows)
    except (OSError, ValueError) as error:
        raise StateDictFileError(f"{folder}: {error}") from None


def _inside(folder: Path, rank: int, rows: np.ndarray) -> None:
    """Every item inside its data file (one ``stat`` per file)."""
    if bool((rows < 0).any()):
        raise ValueError("a negative file number, offset or length")
    for number in np.unique(rows[:, 0]).tolist():
        name = data_file(rank, number)
        end = (folder / name).stat().st_size
        mine = rows[rows[:, 0] == number]
        if bool((mine[:, 1] + mine[:, 2] > end).any()):
            raise ValueError(f"an item reaches past the end of {name} ({end} bytes)")
