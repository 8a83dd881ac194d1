"""One export's buckets on the wire: pack (casting), gather, unpack; whole or changes only.

A bucket's tensors travel together, one collective per gathered mesh axis. Each rank packs its
pieces into one byte buffer (each tensor's segment aligned to 8 bytes and padded to the
gather's rows per part, so every rank sends the same length), casting to the export dtype in
the copy. The gathering rank narrows each rank's segment and joins the pieces.

Under ``delta`` the packed part is compared, bit for bit, with the one this rank packed last
(``delta_transfer.py``), and only the changes travel, or the part itself where that is cheaper
(a *plain* bucket, moved here as a full export's). Each part is packed once per export: the
count of changes packs it, and its gather reuses it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.distributed.device_mesh import DeviceMesh

from shardkit.core.export.axis_gathers import AxisGather, TensorSource
from shardkit.core.export.buckets import ExportBucket
from shardkit.core.export.delta_encoding import LocalChanges
from shardkit.core.export.delta_pace import BucketPace, Runs
from shardkit.core.export.messages import ExportManifest, WeightBucket
from shardkit.core.export.receiver_guard import guard_receiver
from shardkit.core.runtime.chunks import chunk_rows
from shardkit.core.runtime.export.export_groups import (
    ExportGroups,
    ExportWatch,
    gather_buffer,
    on_gloo,
    post_pieces,
)
from shardkit.core.runtime.groups import global_rank

__all__ = ["BucketTransfer", "HoldsExport", "PreviousExport", "TransferCounts", "part_layout"]

_ALIGN = 8


@dataclass(slots=True)
class TransferCounts:
    """Collectives and bytes of one export on one rank."""

    collectives: int = 0
    sent_bytes: int = 0
    """Bytes this rank sent to other ranks in the export's gathers: its part (padded where the
    gather packs) once for each member that takes it."""
    received_bytes: int = 0
    """Bytes other ranks sent into this rank in them (its own part, copied, not included)."""
    handed_bytes: int = 0
    """Bytes handed to the receiver (the receiving rank)."""
    plain_buckets: int = 0
    """Buckets of a delta export that moved whole (changes would not have been cheaper)."""
    compared_buckets: int = 0
    """Buckets of a delta export this rank compared with its kept part (a bucket found dense
    lately is not: it moves whole)."""
    paced_buckets: int = 0
    """Buckets of a delta export that went plain uncompared because their delta did not pay
    lately (``ExportOptions.plain_when_faster``, ``delta_pace.py``)."""


@dataclass(slots=True)
class PreviousExport:
    """What this rank exported last, for a delta.

    Its packed part per bucket, and the plain tensors it sent (the receiving rank).
    """

    parts: dict[int, torch.Tensor] = field(default_factory=dict)
    plain: dict[str, torch.Tensor] = field(default_factory=dict)
    dense: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Buckets this rank found dense: (syncs left that go plain uncompared, the run's length);
    ``delta_transfer.count_changes`` keeps it."""
    receiver: HoldsExport | None = None
    """This rank's in-process receiver, where its copy of the export is the base in place of
    kept parts (``parts`` then stays empty)."""
    pace: dict[int, BucketPace] = field(default_factory=dict)
    """Per bucket, its delta's and its plain move's last times on this rank (``delta_pace``)."""
    slow: Runs = field(default_factory=dict)
    """Buckets whose delta did not pay lately, and their runs (``delta_pace.settle``)."""


class HoldsExport(Protocol):
    """A receiver that holds the last export it committed whole, in this process."""

    version: int | None
    """The export it holds complete (None: none)."""

    def held_tensor(self, name: str) -> torch.Tensor | None:
        """Its tensor ``name`` of export ``version``, unchanged until its next commit."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def part_layout(sources: list[TensorSource], gathers: list[AxisGather]) -> tuple[list[int], int]:
    """Each tensor's byte offset in a packed part (8-byte aligned), and the part's bytes."""
    offsets, total = [], 0
    for source, gather in zip(sources, gathers, strict=True):
        offsets.append(total)
        total += _aligned(gather.padded_numel * source.dtype.itemsize)
    return offsets, total


def _first_gather(source: TensorSource) -> AxisGather:
    return source.gathers[0]


@dataclass(slots=True)
class BucketTransfer:
    """One export in flight on this rank."""

    manifest: ExportManifest
    buckets: list[ExportBucket]
    groups: ExportGroups | None
    watch: ExportWatch | None
    mesh: DeviceMesh | None
    to_all: bool
    keep_dims: set[int]
    order: list[int]
    """The gathered mesh dims, in the order every bucket gathers them."""
    receiving: bool
    """This rank hands the buckets to a receiver."""
    previous: PreviousExport | None
    """The last export's parts (a delta is relative to them); None for a full export."""
    track: bool
    """Keep this export's parts for the next delta."""
    keep_parts: bool = True
    """Under ``track``: keep packed parts (False where the receiver's copy is the base)."""
    plain_when_faster: bool = False
    """A delta's bucket goes plain, uncompared, where its delta did not pay lately."""
    counts: TransferCounts = field(default_factory=TransferCounts)
    all_counts: torch.Tensor | None = None
    """(mesh ranks, buckets): every rank's changed elements per bucket (a delta)."""
    kept: PreviousExport = field(default_factory=PreviousExport)
    """This export's parts, for the next delta."""
    packed: dict[int, tuple[torch.Tensor, list[int]]] = field(default_factory=dict)
    """Parts already packed (a delta's count packs them), with their tensors' byte offsets."""
    paced: set[int] = field(default_factory=set)
    """Buckets this delta export sends plain, uncompared: their delta did not pay lately."""
    changes: dict[int, LocalChanges | None] = field(default_factory=dict)
    read: dict[str, torch.Tensor] = field(default_factory=dict)
    """Pieces a delta's count read, by key, for the bucket's move: read once (reading every
    tensor's piece, a DTensor's ``to_local``, took 2.3 to 2.5 ms of a 5M model's export of about
    20 ms, measured)."""
    """A delta's changes per bucket, found by the count (None: too many, the bucket is plain)."""

    # Who takes part -------------------------------------------------------------------
    def takes_part(self, mesh_dim: int) -> bool:
        """Whether this rank gathers along ``mesh_dim``.

        With ``to="first"``, only ranks at coordinate 0 of the replicated axes and of the axes
        gathered before it do.
        """
        if self.to_all or self.mesh is None:
            return True
        coord = self.mesh.get_coordinate()
        assert coord is not None
        before = self.order[: self.order.index(mesh_dim)]
        replicated = [
            m for m in range(len(coord)) if m not in self.keep_dims and m not in self.order
        ]
        return all(coord[m] == 0 for m in before + replicated)

    # Packing ----------------------------------------------------------------------------
    def _pack(
        self, sources: list[TensorSource], gathers: list[AxisGather], pieces: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[int]]:
        offsets, total = part_layout(sources, gathers)
        buffer = torch.empty(total, dtype=torch.uint8, device=pieces[0].device if pieces else "cpu")
        for source, gather, piece, offset in zip(sources, gathers, pieces, offsets, strict=True):
            end = offset + gather.padded_numel * source.dtype.itemsize
            gather.pack(piece, buffer[offset:end].view(source.dtype))
            # The alignment gap is zeroed: a delta compares the whole part, bit for bit.
            buffer[end : offset + _aligned(end - offset)].zero_()
        return buffer, offsets

    def first_pieces(self, bucket: ExportBucket) -> list[tuple[AxisGather, torch.Tensor, int]]:
        """This rank's pieces of the bucket's first gather, with their offsets in its part.

        Empty where the bucket has no sharded tensor or this rank takes no part in its gather.
        """
        sharded = [s for s in bucket.sources if s.gathers]
        if not sharded or not self.takes_part(self.order[0]):
            return []
        gathers = [_first_gather(s) for s in sharded]
        offsets, _ = part_layout(sharded, gathers)
        self.read.update((s.key, s.local()) for s in sharded)
        return [(g, self.read[s.key], o) for s, g, o in zip(sharded, gathers, offsets, strict=True)]

    def _first_pack(
        self,
        bucket: int,
        batch: list[TensorSource],
        gathers: list[AxisGather],
        pieces: list[torch.Tensor],
    ) -> tuple[torch.Tensor, list[int]]:
        """The bucket's first gather's part: packed by the count already, or packed now."""
        packed = self.packed.pop(bucket, None)
        if packed is not None and len(packed[1]) == len(batch):
            return packed
        return self._pack(batch, gathers, pieces)

    # Per bucket -------------------------------------------------------------------------------
    def move(self, bucket: ExportBucket) -> WeightBucket | None:
        """Move one bucket whole; the bucket as the receiver gets it (None on other ranks).

        A delta export's buckets move through ``delta_transfer.move_changes`` instead (which
        calls this for a bucket that goes plain).
        """
        if self.watch is not None:
            self.watch.raise_if_failed()
        sharded = [s for s in bucket.sources if s.gathers]
        gathered = self._gather_whole(bucket, sharded)
        if gathered is None or not self.receiving:
            return None
        full = [(s.name, gathered[s.key] if s.gathers else self._plain(s)) for s in bucket.sources]
        self.counts.handed_bytes += sum(t.numel() * t.element_size() for _, t in full)
        return WeightBucket(bucket.index, full=tuple(full))

    def _plain(self, source: TensorSource) -> torch.Tensor:
        value = source.local().to(source.dtype, copy=True)
        if self.track:
            self.kept.plain[source.key] = value
        return value

    def gather(self, buffer: torch.Tensor, mesh_dim: int, what: str) -> torch.Tensor | None:
        """Gather ``buffer`` along ``mesh_dim`` (every member's row; None where not received)."""
        assert self.groups is not None and self.watch is not None
        entry = self.groups.axes[mesh_dim]
        assert entry is not None, f"no export group along mesh dim {mesh_dim}"
        group, members = entry
        self.watch.post(what)
        self.watch.raise_if_failed()
        works, out = gather_buffer(buffer, group, members, to_all=self.to_all)
        self.watch.wait(works, members, on_device=buffer.device.type != "cpu")
        if len(members) > 1:  # a group of one moves nothing
            self.counts.collectives += 1
            # Over the wire, as the direct path counts: this rank's part to each member that
            # takes it, and the other members' parts into this rank (padding included).
            takers = len(members) - 1 if self.to_all else int(members.index(global_rank()) != 0)
            self.counts.sent_bytes += buffer.numel() * takers
            if out is not None:
                self.counts.received_bytes += out.numel() - buffer.numel()
        return out

    def _gather_whole(
        self, bucket: ExportBucket, sharded: list[TensorSource]
    ) -> dict[str, torch.Tensor] | None:
        read = [self.read.pop(s.key, None) for s in sharded]
        current = {s.key: s.local() if r is None else r for s, r in zip(sharded, read, strict=True)}
        first = True
        for mesh_dim in self.order:
            batch = [s for s in sharded if any(st.mesh_dim == mesh_dim for st in s.gathers)]
            if not batch:
                continue
            if not self.takes_part(mesh_dim):
                return None
            gathers = [next(st for st in s.gathers if st.mesh_dim == mesh_dim) for s in batch]
            if self._direct(mesh_dim, gathers):
                what = f"bucket {bucket.index} ({batch[0].name}, ...): pieces, mesh dim {mesh_dim}"
                whole = self._gather_pieces(
                    bucket.index, batch, gathers, current, mesh_dim, first, what
                )
                if whole is None:
                    return None
                current.update(whole)
                first = False
                continue
            pieces = [current[s.key] for s in batch]
            buffer, offsets = (
                self._first_pack(bucket.index, batch, gathers, pieces)
                if first
                else self._pack(batch, gathers, pieces)
            )
            if first and self.track and self.keep_parts:
                self.kept.parts[bucket.index] = buffer
            first = False
            what = f"bucket {bucket.index} ({batch[0].name}, ...): gather along mesh dim {mesh_dim}"
            out = self.gather(buffer, mesh_dim, what)
            # The part is no longer needed (unless a delta keeps it): the unpacked tensors
            # take its place, so the bucket is held twice at most (``out`` and them).
            del buffer
            if out is None:
                return None
            for source, gather, offset in zip(batch, gathers, offsets, strict=True):
                nbytes = gather.padded_numel * source.dtype.itemsize
                parts = [row[offset : offset + nbytes].view(source.dtype) for row in out]
                current[source.key] = gather.unpack(parts)
        return current

    def _direct(self, mesh_dim: int, gathers: list[AxisGather]) -> bool:
        """Whether a gather's pieces travel as messages into their places (gloo, dim-0 cuts)."""
        assert self.groups is not None
        entry = self.groups.axes[mesh_dim]
        return entry is not None and on_gloo(entry[0]) and all(st.tensor_dim == 0 for st in gathers)

    def _gather_pieces(
        self,
        bucket: int,
        batch: list[TensorSource],
        gathers: list[AxisGather],
        current: dict[str, torch.Tensor],
        mesh_dim: int,
        first: bool,
        what: str,
    ) -> dict[str, torch.Tensor] | None:
        """One gather of dim-0 cuts: each rank's rows of each tensor land in place.

        A dim-0 piece is a run of whole rows, contiguous in the full tensor: the receiving rank
        posts one receive per rank and tensor straight into it, and copies (casting) its own
        rows in; a sending rank packs its pieces (the cast) and sends each tensor's rows.
        """
        assert self.groups is not None and self.watch is not None
        entry = self.groups.axes[mesh_dim]
        assert entry is not None
        group, members = entry
        me = members.index(global_rank())
        receives = self.to_all or me == 0
        sends = self.to_all or me != 0
        pieces = [current[s.key] for s in batch]
        packed = None
        keeps = first and self.track and self.keep_parts
        if sends or keeps:
            packed = (
                self._first_pack(bucket, batch, gathers, pieces)
                if first
                else self._pack(batch, gathers, pieces)
            )
            if keeps:
                self.kept.parts[bucket] = packed[0]
        sent: dict[int, list[torch.Tensor]] = {}
        taken: dict[int, list[torch.Tensor]] = {}
        full: dict[str, torch.Tensor] = {}
        for index, (source, gather, piece) in enumerate(zip(batch, gathers, pieces, strict=True)):
            row = gather.padded_numel // max(gather.rows_per_part, 1)
            if receives:
                whole = torch.empty(gather.shape, dtype=source.dtype, device=piece.device)
                full[source.key] = whole
                start, rows = _rows(gather, me)
                into = whole.narrow(0, start, rows)
                if rows and packed is not None:
                    # Already cast into the part (a delta's count, or the kept part): copied
                    # from there rather than cast a second time.
                    at = packed[1][index]
                    cast = packed[0][at : at + into.numel() * source.dtype.itemsize]
                    into.copy_(cast.view(source.dtype).view(into.shape))
                elif rows:
                    into.copy_(piece)
                for peer in range(len(members)):
                    peer_start, peer_rows = _rows(gather, peer)
                    if peer != me and peer_rows:
                        flat = whole.view(-1)[peer_start * row : (peer_start + peer_rows) * row]
                        taken.setdefault(peer, []).append(flat)
            mine = _rows(gather, me)[1] * row
            if sends and mine:
                assert packed is not None
                offset = packed[1][index]
                data = packed[0][offset : offset + mine * source.dtype.itemsize].view(source.dtype)
                for peer in range(len(members)) if self.to_all else [0]:
                    if peer != me:
                        sent.setdefault(peer, []).append(data)
        self.watch.post(what)
        self.watch.raise_if_failed()
        works = post_pieces(group, sends=sent, receives=taken)
        on_device = any(
            t.device.type != "cpu" for ts in (*sent.values(), *taken.values()) for t in ts
        )
        self.watch.wait(works, members, on_device=on_device)
        self.counts.collectives += 1
        self.counts.sent_bytes += sum(
            t.numel() * t.element_size() for ts in sent.values() for t in ts
        )
        self.counts.received_bytes += sum(
            t.numel() * t.element_size() for ts in taken.values() for t in ts
        )
        return full if receives else None

    # The receiver ---------------------------------------------------------------------------
    def guarded(self, work: Callable[[], None], where: object) -> float:
        """Run receiver work; its failure or lateness becomes the export's verdict."""
        label = (
            f"bucket {where.index} ({where.sources[0].name}, ...)"
            if isinstance(where, ExportBucket)
            else str(where)
        )
        export = f"weight export {self.manifest.export_id}"
        return guard_receiver(self.watch, work, label, export=export, receiver="the receiver")


def _rows(gather: AxisGather, index: int) -> tuple[int, int]:
    """``(first row, rows)`` of rank ``index``'s piece along the gather's (dim-0) cut."""
    return chunk_rows(gather.shape[0], gather.parts, index)
