"""The sample that tells a dense part before a delta compares it, read in a few ops.

A part most of whose elements changed (a high learning rate) would be compared, and its
positions built, until its count passed the limit (at 30% changed, 40% of it). A sample of
1/16 tells it first: a window of :data:`SAMPLE_WINDOW` elements every :data:`SAMPLE_STRIDE`
of the part, cast and compared element by element with the last export's, nothing written;
a dense part is then cast straight into place uncompared (``delta_find.py``), and a sparse
one pays 1/16 of a comparison more.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardkit.core.export.axis_gathers import AxisGather
from shardkit.core.export.delta_encoding import DENSE, WIDTH

__all__ = ["SAMPLE_STRIDE", "SAMPLE_WINDOW", "sample_is_dense"]

SAMPLE_WINDOW = 1 << 14
"""Elements per window of the sample that tells a dense part before its comparison."""
SAMPLE_STRIDE = 1 << 18
"""One window every this many elements of the part: a sample of 1/16."""


def sample_is_dense(
    pieces: Sequence[tuple[AxisGather, torch.Tensor, int]],
    kept: Sequence[torch.Tensor],
    scratch: torch.Tensor,
) -> bool:
    """Whether more than 1/``DENSE`` of a sample of the part changed (nothing is written).

    ``pieces``: per tensor, its gather, this rank's piece (as stored) and its byte offset in
    the part; ``kept``: per piece, the last export's elements, as integers of the export
    dtype's width; ``scratch``: in the export dtype. Only dim-0 pieces are sampled.

    A piece's windows are read as one strided view (as many as ``scratch`` holds at a time),
    and their counts are summed where they are computed: a few ops a piece and one read of
    the sum a part. Window by window, a 75M-element part launched about 1,100 kernels and read
    283 counts back, each a wait for the device on a GPU.
    """
    itemsize, width = scratch.element_size(), WIDTH[scratch.element_size()]
    window = min(SAMPLE_WINDOW, scratch.numel())
    batch = scratch.numel() // window  # windows cast at once
    changed = torch.zeros((), dtype=torch.int64, device=scratch.device)
    seen = 0
    for (gather, piece, offset), old_elements in zip(pieces, kept, strict=True):
        if gather.tensor_dim != 0 or not piece.is_contiguous():
            continue  # packed whole before it is cast: not sampled
        flat = piece.reshape(-1)
        first = offset // itemsize
        # The windows lie at multiples of the stride in the part, not in each tensor, so
        # that small tensors are not all sampled.
        start = -(-first // SAMPLE_STRIDE) * SAMPLE_STRIDE - first
        whole = max(0, -(-(flat.numel() - window - start + 1) // SAMPLE_STRIDE))
        for at in range(0, whole, batch):
            count = min(batch, whole - at)
            first_at = start + at * SAMPLE_STRIDE
            windows = scratch[: count * window].view(count, window)
            windows.copy_(_windows(flat, first_at, count, window))
            old = _windows(old_elements, first_at, count, window)
            changed.add_(torch.count_nonzero(windows.view(width) != old))
            seen += count * window
        last = start + whole * SAMPLE_STRIDE  # a window cut short by the piece's end
        if last < flat.numel():
            tail = scratch[: flat.numel() - last]
            tail.copy_(flat[last:])
            changed.add_(torch.count_nonzero(tail.view(width) != old_elements[last:]))
            seen += flat.numel() - last
    return seen > 0 and int(changed) * DENSE > seen


def _windows(flat: torch.Tensor, first: int, count: int, window: int) -> torch.Tensor:
    """``count`` windows of ``window`` elements, ``SAMPLE_STRIDE`` apart, from ``first``.

    One strided view of ``flat``, no copy.
    """
    return flat.as_strided((count, window), (SAMPLE_STRIDE, 1), flat.storage_offset() + first)
