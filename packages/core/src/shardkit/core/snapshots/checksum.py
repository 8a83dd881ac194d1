"""A memory snapshot's data checksums: two sums of 8-byte words per 16 KiB block, in one pass.

The data bytes are read as 64-bit words in blocks of ``BLOCK_WORDS``. Each block gets two
numbers, modulo 2**64 (two's complement int64 arithmetic wraps, in torch and numpy):

    plain     = sum of the block's words
    weighted  = sum of (k + 1) * word_k, k the word's place in the block (0 .. BLOCK_WORDS-1)

Why not CRC-32: a snapshot every step checksums the rank's whole share every step, on a core
that would otherwise train. zlib's CRC-32 reads about 2.3 GB/s from memory the copy has just
written (3.5 ms a step for the demo's 7.4 MB, in 405 calls, one per tensor); the two sums
are a few reductions over the whole data at once, outside the GIL (0.26 ms). How: a
block is viewed as ``_ROWS`` rows of ``_COLUMNS`` words, word k at row r = k // _COLUMNS and
column c = k % _COLUMNS, so k + 1 = _COLUMNS * r + c + 1 and

    weighted = _COLUMNS * sum_r r * rowsum_r + sum_c (c + 1) * columnsum_c

Row and column sums are torch's vectorised integer sums over the data; the weights then
multiply a few dozen numbers a block. (A product of the blocks with a (BLOCK_WORDS, 2)
weight matrix gives the same numbers, but integer products run no vector code in numpy or
torch: 1.3 to 1.7 ms for the demo's share, a step's 1 % on a busy core.) One call, not one
per tensor, also matters: the background thread that makes it gives up the GIL for it and
takes it back a few times, where each of the 405 CRC calls took it back from the training
thread.

What they catch, exactly (not with a probability):
- any change confined to one 8-byte word: ``plain`` moves by the change, never 0 mod 2**64;
- two 8-byte words swapped within a block: ``weighted`` moves by (a - b)(j - k), nonzero
  mod 2**64 unless the words agree in their low 54 bits (|j - k| < 2**11); two swapped
  across blocks move both blocks' ``plain``;
- two 4-byte words (a float32's) swapped: in different halves of their words ``plain``
  moves by (a - b)(2**32 - 1), never 0; both in low halves ``weighted`` moves by less than
  2**43; both in high halves it moves by (a - b)(j - k) 2**32, which vanishes only if the
  two differ in their top 11 bits alone (the sign and exponent) at a distance divisible by
  2**(32 - 11).
A torn write (a block half old, half new) and random damage move a block's pair of sums as
a 128-bit hash would not, but almost surely: they are linear, so damage that cancels in both
sums passes, which no accident of a killed writer or a flipped bit produces. They are not a
defence against tampering (nor was CRC-32); the slot files are readable by their user only.
See [Note: memory snapshots].
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Any

import numpy as np
import torch

__all__ = [
    "BLOCK_BYTES",
    "BLOCK_WORDS",
    "PARALLEL_BYTES",
    "checksum_count",
    "checksums_of",
    "first_mismatch",
]

BLOCK_WORDS = 2048  # 16 KiB: weights below 2**11, few enough numbers for the header
BLOCK_BYTES = 8 * BLOCK_WORDS
_ROWS, _COLUMNS = 64, 32  # a block's words as a matrix (the fastest shape measured)
_ROW_WEIGHTS = np.arange(_ROWS, dtype=np.int64) * _COLUMNS
_COLUMN_WEIGHTS = np.arange(1, _COLUMNS + 1, dtype=np.int64)
_WORD_WEIGHTS = np.arange(1, BLOCK_WORDS + 1, dtype=np.int64)  # a short last block's
# Data at least this large is summed in pieces on an executor's threads, where one is given:
# a GPU's whole share (gigabytes a step) would take one core most of a step.
PARALLEL_BYTES = 64 * 2**20


def checksum_count(data_bytes: int) -> int:
    """How many numbers ``checksums_of`` gives for ``data_bytes`` of data (two per block)."""
    return 2 * -(-data_bytes // BLOCK_BYTES)


def checksums_of(data: torch.Tensor, executor: Executor | None = None, pieces: int = 1) -> bytes:
    """The sums of each block of ``data`` (uint8, contiguous, a multiple of 8 bytes long).

    Args:
        data: the bytes.
        executor: where data of ``PARALLEL_BYTES`` or more is summed, in ``pieces`` parts of
            whole blocks (the products release the GIL: the executor's threads run at once).
        pieces: how many parts (1: one product on this thread).

    Returns:
        ``plain_0, weighted_0, plain_1, weighted_1, ...``, each an unsigned 64-bit
        little-endian number: 16 bytes a block. Bytes, not Python integers: a header holds
        them as hex, and a GPU's share has hundreds of thousands.
    """
    if data.numel() % 8:
        raise ValueError(f"snapshot data of {data.numel()} bytes is not whole 8-byte words")
    words = data.view(torch.int64)  # (data_bytes / 8,)
    blocks = -(-words.numel() // BLOCK_WORDS)
    if executor is None or pieces < 2 or data.numel() < PARALLEL_BYTES:
        return _block_sums(words)
    per_piece = -(-blocks // pieces) * BLOCK_WORDS  # whole blocks in every piece but the last
    parts = [words[start : start + per_piece] for start in range(0, words.numel(), per_piece)]
    return b"".join(executor.map(_block_sums, parts))


def _block_sums(words: torch.Tensor) -> bytes:
    """The sums of ``words``' blocks, as ``checksums_of`` gives them.

    The passes over the data are torch's (its integer sums are vectorised, numpy's and both
    libraries' integer products are not); the few numbers a block then are numpy's. Few torch
    calls: each gives up the GIL and takes it back, and on a GPU's host the thread that sums
    a chunk takes it back from a training thread that is launching kernels.
    """
    whole = words.numel() - words.numel() % BLOCK_WORDS
    matrix = (words if whole == words.numel() else words[:whole]).view(-1, _ROWS, _COLUMNS)
    rows: Any = matrix.sum(dim=2).numpy()  # (blocks, _ROWS)
    columns: Any = matrix.sum(dim=1).numpy()  # (blocks, _COLUMNS)
    sums = np.stack([rows.sum(axis=1), rows @ _ROW_WEIGHTS + columns @ _COLUMN_WEIGHTS], axis=1)
    if whole < words.numel():  # the last block is short: its words, their first weights
        tail: Any = words[whole:].numpy()
        short = np.array([[tail.sum(), tail @ _WORD_WEIGHTS[: tail.size]]], dtype=np.int64)
        sums = np.concatenate([sums, short])
    # int64's bits read as unsigned: numpy's integer arithmetic wraps modulo 2**64.
    return bytes(sums.astype("<i8").tobytes())


def first_mismatch(expected: bytes, data: torch.Tensor) -> int | None:
    """The byte offset of the first block of ``data`` whose sums differ from ``expected``.

    None if all match. A different count of sums is a mismatch at offset 0.
    """
    found = checksums_of(data)
    if len(found) != len(expected):
        return 0
    want = np.frombuffer(expected, dtype="<u8")
    differ = np.flatnonzero(want != np.frombuffer(found, dtype="<u8"))
    return None if differ.size == 0 else int(differ[0] // 2) * BLOCK_BYTES
