"""One bucket's move in a TP-sliced export: the overlaps copied, sent and received.

:class:`~shardkit.core.export.tp_export.SlicedExporter` plans, per tensor, this rank's block
of it and every route from a trainer rank's block to an engine rank's window
(:class:`PlannedTensor`). For one bucket, :func:`cut_bucket` makes this rank's windows, copies
its own overlaps into them, casts the overlaps it sends (contiguous, on the sender: the wire
carries the export dtype) and names where each received overlap lands: straight in its
window where that place is contiguous, else in a buffer copied there after the wait.
:func:`exchange` then posts every send and receive as point-to-point messages, waits for
them under the export's watch (bounded, every rank's verdict on failure) and makes those
copies. No rank gathers a whole tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shardkit.core.export.axis_gathers import TensorSource
from shardkit.core.export.tp_routes import Route, volume
from shardkit.core.export.tp_slices import Box, Window
from shardkit.core.runtime.export.export_groups import ExportGroups, ExportWatch, post_pieces

__all__ = ["BucketMove", "PlannedTensor", "cut_bucket", "exchange", "part"]


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    """One tensor's windows and routes, planned once."""

    key: str
    name: str
    dtype: torch.dtype
    windows: dict[int, Window]
    routes: list[Route]
    block: Box | None
    """This rank's block (None: it sends nothing of it)."""


@dataclass(slots=True)
class BucketMove:
    """This rank's side of one bucket's move, before anything is posted."""

    windows: list[tuple[Window, torch.Tensor]] = field(default_factory=list)
    """Each tensor's window on this rank and its elements (empty: this rank only sends)."""
    sends: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """Peer (in the export's world group) -> the cast overlaps sent to it, in route order."""
    receives: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """Peer -> where its overlaps land, in route order."""
    pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """(landing buffer, its place in a window) for places that are not contiguous."""
    window_bytes: int = 0
    copied_bytes: int = 0


def cut_bucket(
    planned: list[PlannedTensor],
    sources: tuple[TensorSource, ...],
    me: int,
    peer: Callable[[int], int],
) -> BucketMove:
    """This rank's windows of one bucket, its own overlaps copied in, its sends cast.

    Args:
        planned: the bucket's tensors as planned, in the bucket's order.
        sources: the bucket's tensors (their local shards).
        me: this rank's global rank.
        peer: a global rank's rank in the export's world group.
    """
    move = BucketMove()
    for tensor, source in zip(planned, sources, strict=True):
        local = source.local()
        window = tensor.windows.get(me)  # None: this rank only sends
        into = None
        if window is not None:
            into = torch.empty(window.local_shape, dtype=tensor.dtype, device=local.device)
            move.windows.append((window, into))
            move.window_bytes += into.numel() * into.element_size()
        for route in tensor.routes:
            if route.sender == me and route.receiver == me:
                assert tensor.block is not None and window is not None and into is not None
                part(into, route.box, window.box).copy_(part(local, route.box, tensor.block))
                move.copied_bytes += volume(route.box) * into.element_size()
            elif route.receiver == me:
                assert window is not None and into is not None
                place = part(into, route.box, window.box)
                landing = place if place.is_contiguous() else torch.empty_like(place)
                if landing is not place:
                    move.pending.append((landing, place))
                move.receives.setdefault(peer(route.sender), []).append(landing)
            elif route.sender == me:
                assert tensor.block is not None
                piece = part(local, route.box, tensor.block)
                move.sends.setdefault(peer(route.receiver), []).append(
                    piece.to(tensor.dtype, memory_format=torch.contiguous_format, copy=True)
                )
    return move


def exchange(
    move: BucketMove, groups: ExportGroups | None, watch: ExportWatch | None, label: str
) -> None:
    """Post the bucket's messages, wait for them under the watch, copy the landings in place.

    Args:
        move: from :func:`cut_bucket`.
        groups: the export's groups (None only where nothing moves between ranks).
        watch: the export's watch: bounded waits, every rank's verdict on a failure.
        label: where the watch says the export is (the bucket, for a late rank's message).
    """
    if not move.sends and not move.receives:
        return
    assert groups is not None and watch is not None
    watch.post(label)
    watch.raise_if_failed()
    works = post_pieces(groups.world, sends=move.sends, receives=move.receives)
    watch.wait(works, groups.world_ranks)
    for landing, place in move.pending:
        place.copy_(landing)
    move.pending.clear()


def part(tensor: torch.Tensor, box: Box, origin: Box) -> torch.Tensor:
    """The view of ``tensor`` (which holds block ``origin`` of the full tensor) at ``box``."""
    view = tensor
    for dim, ((start, stop), (first, _)) in enumerate(zip(box, origin, strict=True)):
        view = view.narrow(dim, start - first, stop - start)
    return view
