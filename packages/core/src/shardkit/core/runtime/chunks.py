"""``torch.chunk``'s arithmetic: which rows of a dim each of ``parts`` pieces holds.

FSDP's row blocks, TP's shards, DTensor's ``Shard(d)`` and the checkpoint's chunks all cut a
dim of ``n`` rows the way ``torch.chunk`` does: ``c = ceil(n / parts)`` rows a piece, piece
``i`` holding rows ``[i * c, min((i + 1) * c, n))``, so the last pieces may be short or empty
(an empty one starts at ``n``). It is not ``n // parts`` with the remainder spread, and every
place that needs a piece's rows takes them from here: the engine's buffers
(``runtime/buffers.py``), the export's gathers (``export/axis_gathers.py``) and the
checkpoint's plan of every chunk at once (``checkpoint/local_plan/chunk_writers.py``, on
arrays).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["chunk_rows", "chunk_rows_array", "chunk_size"]

Ints = npt.NDArray[np.int64]


def chunk_size(total: int, parts: int) -> int:
    """Rows in every piece but the short or empty last ones: ``ceil(total / parts)``."""
    return -(-total // parts)


def chunk_rows(total: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of piece ``index`` when ``total`` rows are cut in ``parts``."""
    per = chunk_size(total, parts)
    start = min(index * per, total)
    return start, max(0, min(per, total - start))


def chunk_rows_array(totals: Ints, parts: int, indices: Ints) -> tuple[Ints, Ints]:
    """:func:`chunk_rows` of many pieces at once (``totals`` and ``indices`` broadcast)."""
    per = -(-totals // parts)
    starts = np.minimum(indices * per, totals)
    return starts, np.clip(np.minimum(per, totals - starts), 0, None)
