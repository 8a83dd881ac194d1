"""A delta export's buckets on the wire: each rank's changes counted, encoded and gathered.

Before any bucket moves, every rank counts its changes per bucket (the counts and the ``STEPS``
message sizes travel in the export's small agreement all-gather, so that every message can be
padded to the largest and parsed without a header): counting packs each rank's part as a full
export would (the same cast) and compares it bit for bit with the part it packed last. Then per
bucket the ranks gather only the encoded changes (``delta_encoding.py``); the gathering rank
cuts each rank's ascending positions at the tensors' boundaries (one binary search per rank)
and turns them into positions of the full tensor (``AxisGather.global_index``). A bucket no
rank changed moves nothing; a bucket whose changes would cost more than the part moves whole,
as in a full export (``Encoding.PLAIN``), from the part the count packed.
"""

from __future__ import annotations

import itertools
import time

import torch

from shardkit.core.export import delta_encoding as codec
from shardkit.core.export.axis_gathers import AxisGather, TensorSource
from shardkit.core.export.buckets import ExportBucket
from shardkit.core.export.delta_find import HeldRows, refresh_part
from shardkit.core.export.delta_pace import POSTED, BucketPace, carried, moved
from shardkit.core.export.messages import ChangedElements, WeightBucket
from shardkit.core.export.transfer import BucketTransfer, part_layout
from shardkit.core.runtime.chunks import chunk_rows
from shardkit.core.runtime.groups import global_rank

__all__ = ["DENSE_RUN", "count_changes", "held_rows", "move_bucket", "move_changes"]

DENSE_RUN = 8
"""The most syncs in a row a dense bucket goes plain without its comparison: the one sync in
``DENSE_RUN + 1`` that compares it again costs the comparison up to the limit (1/``DENSE`` of
the changes, at most) on top of a full export's cast."""


def move_bucket(transfer: BucketTransfer, bucket: ExportBucket) -> WeightBucket | None:
    """Move one bucket: whole in a full export, its changes in a delta.

    Timed for the next deltas' choice where the export is kept for them (``delta_pace.py``).
    """
    if transfer.previous is not None:
        return move_changes(transfer, bucket)
    start = time.perf_counter()
    ready = transfer.move(bucket)
    if transfer.track:
        moved(transfer.kept.pace, bucket.index, start, plain=True)
    return ready


def move_changes(transfer: BucketTransfer, bucket: ExportBucket) -> WeightBucket | None:
    """Move one bucket's changes; the bucket as the receiver gets it (None on other ranks)."""
    start, plain = time.perf_counter(), transfer.counts.plain_buckets
    ready = _move_changes(transfer, bucket)
    moved(transfer.kept.pace, bucket.index, start, plain=transfer.counts.plain_buckets > plain)
    return ready


def _move_changes(transfer: BucketTransfer, bucket: ExportBucket) -> WeightBucket | None:
    if transfer.watch is not None:
        transfer.watch.raise_if_failed()
    sharded = [s for s in bucket.sources if s.gathers]
    choice = _choose(transfer, bucket) if sharded else None
    if choice is not None and choice[0] is codec.Encoding.PLAIN:
        transfer.counts.plain_buckets += 1
        transfer.changes.pop(bucket.index, None)
        return transfer.move(bucket)
    changes = gather_changes(transfer, bucket, sharded, choice)
    if changes is None or not transfer.receiving:
        return None
    entries = [
        (s.name, changes[s.key] if s.gathers else plain_changes(transfer, s))
        for s in bucket.sources
    ]
    transfer.counts.handed_bytes += sum(
        (c.indices.numel() + c.count) * 8 + c.values.numel() * c.values.element_size()
        for _, c in entries
    )
    return WeightBucket(bucket.index, changed=tuple(entries))


def count_changes(transfer: BucketTransfer) -> list[int]:
    """This rank's changes per bucket, and the times it posts beside them.

    Per bucket, :data:`~shardkit.core.export.delta_pace.POSTED` numbers: its count and its
    ``STEPS`` message's size (zeros for a full export; the part's length where more than
    1/``DENSE`` of it changed: that bucket moves whole, and its positions are never built),
    then its delta's and its plain move's microseconds (``delta_pace.py``). Counting packs this
    export's parts over the kept ones (``delta_find.py``). A bucket this rank found dense is
    not compared for the next 1, 2, 4, ... ``DENSE_RUN`` syncs while it stays dense (it moves
    whole, as in a full export): there a delta costs a full export's time, not a comparison
    more. Under ``plain_when_faster``, neither is a bucket whose delta did not pay lately.
    """
    previous = transfer.previous
    if previous is None:
        return [0] * (POSTED * len(transfer.buckets))
    posted: list[int] = []
    for bucket in transfer.buckets:
        if not any(s.gathers for s in bucket.sources) or not transfer.takes_part(transfer.order[0]):
            posted += [0] * POSTED  # no part of this bucket here
            continue
        pace = carried(previous.pace, transfer.kept.pace, bucket.index)
        start = time.perf_counter()
        posted += _count_bucket(transfer, bucket, pace)
        pace.count_s = time.perf_counter() - start
        posted += pace.posted(transfer.plain_when_faster)
    return posted


def _count_bucket(transfer: BucketTransfer, bucket: ExportBucket, pace: BucketPace) -> list[int]:
    """One bucket's count and ``STEPS`` size on this rank (:func:`count_changes`)."""
    assert transfer.previous is not None
    sharded = [s for s in bucket.sources if s.gathers]
    dtype = sharded[0].dtype
    kept = transfer.previous.parts.get(bucket.index)
    length = part_layout(sharded, [s.gathers[0] for s in sharded])[1] // dtype.itemsize
    left, run = transfer.previous.dense.get(bucket.index, (0, 0))
    if left:
        transfer.kept.dense[bucket.index] = (left - 1, run)
    slow = bucket.index in transfer.paced  # the same on every rank
    transfer.counts.paced_buckets += slow
    if (left or slow) and kept is None:
        # A run with nothing kept to refresh: the bucket moves whole, uncompared (its pieces
        # are not even read here: the move reads them).
        transfer.changes[bucket.index] = None
        return [length, 0]
    pieces = transfer.first_pieces(bucket)
    base = kept if kept is not None else held_rows(transfer, sharded, pieces)
    if base is None:  # the receiver no longer holds the last export: the bucket moves whole
        transfer.changes[bucket.index] = None
        return [length, 0]
    # A bucket found dense, or slow, lately is cast into its part uncompared: a full export's
    # cost.
    skip = bool(left) or slow
    found = refresh_part(pieces, base, dtype, limit=-1 if skip else length // codec.DENSE)
    transfer.counts.compared_buckets += not skip
    if not skip and found is None:  # compared and dense again: skip twice as many syncs
        run = min(max(1, 2 * run), DENSE_RUN)
        transfer.kept.dense[bucket.index] = (run, run)
    if kept is not None:
        # The kept part now holds this export's values, whichever way the bucket moves.
        transfer.kept.parts[bucket.index] = kept
        transfer.packed[bucket.index] = (kept, [offset for _, _, offset in pieces])
    transfer.changes[bucket.index] = found
    pace.compared, pace.dense = found is not None, not skip and found is None
    return [length, 0] if found is None else [found.count, found.steps_bytes()]


def held_rows(
    transfer: BucketTransfer,
    sharded: list[TensorSource],
    pieces: list[tuple[AxisGather, torch.Tensor, int]],
) -> HeldRows | None:
    """This rank's rows of the last export as its receiver holds them; None where it does not.

    The receiver must hold the export this delta is relative to, each tensor whole, in the
    export dtype and contiguous, and every cut must be along dim 0 (a piece's rows are then
    one run of the whole tensor).
    """
    receiver = transfer.previous.receiver if transfer.previous is not None else None
    if receiver is None or receiver.version != transfer.manifest.export_id - 1:
        return None
    assert transfer.groups is not None
    entry = transfer.groups.axes[transfer.order[0]]
    assert entry is not None
    me = entry[1].index(global_rank())
    # A receiver whose copy is in files reads this rank's rows alone (held_span).
    span_of = getattr(receiver, "held_span", None)
    rows: list[torch.Tensor] = []
    for source, (gather, piece, _) in zip(sharded, pieces, strict=True):
        if gather.tensor_dim != 0 or not piece.is_contiguous():
            return None
        start, count = chunk_rows(gather.shape[0], gather.parts, me)
        first = start * (piece.numel() // max(count, 1))
        if callable(span_of):
            found = span_of(source.name, first, piece.numel())
            if found is None:
                return None
            shape, dtype, span = found
        else:
            whole = receiver.held_tensor(source.name)
            if whole is None or not whole.is_contiguous():
                return None
            shape, dtype = tuple(whole.shape), whole.dtype
            span = whole.reshape(-1)[first : first + piece.numel()]
        if shape != gather.shape or dtype != source.dtype or span.device != piece.device:
            return None
        rows.append(span)
    layout = part_layout(sharded, [s.gathers[0] for s in sharded])[1]
    return HeldRows(tuple(rows), layout // sharded[0].dtype.itemsize)


def _choose(
    transfer: BucketTransfer, bucket: ExportBucket
) -> tuple[codec.Encoding, int, list[int]]:
    """The bucket's encoding, its padded size and each member's count (every member agrees)."""
    sharded = [s for s in bucket.sources if s.gathers]
    # Every member's part has the same length: each tensor's padded rows per part.
    itemsize = sharded[0].dtype.itemsize
    length = sum(-(-s.gathers[0].padded_numel * itemsize // 8) * 8 for s in sharded) // itemsize
    if bucket.index in transfer.paced:  # agreed before the count (no counts where all are)
        return codec.Encoding.PLAIN, length * itemsize, []
    assert transfer.all_counts is not None and transfer.groups is not None
    entry = transfer.groups.axes[transfer.order[0]]
    assert entry is not None
    members = entry[1]
    rows = [transfer.all_counts[transfer.groups.world_ranks.index(m)] for m in members]
    counts = [int(row[POSTED * bucket.index]) for row in rows]
    steps = [int(row[POSTED * bucket.index + 1]) for row in rows]
    if max(counts) == 0:
        return codec.Encoding.INDICES, 0, counts
    encoding, size = codec.choose_encoding(counts, steps, length, itemsize)
    return encoding, size, counts


def plain_changes(transfer: BucketTransfer, source: TensorSource) -> ChangedElements:
    """The changes of a tensor no gather moves (a buffer), on the receiving rank."""
    assert transfer.previous is not None
    now = source.local().to(source.dtype, copy=True).reshape(-1)
    changes = codec.local_changes(now, transfer.previous.plain[source.key].reshape(-1))
    transfer.kept.plain[source.key] = now.view(source.shape)
    return ChangedElements(changes.positions, changes.values)


def gather_changes(
    transfer: BucketTransfer,
    bucket: ExportBucket,
    sharded: list[TensorSource],
    choice: tuple[codec.Encoding, int, list[int]] | None,
) -> dict[str, ChangedElements] | None:
    """Gather every rank's changes of ``bucket``'s sharded tensors; by key where received."""
    assert transfer.previous is not None and transfer.groups is not None
    if not sharded or choice is None:
        return {}
    transfer.packed.pop(bucket.index, None)  # the kept part stays in ``transfer.kept``
    changes = transfer.changes.pop(bucket.index, None)
    if changes is None:
        return None  # this rank takes no part in the bucket's gather
    offsets = part_layout(sharded, [s.gathers[0] for s in sharded])[0]
    buffer = changes.positions  # where this rank's tensors live
    encoding, size, counts = choice
    dtype = sharded[0].dtype
    entry = transfer.groups.axes[transfer.order[0]]
    assert entry is not None
    receives = transfer.to_all or entry[1][0] == global_rank()
    me = entry[1].index(global_rank())
    if max(counts) == 0:
        empty = torch.empty(0, dtype=torch.int64, device=buffer.device)
        nothing = torch.empty(0, dtype=dtype, device=buffer.device)
        decoded = [codec.Decoded(empty, nothing, empty, empty.to(torch.int8))] * len(counts)
    else:
        what = (
            f"bucket {bucket.index} ({sharded[0].name}, ...): changes along mesh dim "
            f"{transfer.order[0]}"
        )
        # A gathering rank that only receives never reads its own row: it is not encoded.
        sends = transfer.to_all or me != 0
        message = (
            codec.encode(changes, encoding, size)
            if sends
            else torch.empty(size, dtype=torch.uint8, device=buffer.device)
        )
        out = transfer.gather(message, transfer.order[0], what)
        if out is None:
            return None
        # This rank's own row needs no decoding: its changes are at hand.
        decoded = [
            codec.as_decoded(changes, encoding)
            if rank == me
            else codec.decode(message, count, changes.length, dtype, encoding)
            for rank, (count, message) in enumerate(zip(counts, out.unbind(0), strict=True))
        ]
    if not receives:
        return None
    starts = [offset // dtype.itemsize for offset in offsets]
    return split_changes(sharded, starts, decoded)


def split_changes(
    sharded: list[TensorSource], starts: list[int], decoded: list[codec.Decoded]
) -> dict[str, ChangedElements]:
    """Each tensor's changes in the full tensor, from every rank's decoded message.

    ``starts``: each tensor's first element in a part. Every rank's positions ascend, so one
    binary search per rank finds where each tensor's run begins and ends. Where every cut is
    along dim 0 (FSDP's), a rank's rows of a tensor are one run of the full tensor: the runs
    are joined in one buffer per field, tensor after tensor, shifted by one add, and each
    tensor's changes are a slice of it (a few ops a bucket, not a few per tensor and rank).
    """
    if any(s.gathers[0].tensor_dim != 0 for s in sharded):
        return _split_each(sharded, starts, decoded)
    padded = [s.gathers[0].padded_numel for s in sharded]
    index, value = _place_runs(padded, starts, [(d.positions, d.values) for d in decoded])
    stepped, steps = _place_runs(padded, starts, [(d.stepped, d.steps) for d in decoded])
    return {
        s.key: ChangedElements(*fields)
        for s, *fields in zip(sharded, index, value, stepped, steps, strict=True)
    }


def _place_runs(
    padded: list[int], starts: list[int], runs: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per tensor, every rank's positions (in the full tensor) and payloads, rank after rank.

    ``runs``: per rank, ascending positions in its part and their payload. The runs are joined
    tensor after tensor, rank after rank (one ``cat`` per field: a copy, which costs less than
    placing each element by index), and rank ``r``'s run of tensor ``t`` moves by
    ``r * padded[t] - starts[t]`` (one add).
    """
    edges = torch.tensor([e for at, n in zip(starts, padded, strict=True) for e in (at, at + n)])
    cuts = [torch.searchsorted(p, edges.to(p.device)).tolist() for p, _ in runs]
    order = [(t, r) for t in range(len(starts)) for r in range(len(runs))]
    counts = [cuts[r][2 * t + 1] - cuts[r][2 * t] for t, r in order]
    assert sum(counts) == sum(p.numel() for p, _ in runs), "a change outside every tensor"
    joined = [
        torch.cat([runs[r][field][cuts[r][2 * t] : cuts[r][2 * t + 1]] for t, r in order])
        for field in (0, 1)
    ]
    device = joined[0].device
    shift = torch.tensor([r * padded[t] - starts[t] for t, r in order], device=device)
    joined[0] += torch.repeat_interleave(shift, torch.tensor(counts, device=device))
    ranks = len(runs)
    bounds = [
        0,
        *itertools.accumulate(sum(counts[t * ranks : (t + 1) * ranks]) for t in range(len(starts))),
    ]
    positions, payload = (
        [column[lo:hi] for lo, hi in itertools.pairwise(bounds)] for column in joined
    )
    return positions, payload


def _split_each(
    sharded: list[TensorSource], starts: list[int], decoded: list[codec.Decoded]
) -> dict[str, ChangedElements]:
    """:func:`split_changes` tensor by tensor, where some cut is not along dim 0."""
    edges = torch.tensor(
        [
            e
            for s, at in zip(sharded, starts, strict=True)
            for e in (at, at + s.gathers[0].padded_numel)
        ],
        dtype=torch.int64,
    )
    cuts = [
        (
            torch.searchsorted(d.positions, edges.to(d.positions.device)).tolist(),
            torch.searchsorted(d.stepped, edges.to(d.stepped.device)).tolist(),
        )
        for d in decoded
    ]
    found: dict[str, ChangedElements] = {}
    for i, (source, start) in enumerate(zip(sharded, starts, strict=True)):
        gather = source.gathers[0]
        parts: list[list[torch.Tensor]] = [[], [], [], []]
        for rank, (d, (at, at_stepped)) in enumerate(zip(decoded, cuts, strict=True)):
            lo, hi = at[2 * i], at[2 * i + 1]
            parts[0].append(gather.global_index(rank, d.positions[lo:hi] - start))
            parts[1].append(d.values[lo:hi])
            lo, hi = at_stepped[2 * i], at_stepped[2 * i + 1]
            parts[2].append(gather.global_index(rank, d.stepped[lo:hi] - start))
            parts[3].append(d.steps[lo:hi])
        index, value, stepped, steps = (torch.cat(p) for p in parts)
        if gather.tensor_dim != 0:  # a part's rows are not one run of the full tensor
            index, order = torch.sort(index)
            value = value[order]
            stepped, order = torch.sort(stepped)
            steps = steps[order]
        found[source.key] = ChangedElements(index, value, stepped, steps)
    return found
