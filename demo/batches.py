"""The demo's data: a byte corpus, and batches that are a pure function of (seed, step).

Each step's global batch is drawn from a generator seeded by the seed and the step number
alone, and each data-parallel rank takes its rows of it: a run resumed at step k sees exactly
the batches an uninterrupted run sees, with no data-loader state to checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

__all__ = ["BatchSampler", "load_corpus"]


def load_corpus(path: Path) -> Tensor:
    """The corpus as a 1-D uint8 tensor of bytes (the tokenizer is the identity on bytes)."""
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)  # (N,)


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchSampler:
    """Cuts step s's global batch out of the corpus and hands this rank its rows.

    The start offsets come from a generator seeded by (seed, step) alone, so a run resumed at
    step k replays the batches an uninterrupted run sees, with no data-loader state to save.
    Every rank draws the whole global batch (a few integers): it is the same at any world size.
    """

    data: Tensor  # (N,) uint8
    seq_len: int
    batch_per_rank: int
    rank: int
    world: int
    seed: int

    def batch(self, step: int) -> tuple[Tensor, Tensor]:
        """Inputs and next-byte targets, each (batch_per_rank, seq_len) int64."""
        n_windows = self.data.numel() - self.seq_len - 1
        rng = np.random.default_rng((self.seed, step))
        starts = rng.integers(0, n_windows, size=self.batch_per_rank * self.world)  # (W*B,)
        mine = starts[self.rank * self.batch_per_rank : (self.rank + 1) * self.batch_per_rank]
        offsets = torch.from_numpy(mine)[:, None] + torch.arange(self.seq_len + 1)  # (B, T+1)
        window = self.data[offsets].long()  # (B, T+1)
        return window[:, :-1], window[:, 1:]  # (B, T) inputs, (B, T) targets
