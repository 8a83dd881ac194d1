"""What a weight export is asked to do and what it did: ``ExportOptions``, ``ExportReport``.

The exporter (``exporter.py``) takes the one and returns the other; the planner
(``shardkit.tools.plan.export``) mirrors the options' defaults. Apart from the exporter so that
its module stays the export's steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from shardkit.core.export.buckets import default_layer_of
from shardkit.core.export.messages import ExportKind
from shardkit.core.export.transfer import TransferCounts

__all__ = ["ExportOptions", "ExportReport", "check_shape_options"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportOptions:
    """How a :class:`WeightExporter` exports."""

    dtype: torch.dtype | None = None
    """The receiver's dtype (floating tensors are cast to it on the shard); None: as stored."""
    bucket_bytes: int = 64 * 2**20
    """A bucket's bound, in the export dtype (a larger layer is a bucket alone); why 64 MiB:
    docs/guide/export.md, "The default bucket"."""
    min_buckets: int = 4
    """Buckets are also at most the export's bytes over this (a model under 256 MiB is still
    cut, so a sync holds a part of it, not all; 1: by ``bucket_bytes`` alone)."""
    to: Literal["first", "all"] = "first"
    """``"first"``: one rank receives (the mesh's first, or under a kept axis the first of each
    of its coordinates): a gather. ``"all"``: every rank receives (colocated engines on every
    rank): an all-gather."""
    keep_axes: tuple[str, ...] = ()
    """Mesh axes the receiver keeps sharded (``("tp",)``: a receiver with the model's TP
    degree gets its TP part, with no TP gather)."""
    layer_of: Callable[[str], str] = default_layer_of
    """A name's layer: the tensors of one layer arrive in one bucket."""
    rename: Callable[[str], str | None] | None = None
    """The receiver's name for a tensor (None leaves it out)."""
    include_tied: bool = False
    """Send a tied tensor under each of its names (default: once, under the first)."""
    first_version: int = 0
    """The number of the first export, the version it installs (a trainer restarted from a
    checkpoint continues its receivers' versions, which a receiver's ``version`` tells)."""
    bound_s: float | None = None
    """How late a rank may be before every rank raises.

    Default ``SHARDKIT_EXPORT_BOUND``, 300 s. A receiver's load of one bucket counts against it.
    """
    plain_when_faster: bool = False
    """Under ``delta``: a bucket whose delta was measured slower than moving it whole (on the
    slowest rank), or found dense, goes plain, uncompared, on every rank for a run of syncs,
    then is compared again (``delta_pace.py``). On one host a compared delta is slower than a
    full export: with this, a delta export costs about a full export's time there, and a full
    export's bytes."""

    def __post_init__(self) -> None:
        check_shape_options(self.to, self.bucket_bytes, self.min_buckets)


def check_shape_options(to: str, bucket_bytes: int, min_buckets: int) -> None:
    """Who receives and how buckets are cut, checked (here and by the planner's spec).

    Raises:
        ValueError: ``to`` is not ``"first"`` or ``"all"``, or a bound is not positive.
    """
    if to not in ("first", "all"):
        raise ValueError(f"to must be 'first' or 'all', got {to!r}")
    if bucket_bytes <= 0 or min_buckets <= 0:
        raise ValueError(
            f"bucket_bytes and min_buckets must be positive, got {bucket_bytes} and {min_buckets}"
        )


@dataclass(frozen=True, slots=True)
class ExportReport:
    """What one export did on this rank."""

    export_id: int
    kind: ExportKind
    receiving: bool
    """This rank handed the buckets to a receiver."""
    buckets: int
    counts: TransferCounts
    """Collectives and bytes on this rank."""
    seconds: float
    """The whole export on this rank."""
    handoff_seconds: float
    """Of that, in the receiver (the receiving rank)."""
    version: int
    """The version this export installed: its number, which its receivers now serve (every
    receiving rank committed it before any rank returned)."""
