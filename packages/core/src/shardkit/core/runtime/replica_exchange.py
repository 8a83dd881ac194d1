"""Tensors that several replicas must hold alike, each read by one, broadcast to the others.

The checkpoint's replica-split loads (``checkpoint/replica_reads.py``) have each replica of a
shard read part of it; here every replica's part goes to the others over their group, one
broadcast per replica's part (or per bucket of it), never one per tensor, and one bucket's
buffer beside the state at a time.

A part can hold thousands of tensors: split by the saved items, a replica's part is a box of
each local tensor per item it read (1,581 to 18,015 boxes a rank for 8B and 70B under HSDP
from 1,024 to 16,384 ranks), and there are as many parts as replicas (128 to 2,048). So the
tensors move as bytes, back to back, in buckets that hold the parts of several replicas:
each replica's broadcast lands in its span of the bucket, the reader having packed its span
with one ``cat``; once the bucket's broadcasts are done, every span but this rank's own is
unpacked with one ``split_with_sizes_copy`` into byte views of the tensors. So the copies
grow with the bytes (about two a bucket), not with the boxes or the replicas: on an
accelerator a few launches a bucket, not one a box. A box that is not contiguous (a reshard
that cuts a shard along another dim than its first) costs one copy more, of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["broadcast_parts", "pack", "unpack"]

# A bucket's bytes: the parts travel in pieces of at most this, so the exchange holds one
# bucket beside the state, not a replica's whole part.
_BUCKET_BYTES = 256 << 20


@dataclass(slots=True)
class _Span:
    """One replica's tensors in a bucket: they fill ``[start, start + nbytes)`` of it."""

    reader: int
    start: int
    tensors: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0


def _buckets(parts: list[list[torch.Tensor]]) -> list[list[_Span]]:
    """The parts in buckets of at most ``_BUCKET_BYTES`` (empty tensors left out).

    Each bucket is a list of spans (a replica's tensors, in order), on one device. A part
    joins the bucket being filled where it fits there whole, else starts a bucket of its
    own: so a part is cut only where it is larger than a bucket, where its tensors end (a
    tensor larger than a bucket fills one alone), and makes as many broadcasts as it would
    alone (each cut is one more). Every replica cuts them alike: from shapes and dtypes.
    """
    buckets: list[list[_Span]] = [[]]
    used = 0
    for reader, part in enumerate(parts):
        sizes = [t.numel() * t.element_size() for t in part]
        whole = sum(sizes)
        if used and used + whole > _BUCKET_BYTES:
            buckets.append([])
            used = 0
        for tensor, size in zip(part, sizes, strict=True):
            if size == 0:
                continue
            spans = buckets[-1]
            other_device = bool(spans) and spans[0].tensors[0].device != tensor.device
            if used and (used + size > _BUCKET_BYTES or other_device):
                spans = []
                buckets.append(spans)
                used = 0
            if not spans or spans[-1].reader != reader:
                spans.append(_Span(reader, used))
            spans[-1].tensors.append(tensor)
            spans[-1].nbytes += size
            used += size
    return [spans for spans in buckets if spans]


def broadcast_parts(
    parts: list[list[torch.Tensor]], ranks: list[int], me: int, group: dist.ProcessGroup
) -> tuple[int, int]:
    """Each replica's part broadcast from it to the others, bucket by bucket (collective).

    ``parts[r]``: the tensors replica ``r`` (global rank ``ranks[r]``) holds the values of;
    the others' tensors of the same shapes and dtypes are overwritten with them. ``me``: this
    rank's place in ``ranks``. Returns (bytes received, broadcasts made).
    """
    received = broadcasts = 0
    for spans in _buckets(parts):
        end = spans[-1].start + spans[-1].nbytes
        buffer = torch.empty(end, dtype=torch.uint8, device=spans[0].tensors[0].device)
        for span in spans:
            view = buffer[span.start : span.start + span.nbytes]
            if span.reader == me:
                pack(span.tensors, view)
            dist.broadcast(view, src=ranks[span.reader], group=group)
            broadcasts += 1
        # The spans before this rank's own, then those after it: one unpack each.
        own = [i for i, span in enumerate(spans) if span.reader == me]
        cut = own[0] if own else len(spans)
        for run in (spans[:cut], spans[cut + 1 :] if own else []):
            if run:
                low, high = run[0].start, run[-1].start + run[-1].nbytes
                unpack(buffer[low:high], [t for span in run for t in span.tensors])
                received += high - low
    return received, broadcasts


def pack(tensors: list[torch.Tensor], buffer: torch.Tensor) -> None:
    """``tensors``' bytes into ``buffer`` (uint8, their bytes in all), back to back.

    One ``cat`` (a tensor that is not contiguous is copied into one that is first).
    """
    torch.cat([_bytes_of(t) for t in tensors], out=buffer)


def unpack(buffer: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """:func:`pack`'s inverse: ``buffer``'s bytes into ``tensors``.

    One ``split_with_sizes_copy`` into byte views of them, through a scratch copy for a
    tensor that is not contiguous (no byte view of it exists).
    """
    scattered = [t for t in tensors if not t.is_contiguous()]
    outs = [
        _bytes_of(t)
        if t.is_contiguous()
        else torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, device=t.device)
        for t in tensors
    ]
    torch.split_with_sizes_copy(buffer, [out.numel() for out in outs], out=outs)
    if scattered:
        for tensor, out in zip(tensors, outs, strict=True):
            if not tensor.is_contiguous():
                tensor.copy_(out.view(tensor.dtype).view(tensor.shape))


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes, 1-D uint8: a view of it where it is contiguous, else a copy."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)  # 1-D, stride 1: viewable
