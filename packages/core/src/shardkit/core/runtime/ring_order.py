"""The order in which gloo's reduce-scatter adds the ranks' rows, for an exchange to repeat.

torch's ``fully_shard`` on CPU reduce-scatters with gloo, which runs a ring all-reduce over the
whole (W, S) input: the buffer is cut into ``2W`` or more equal segments (at most 1 MiB each,
a whole number per rank), rank k ends up with chunk k (its run of segments), and each element
of chunk k is summed along the ring starting at rank k - 1: rank k-1's value plus rank k-2's,
and so on round to rank k + 1, rank k's own value last. Floating-point addition is not
associative, so an exchange that sums the same rows in another order differs in the last bits
from W=3 on. The chunks need not line up with the rows: an element of this rank's row may sit
in a neighbour's chunk and be summed in that neighbour's order.
"""

from __future__ import annotations

__all__ = ["ring_fold_order", "ring_owners"]

_MAX_SEGMENT_BYTES = 1 << 20  # gloo's AllreduceOptions default (kMaxSegmentSize)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def ring_owners(row: int, rank: int, world: int, itemsize: int) -> list[tuple[int, int, int]]:
    """The spans of ``rank``'s row that the ring sums in each owner's order.

    ``(start, stop, owner)`` column ranges, left to right, of a row of ``row`` elements of
    ``itemsize`` bytes.
    """
    total = world * row * itemsize
    max_segment = itemsize * max(1, _MAX_SEGMENT_BYTES // itemsize)
    segments = _round_up(max(-(-total // max_segment), 2 * world), world)
    segment = _round_up(-(-total // segments), itemsize) // itemsize  # elements
    chunk = segments // world * segment
    first, last = rank * row, (rank + 1) * row  # this row's elements in the whole buffer
    spans = []
    start = first
    while start < last:
        owner = start // chunk
        stop = min(last, (owner + 1) * chunk)
        spans.append((start - first, stop - first, owner))
        start = stop
    return spans


def ring_fold_order(owner: int, world: int) -> list[int]:
    """The ranks whose values the ring adds for ``owner``'s chunk, in the order it adds them."""
    return [(owner - k) % world for k in range(1, world)] + [owner]
