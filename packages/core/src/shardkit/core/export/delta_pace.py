"""Whether a delta pays, bucket by bucket: its measured time against the bucket moved whole.

A delta compares each rank's part with the last export's before anything moves: a cast, a
compare and the changed positions, a pass over the part more than the cast a full export makes.
Where the wire is slow (another host, a slow link), its few percent of the bytes pay for that
pass; where the wire is fast (the loopback of one host), moving the part costs less than
comparing it, and a compared delta takes about three times a full export's trainer side
(docs/guide/export.md, "A delta's time"). Which holds is measured, not assumed, per bucket:

- a compared bucket's seconds on this rank: its count this sync (the cast, the comparison,
  its changes) and its last delta move (encode, gather, decode, cut into tensors);
- a plain bucket's seconds: its count (a cast into the kept part, or nothing) and its move
  whole, the receiver's own time left out of both.

Under ``ExportOptions.plain_when_faster`` each rank posts its pair beside its counts in the
counts' all-gather (:data:`POSTED` numbers a bucket), so every rank reads the same rows and
decides alike: a bucket compared this sync whose slowest delta took longer than the slowest
plain move goes plain, uncompared, for the next syncs (as a dense bucket does: the kept part
cast into place, the bucket moved whole, bits as a full export's), then is compared again.
Each such comparison costs ``q`` times a plain sync (``q``, the measured ratio, above 1); the
run after it is long enough that the comparisons add at most :data:`PROBE_SHARE` of a plain
sync's time on average (``(q - 1) / PROBE_SHARE`` syncs, twice the last run at least, at most
:data:`SLOW_RUN`). A bucket never moved whole yet by this exporter (no plain time) is never
judged. A bucket a rank compared and found dense goes plain anyway: it runs plain on every rank
alike too (:data:`DENSE_MARK`), where each rank's own dense runs (``DENSE_RUN``) would keep the
counts' all-gather (150M, lr 1e-5: a dense sync 1.22x a full export's with it, 0.82x agreed
and without it, medians). Off by default: the choice follows timings, which differ from run to
run, though the bits the receiver gets do not.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from shardkit.core.export.buckets import ExportBucket

__all__ = [
    "DENSE_MARK",
    "DENSE_PACE",
    "POSTED",
    "PROBE_SHARE",
    "SLOW_RUN",
    "BucketPace",
    "Paces",
    "Runs",
    "all_paced",
    "carried",
    "moved",
    "settle",
    "slow_run",
    "start_runs",
]

POSTED = 4
"""Numbers a rank posts per bucket in the counts' all-gather: its count of changes and its
``STEPS`` message's size (``delta_transfer.count_changes``), then its delta's and its plain
move's microseconds (here; zeros unless ``plain_when_faster``)."""
PROBE_SHARE = 1 / 16
"""What the comparisons that look again may add, on average, to a plain sync's time."""
SLOW_RUN = 256
"""The most syncs in a row a bucket goes plain between two comparisons."""
DENSE_MARK = -1
"""Posted in place of a delta's microseconds by a rank that compared the bucket and found it
dense: every rank then runs it plain as a dense bucket (1, 2, 4, ... ``DENSE_PACE`` syncs),
agreed, so that a sync whose buckets are all dense skips the counts' all-gather too."""
DENSE_PACE = 8
"""The longest agreed run of a dense bucket (``delta_transfer.DENSE_RUN``'s, each rank's own)."""


@dataclass(slots=True)
class BucketPace:
    """One bucket's timings on this rank."""

    count_s: float = 0.0
    """This sync's count of the bucket: its comparison, or its cast into place."""
    compared: bool = False
    """This sync compared the bucket and found its changes (not dense)."""
    dense: bool = False
    """This sync compared the bucket and found it dense (it goes plain)."""
    delta_move_s: float = 0.0
    """The last delta move of the bucket's changes (0: none yet)."""
    plain_s: float = 0.0
    """The last plain sync of the bucket: its count and its move whole (0: none yet)."""

    def posted(self, on: bool) -> list[int]:
        """The delta's and the plain move's microseconds, as this rank posts them."""
        if not on:
            return [0, 0]
        if self.dense:
            return [DENSE_MARK, round(self.plain_s * 1e6)]
        delta = self.count_s + self.delta_move_s if self.compared else 0.0
        return [max(1, round(delta * 1e6)) if self.compared else 0, round(self.plain_s * 1e6)]


Runs = dict[int, tuple[int, int]]
"""Per bucket whose delta did not pay: (syncs left that go plain uncompared, the run's
length), the same on every rank of the mesh."""


Paces = dict[int, BucketPace]
"""Per bucket, its timings on this rank."""


def carried(previous: Paces, kept: Paces, bucket: int) -> BucketPace:
    """The bucket's pace for this export, carried over from the last (or a new one)."""
    pace = previous.get(bucket, BucketPace())
    pace.count_s, pace.compared, pace.dense = 0.0, False, False
    kept[bucket] = pace
    return pace


def moved(paces: Paces, bucket: int, start: float, *, plain: bool) -> None:
    """Note the bucket's move, begun at ``start`` (``time.perf_counter``), on this rank."""
    pace = paces.get(bucket)
    if pace is None:  # a full export: its buckets are all plain, none counted
        pace = paces[bucket] = BucketPace()
    seconds = time.perf_counter() - start
    if plain:
        pace.plain_s = pace.count_s + seconds
    else:
        pace.delta_move_s = seconds


def slow_run(delta_us: list[int], plain_us: list[int], run: int) -> int:
    """Syncs the bucket goes plain for, from every rank's posted times (0: none).

    ``delta_us``: per rank, its delta's microseconds (0: not compared there); ``plain_us``:
    its last plain sync's (0: none). ``run``: the last run's length.
    """
    compared = [i for i, d in enumerate(delta_us) if d > 0]
    if not compared or any(plain_us[i] <= 0 for i in compared):
        return 0
    delta, plain = max(delta_us), max(plain_us[i] for i in compared)
    if delta <= plain:
        return 0
    # A comparison costs (delta - plain) more than a plain sync: spread over the run it is
    # at most PROBE_SHARE of one.
    needed = math.ceil((delta - plain) / plain / PROBE_SHARE)
    return min(SLOW_RUN, max(needed, 2 * run, 1))


def start_runs(previous: Runs, kept: Runs) -> set[int]:
    """The buckets this delta export sends plain, uncompared; the runs carried into ``kept``.

    The runs are the last export's, the same on every rank of the mesh (each rank settles them
    from the same rows, those that take no part in a bucket too), so every rank skips the same
    comparisons, and where every bucket is paced, the counts' all-gather too.
    """
    paced = set()
    for bucket, (left, run) in previous.items():
        if left > 0:
            paced.add(bucket)
        kept[bucket] = (max(left - 1, 0), run)
    return paced


def all_paced(paced: set[int], buckets: list[ExportBucket]) -> bool:
    """Every bucket that gathers anything goes plain, uncompared: no counts to exchange."""
    return all(b.index in paced for b in buckets if any(s.gathers for s in b.sources))


def settle(runs: Runs, buckets: list[ExportBucket], rows: torch.Tensor) -> None:
    """Every bucket's run in ``runs``, from the counts' all-gather ``rows``.

    ``rows``: (ranks, POSTED * buckets), the same on every rank, so the runs are too.
    """
    for bucket in buckets:
        at = POSTED * bucket.index
        delta_us = [int(row[at + 2]) for row in rows]
        plain_us = [int(row[at + 3]) for row in rows]
        if not any(delta_us):
            continue  # nothing compared: the run goes on as it was
        last = runs.get(bucket.index, (0, 0))[1]
        if DENSE_MARK in delta_us:  # plain anyway: every rank skips its comparison alike
            run = min(max(1, 2 * last), DENSE_PACE)
        else:
            run = slow_run(delta_us, plain_us, last)
        runs[bucket.index] = (run, run)
