"""An export's predicted cost: the bytes, buckets, collectives, peak and time of one export.

``shardkit.core.export.WeightExporter.export`` sends a sharded model's weights to an inference
engine. What it costs follows from the export's layout (``layout``): per bucket and
gathered mesh axis, every rank of the gather packs its padded, 8-byte-aligned segments in the
export dtype, and the receiving rank (``to="first"``: the mesh's first; ``to="all"``: every
rank, an all-gather) gets them all; on gloo a gather of dim-0 cuts travels instead as messages
of each rank's own rows, unpadded, into place. Around the buckets, small all-gathers over every
mesh rank: the agreement (3 int64) and the end (1 int64), and for a delta the changes counted
(2 int64 per bucket).

:attr:`ExportCost.ranks` predicts each rank's ``ExportReport.counts`` (collectives, bytes sent,
bytes gathered in). For a full export on FSDP, HSDP and FSDP x TP (no ``keep_axes``) it is
exact: the tests compare every rank's at W=2 and W=4 on gloo. A delta's bytes depend on where
the changes fall, and are estimated from ``delta_fraction``.

Time: each gather is priced on the link of its axis (``Hardware.link``) with the
``all_gather`` curve. A gather's receiving rank takes in the other ranks' parts, exactly what
each rank of a ring all-gather takes in, and a calibrated profile (gloo) measures that curve;
no curve is measured for a gather. Each collective adds the profile's
``collective_overhead_s`` (the host's work per collective, measured on a CPU profile).

Next to split off: the per-rank model of each bucket's gathers (``_Gathers``, ``_GatherBytes``,
``_Moved``, ``_aligned``, ``_delta_message``) into ``plan/export/gathers.py``, beside this module:
``export_cost`` only sums the ``_Moved`` records it returns, and it needs nothing but
``layout`` and the spec.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from shardkit.core.export import check_shape_options
from shardkit.tools.plan.export.axis_gathers import (
    ExportBucketModel,
    ExportMesh,
    ExportTensor,
    plan_export_buckets,
)
from shardkit.tools.plan.timing.hardware import Hardware

__all__ = [
    "DEFAULT_EXPORT_BUCKET_BYTES",
    "DEFAULT_EXPORT_MIN_BUCKETS",
    "ExportCost",
    "ExportSpec",
    "RankCounts",
    "export_cost",
]

DEFAULT_EXPORT_BUCKET_BYTES = 64 * 2**20
"""``ExportOptions.bucket_bytes``' default."""
DEFAULT_EXPORT_MIN_BUCKETS = 4
"""``ExportOptions.min_buckets``' default."""
_HEAD_BYTES = 3 * 8  # the agreement: plan digest, export number, kind
_END_BYTES = 8
_ALIGN = 8
"""Each tensor's segment of a packed part starts on an 8-byte boundary."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportSpec:
    """What export is planned: the mesh and ``ExportOptions``' fields that set its cost."""

    world_size: int
    """Ranks of the model's mesh."""
    replicas: int = 1
    """HSDP replica groups (1: FSDP)."""
    tp_degree: int = 1
    """Ranks of the tensor-parallel axis (1: none)."""
    dtype: torch.dtype | None = None
    """The export dtype (floating tensors are cast to it); None: as stored."""
    bucket_bytes: int = DEFAULT_EXPORT_BUCKET_BYTES
    """A bucket's bound, in the export dtype."""
    min_buckets: int = DEFAULT_EXPORT_MIN_BUCKETS
    """Buckets are also at most the export's bytes over this (``ExportOptions.min_buckets``)."""
    to: Literal["first", "all"] = "first"
    """Who receives: the mesh's first rank (a gather), or every rank (an all-gather)."""
    delta_fraction: float | None = None
    """A delta export changing this fraction of the elements; None: a full export."""
    backend: Literal["nccl", "gloo"] = "nccl"
    """On gloo a gather of dim-0 cuts travels as point-to-point messages of each rank's own
    rows, unpadded (the export's direct path); elsewhere as one packed, padded gather."""

    def __post_init__(self) -> None:
        check_shape_options(self.to, self.bucket_bytes, self.min_buckets)
        if self.world_size % (self.replicas * self.tp_degree):
            raise ValueError(
                f"replicas {self.replicas} x tp_degree {self.tp_degree} does not divide the "
                f"world size {self.world_size}"
            )
        if self.delta_fraction is not None and not 0.0 <= self.delta_fraction <= 1.0:
            raise ValueError(f"delta_fraction must be in [0, 1], got {self.delta_fraction}")
        if self.delta_fraction is not None and self.tp_degree > 1:
            raise ValueError(
                "a delta export gathers along one mesh axis: on FSDP x TP it needs "
                "keep_axes=('tp',), which the planner does not model"
            )

    @property
    def mesh(self) -> ExportMesh:
        """The (dp_replicate, dp_shard, tp) mesh."""
        shard = self.world_size // (self.replicas * self.tp_degree)
        return ExportMesh(self.replicas, shard, self.tp_degree)


@dataclass(frozen=True, slots=True)
class RankCounts:
    """One rank's predicted ``ExportReport.counts`` (``TransferCounts``) for one export."""

    rank: int
    """Its rank in the mesh (row-major over dp_replicate, dp_shard, tp)."""
    collectives: int
    """The buckets' gathers it takes part in, and the small all-gathers every rank joins."""
    sent_bytes: int
    """What it sends in the buckets' gathers: its part, once for each member that takes it."""
    received_bytes: int
    """What the other members send into it (its own part not included), on either path: a
    packed gather's other parts (padded), or on gloo's messages the other ranks' rows."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportCost:
    """One export's predicted cost (see :func:`export_cost`)."""

    kind: Literal["full", "delta"]
    model_bytes: int
    """The exported tensors whole, in the export dtype."""
    buckets: int
    largest_bucket_bytes: int
    collectives: int
    """On the receiving rank: one per bucket and gathered axis (none for a bucket of buffers
    alone, or a delta's bucket nothing changed in), the agreement and the end, and for a delta
    the changes counted."""
    sent_bytes: int
    """The most any rank puts into the buckets' gathers (its ``counts.sent_bytes``)."""
    received_bytes: int
    """The receiving rank's ``counts.received_bytes``."""
    wire_bytes: int
    """Every rank's bucket traffic from the others summed: what crosses the network."""
    control_bytes: int
    """The small all-gathers' payload per rank (agreement, end, changes counted)."""
    receiving_peak_bytes: int
    """The receiving rank's most memory beyond its training state: its packed part, the
    gathered bucket and its unpacked tensors (about the largest bucket twice)."""
    sending_peak_bytes: int
    """Another rank's: its largest packed part (about the largest bucket's 1/W)."""
    kept_bytes: int
    """Kept between delta exports on each rank: its parts of the last one (0 for full)."""
    seconds: float | None
    """The export's communication time on the hardware's links (None: no hardware)."""
    link: str
    """Which link model priced it."""
    ranks: tuple[RankCounts, ...]
    """Every rank's counts, in rank order: what each rank's ``ExportReport.counts`` holds
    (exact for a full export; a delta's bytes are estimated from ``delta_fraction``)."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def export_cost(
    tensors: list[ExportTensor], spec: ExportSpec, hardware: Hardware | None = None
) -> ExportCost:
    """The predicted cost of one export of ``tensors`` (:func:`export_tensors` of a model).

    Args:
        tensors: the model's exported tensors, full shapes, as stored.
        spec: the mesh and the export's options.
        hardware: whose links price the time (None: no time).
    """
    mesh = spec.mesh
    buckets = plan_export_buckets(
        tensors, spec.bucket_bytes, spec.dtype, min_buckets=spec.min_buckets
    )
    gathers = _Gathers(mesh, mesh.order(tensors), spec)
    delta = spec.delta_fraction is not None
    control = [_HEAD_BYTES, _END_BYTES] + ([16 * len(buckets)] if delta else [])
    coords = list(itertools.product(*(range(size) for _, size in mesh.dims)))
    moved = {coord: [m for b in buckets for m in gathers.move(b, coord)] for coord in coords}
    ranks = tuple(
        RankCounts(
            rank,
            len(control) + sum(m.counted for m in moved[coord]),
            sum(m.sent for m in moved[coord]),
            sum(m.received for m in moved[coord]),
        )
        for rank, coord in enumerate(coords)
    )
    receiver = coords[0]
    world = spec.world_size
    seconds = sum(_seconds(hardware, mesh, m.mesh_dim, m.received) for m in moved[receiver])
    seconds += sum(_seconds(hardware, mesh, None, c * (world - 1)) for c in control)
    return ExportCost(
        kind="delta" if delta else "full",
        model_bytes=sum(t.nbytes(spec.dtype) for t in tensors),
        buckets=len(buckets),
        largest_bucket_bytes=max((b.nbytes for b in buckets), default=0),
        collectives=ranks[0].collectives,
        sent_bytes=max(r.sent_bytes for r in ranks),
        received_bytes=ranks[0].received_bytes,
        wire_bytes=sum(m.received for ms in moved.values() for m in ms),
        control_bytes=sum(control) * (world - 1),
        receiving_peak_bytes=max((gathers.receiving_peak(b, receiver) for b in buckets), default=0),
        sending_peak_bytes=max((m.part for c in coords[1:] for m in moved[c]), default=0),
        kept_bytes=sum(gathers.first_part(b, receiver) for b in buckets) if delta else 0,
        seconds=None if hardware is None else seconds,
        link=_link_name(hardware),
        ranks=ranks,
    )


@dataclass(frozen=True, slots=True)
class _Moved:
    """One gather of one bucket on one rank."""

    mesh_dim: int
    counted: bool
    """The export counts it as a collective (a packed gather in a group of one is a copy)."""
    part: int
    """Bytes this rank packs for it."""
    sent: int
    """Bytes it sends to the members that take its part (``counts.sent_bytes``)."""
    received: int
    """Bytes the other members send into it, over the wire (``counts.received_bytes``)."""
    gathered: int
    """The gathered bucket's bytes where it receives (its own part included)."""


@dataclass(frozen=True, slots=True)
class _GatherBytes:
    """One rank's share of one bucket's gather along one mesh axis."""

    padded: int
    """Its packed part: each tensor's rows padded to ``ceil(rows / parts)``, 8-byte aligned."""
    own: int
    """Its own rows alone, unpadded (what gloo's messages carry)."""
    whole: int
    """The tensors the gather joins, whole at this gather."""
    dim0: bool
    """Every tensor of the gather is cut along dim 0 (gloo sends such rows as messages)."""


class _Gathers:
    """Each bucket's gathers on each rank, as ``BucketTransfer`` runs them."""

    def __init__(self, mesh: ExportMesh, order: list[int], spec: ExportSpec) -> None:
        self.mesh = mesh
        self.order = order
        self.spec = spec
        self._bytes: dict[tuple[int, int, tuple[int, ...]], _GatherBytes | None] = {}

    def _takes_part(self, coord: tuple[int, ...], mesh_dim: int) -> bool:
        if self.spec.to == "all":
            return True
        before = self.order[: self.order.index(mesh_dim)]
        replicated = [m for m in range(len(coord)) if m not in self.order]
        return all(coord[m] == 0 for m in before + replicated)

    def share(
        self, bucket: ExportBucketModel, mesh_dim: int, coord: tuple[int, ...]
    ) -> _GatherBytes | None:
        """This rank's share of ``bucket``'s gather along ``mesh_dim`` (None: nothing cut).

        It depends on the rank's coordinates along this axis and those gathered later (they
        cut what this gather joins): cached on those.
        """
        later = tuple(coord[m] for m in self.order[self.order.index(mesh_dim) :])
        key = (bucket.index, mesh_dim, later)
        if key not in self._bytes:
            self._bytes[key] = self._share(bucket, mesh_dim, coord)
        return self._bytes[key]

    def _share(
        self, bucket: ExportBucketModel, mesh_dim: int, coord: tuple[int, ...]
    ) -> _GatherBytes | None:
        batch = [t for t in bucket.tensors if mesh_dim in self.mesh.cuts(t)]
        if not batch:
            return None
        padded = own = whole = 0
        for tensor in batch:
            cut = [m for m in self.order if m in self.mesh.cuts(tensor)]
            gather = self.mesh.gather(tensor, mesh_dim, cut[cut.index(mesh_dim) + 1 :], coord)
            itemsize = tensor.export_dtype(self.spec.dtype).itemsize
            padded += _aligned(gather.padded_numel * itemsize)
            own += math.prod(gather.piece_shape(coord[mesh_dim])) * itemsize
            whole += math.prod(gather.shape) * itemsize
        dim0 = all(self.mesh.cuts(t)[mesh_dim][0] == 0 for t in batch)
        return _GatherBytes(padded, own, whole, dim0)

    def first_part(self, bucket: ExportBucketModel, coord: tuple[int, ...]) -> int:
        """This rank's packed part of the bucket's first gather (what a delta keeps)."""
        shares = (self.share(bucket, m, coord) for m in self.order)
        return next((s.padded for s in shares if s is not None), 0)

    def move(self, bucket: ExportBucketModel, coord: tuple[int, ...]) -> list[_Moved]:
        """The gathers this rank takes part in for ``bucket``, in order."""
        if self.spec.delta_fraction is not None:
            return self._move_changes(bucket, coord, self.spec.delta_fraction)
        moved: list[_Moved] = []
        for mesh_dim in self.order:
            share = self.share(bucket, mesh_dim, coord)
            if share is None:
                continue
            if not self._takes_part(coord, mesh_dim):
                break
            size = self.mesh.dims[mesh_dim][1]
            receives = self.spec.to == "all" or coord[mesh_dim] == 0
            if self.spec.backend == "gloo" and share.dim0:
                # Messages of each rank's own rows, straight into place: to every peer
                # (to="all"), or from each other rank to the first.
                peers = self._takers(coord, mesh_dim)
                others = share.whole - share.own if receives else 0
                gathered = share.whole if receives else 0
                moved.append(_Moved(mesh_dim, True, share.own, share.own * peers, others, gathered))
            else:
                gathered = size * share.padded if receives else 0
                others = gathered - share.padded if receives else 0
                sent = share.padded * self._takers(coord, mesh_dim)
                moved.append(_Moved(mesh_dim, size > 1, share.padded, sent, others, gathered))
            if not receives:
                break
        return moved

    def _move_changes(
        self, bucket: ExportBucketModel, coord: tuple[int, ...], fraction: float
    ) -> list[_Moved]:
        """A delta: every rank's changes of its first part, gathered along the first axis.

        Each message is padded to the largest (here all alike: the changes spread evenly).
        """
        mesh_dim = self.order[0] if self.order else None
        if mesh_dim is None or not self._takes_part(coord, mesh_dim):
            return []
        part = self.first_part(bucket, coord)
        message = _delta_message(bucket, part, fraction, self.spec.dtype) if part else 0
        if not message:
            return []
        size = self.mesh.dims[mesh_dim][1]
        receives = self.spec.to == "all" or coord[mesh_dim] == 0
        gathered = size * message if receives and size > 1 else 0
        others = gathered - message if gathered else 0
        sent = message * self._takers(coord, mesh_dim)
        return [_Moved(mesh_dim, size > 1, part, sent, others, gathered)]

    def _takers(self, coord: tuple[int, ...], mesh_dim: int) -> int:
        """The other members of a gather along ``mesh_dim`` that take this rank's part."""
        size = self.mesh.dims[mesh_dim][1]
        return size - 1 if self.spec.to == "all" else int(coord[mesh_dim] != 0)

    def receiving_peak(self, bucket: ExportBucketModel, coord: tuple[int, ...]) -> int:
        """The receiving rank's bytes beyond its training state while ``bucket`` moves.

        Its packed part, the gathered buffer, and the whole tensors unpacked from it.
        """
        moved = self.move(bucket, coord)
        if not moved:
            return bucket.nbytes  # buffers alone: copies of the receiving rank's own
        if self.spec.delta_fraction is not None:
            # The gathered messages, and the positions and values decoded from them: about
            # as large again.
            return moved[0].part + 2 * moved[-1].gathered
        return moved[0].part + moved[-1].gathered + bucket.nbytes


def _aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a packed segment's 8-byte alignment."""
    return -(-nbytes // _ALIGN) * _ALIGN


def _delta_message(
    bucket: ExportBucketModel, part: int, fraction: float, dtype: torch.dtype | None
) -> int:
    """One rank's message for a bucket in the smallest of the export's three encodings.

    The part of ``part`` bytes holds ``part / itemsize`` elements, ``fraction`` of them changed
    and spread evenly: indices (int32 and the value), a bitmask (a bit per element and the
    values), or steps (``export/delta_encoding.py``'s default at small learning rates: a varint
    gap and an int8 step each, about two bytes).
    """
    itemsize = next(t.export_dtype(dtype) for t in bucket.tensors if t.sharded).itemsize
    length = part // itemsize
    count = math.ceil(fraction * length)
    if count == 0:
        return 0
    index = 4 if length < 2**31 else 8
    gap = max(1, round(length / count))
    varint = max(1, math.ceil(gap.bit_length() / 7))
    return min(
        count * (index + itemsize), -(-length // 8) + count * itemsize, 4 + count * (varint + 1)
    )


def _seconds(
    hardware: Hardware | None, mesh: ExportMesh, mesh_dim: int | None, nbytes: int
) -> float:
    """One collective's time: the ``all_gather`` curve of its axis' link, and the overhead."""
    if hardware is None:
        return 0.0
    if mesh_dim is None:  # the small all-gathers over every rank of the mesh
        axis, size = ("dp_replicate" if mesh.replicas > 1 else "dp"), mesh.replicas * mesh.shard
    else:
        axis, size = mesh.dims[mesh_dim]
    link = hardware.link(axis, size)
    return link.seconds(nbytes, "all_gather") + hardware.collective_overhead_s


def _link_name(hardware: Hardware | None) -> str:
    if hardware is None:
        return "none"
    return f"{hardware.name}: each axis' link, its all_gather curve (or rate and latency)"
