"""A memory snapshot's data checksums: two sums of 8-byte words per 16 KiB block, in one pass.

The data bytes are read as 64-bit words in blocks of ``BLOCK_WORDS``. Each block gets two
numbers, modulo 2**64 (numpy's integer arithmetic wraps):

    plain     = sum of the block's words
    weighted  = sum of (k + 1) * word_k, k the word's place in the block (0 .. BLOCK_WORDS-1)

Why not CRC-32: a snapshot every step checksums the rank's whole share every step, on a core
that would otherwise train. zlib's CRC-32 reads about 2.3 GB/s from memory the copy has just
written (3.5 ms a step for the demo's 7.4 MB, in 405 calls, one per tensor); the two sums
are one matrix product, the blocks times a (BLOCK_WORDS, 2) matrix of weights, that numpy
runs over the whole data at once outside the GIL (about 1.5 ms). One call, not one per
tensor, also matters: the background thread that makes it gives up the GIL for it and takes
it back once, where each of the 405 calls took it back from the training thread.

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
# (BLOCK_WORDS, 2): a block times it gives both sums, in one product over the data.
_WEIGHTS = np.stack([np.ones(BLOCK_WORDS, np.int64), np.arange(1, BLOCK_WORDS + 1)], axis=1)
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
    array: Any = data.numpy()
    words = array.view(np.int64)  # (data_bytes / 8,)
    blocks = -(-words.size // BLOCK_WORDS)
    if executor is None or pieces < 2 or data.numel() < PARALLEL_BYTES:
        return bytes(_block_sums(words).astype("<u8").tobytes())
    per_piece = -(-blocks // pieces) * BLOCK_WORDS  # whole blocks in every piece but the last
    parts = [words[start : start + per_piece] for start in range(0, words.size, per_piece)]
    return b"".join(s.astype("<u8").tobytes() for s in executor.map(_block_sums, parts))


def _block_sums(words: Any) -> Any:
    """(blocks, 2) sums of ``words``, viewed as unsigned (numpy's integer arithmetic wraps)."""
    whole = words.size - words.size % BLOCK_WORDS
    # One product, outside the GIL: the background thread that calls this takes the GIL
    # back once, and each time it does, it waits for the training thread to let go.
    sums = words[:whole].reshape(-1, BLOCK_WORDS) @ _WEIGHTS  # (blocks, 2)
    if whole < words.size:  # the last block is short: its words, their first weights
        tail = words[whole:]
        sums = np.concatenate([sums, (tail @ _WEIGHTS[: tail.size])[None]])
    return sums.view(np.uint64)


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
