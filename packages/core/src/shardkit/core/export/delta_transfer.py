"""A delta export's buckets on the wire: each rank's changes counted, encoded and gathered.

Before any bucket moves, every rank counts its changes per bucket (the counts and the ``STEPS``
message sizes travel in the export's small agreement all-gather, so that every message can be
padded to the largest and parsed without a header). Then per bucket each rank packs its part
as a full export would (the same cast), compares it bit for bit with the part it packed last,
and gathers only the encoded changes (``delta_encoding.py``); the gathering rank turns each rank's
positions into positions of the full tensor (``AxisGather.global_index``). A bucket no rank changed
moves nothing.
"""

from __future__ import annotations

import torch

from shardkit.core.export.axis_gathers import TensorSource
from shardkit.core.export.buckets import ExportBucket
from shardkit.core.export.delta_encoding import (
    Decoded,
    LocalChanges,
    choose_encoding,
    decode,
    encode,
    local_changes,
)
from shardkit.core.export.messages import ChangedElements, WeightBucket
from shardkit.core.export.transfer import BucketTransfer
from shardkit.core.runtime.groups import global_rank

__all__ = ["count_changes", "move_changes"]


def move_changes(transfer: BucketTransfer, bucket: ExportBucket) -> WeightBucket | None:
    """Move one bucket's changes; the bucket as the receiver gets it (None on other ranks)."""
    if transfer.watch is not None:
        transfer.watch.raise_if_failed()
    sharded = [s for s in bucket.sources if s.gathers]
    changes = gather_changes(transfer, bucket, sharded)
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
    """This rank's changes per bucket.

    Its count and its ``STEPS`` message's size, for each bucket in turn (zeros for a
    full export).
    """
    if transfer.previous is None:
        return [0] * (2 * len(transfer.buckets))
    posted: list[int] = []
    for bucket in transfer.buckets:
        found = _local_changes(transfer, bucket)
        posted += [0, 0] if found is None else [found[0].count, found[0].steps_bytes()]
    return posted


def _local_changes(
    transfer: BucketTransfer, bucket: ExportBucket
) -> tuple[LocalChanges, torch.Tensor, list[int]] | None:
    """This rank's changes in its part of ``bucket``, the part, and its tensors' offsets."""
    assert transfer.previous is not None
    part = transfer.first_part(bucket)
    if part is None:
        return None
    buffer, offsets = part
    dtype = next(s.dtype for s in bucket.sources if s.gathers)
    before = transfer.previous.parts[bucket.index].view(dtype)
    return local_changes(buffer.view(dtype), before), buffer, offsets


def plain_changes(transfer: BucketTransfer, source: TensorSource) -> ChangedElements:
    """The changes of a tensor no gather moves (a buffer), on the receiving rank."""
    assert transfer.previous is not None
    now = source.local().to(source.dtype, copy=True).reshape(-1)
    changes = local_changes(now, transfer.previous.plain[source.key].reshape(-1))
    transfer.kept.plain[source.key] = now.view(source.shape)
    return ChangedElements(changes.positions, changes.values)


def gather_changes(
    transfer: BucketTransfer, bucket: ExportBucket, sharded: list[TensorSource]
) -> dict[str, ChangedElements] | None:
    """Gather every rank's changes of ``bucket``'s sharded tensors; by key where received."""
    assert transfer.previous is not None and transfer.all_counts is not None
    assert transfer.groups is not None
    if not sharded:
        return {}
    found = _local_changes(transfer, bucket)
    if found is None:
        return None
    changes, buffer, offsets = found
    transfer.kept.parts[bucket.index] = buffer
    dtype = sharded[0].dtype
    entry = transfer.groups.axes[transfer.order[0]]
    assert entry is not None
    members = entry[1]
    rows = [transfer.all_counts[transfer.groups.world_ranks.index(m)] for m in members]
    counts = [int(row[2 * bucket.index]) for row in rows]
    steps = [int(row[2 * bucket.index + 1]) for row in rows]
    receives = transfer.to_all or members[0] == global_rank()
    empty = torch.empty(0, dtype=torch.int64, device=buffer.device)
    if max(counts) == 0:
        nothing = torch.empty(0, dtype=dtype, device=buffer.device)
        decoded = [Decoded(empty, nothing, empty, empty)] * len(members)
    else:
        encoding, size = choose_encoding(counts, steps, changes.length, dtype.itemsize)
        what = (
            f"bucket {bucket.index} ({sharded[0].name}, ...): changes along mesh dim "
            f"{transfer.order[0]}"
        )
        out = transfer.gather(encode(changes, encoding, size), transfer.order[0], what)
        if out is None:
            return None
        decoded = [
            decode(message, count, changes.length, dtype, encoding)
            for count, message in zip(counts, out.unbind(0), strict=True)
        ]
    if not receives:
        return None
    return {
        s.key: changes_of(s, offsets[i] // dtype.itemsize, decoded) for i, s in enumerate(sharded)
    }


def changes_of(source: TensorSource, start: int, decoded: list[Decoded]) -> ChangedElements:
    """One tensor's changes in the full tensor, from every rank's decoded message."""
    gather = source.gathers[0]

    def place(
        positions_of: list[torch.Tensor], values_of: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        indices, values = [], []
        for rank, (positions, vals) in enumerate(zip(positions_of, values_of, strict=True)):
            mine = (positions >= start) & (positions < start + gather.padded_numel)
            indices.append(gather.global_index(rank, positions[mine] - start))
            values.append(vals[mine])
        index, value = torch.cat(indices), torch.cat(values)
        if gather.tensor_dim != 0 and index.numel():
            index, order = torch.sort(index)
            value = value[order]
        return index, value

    indices, values = place([d.positions for d in decoded], [d.values for d in decoded])
    stepped, steps = place([d.stepped for d in decoded], [d.steps for d in decoded])
    return ChangedElements(indices, values, stepped, steps)
