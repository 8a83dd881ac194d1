"""A restart's predicted cost beside the save's: the layout record's size, a load's planning.

A checkpoint saved by ``CheckpointManager`` carries its layout record (``layout.json``), from
which each rank plans its load alone (``shardkit.core.checkpoint.local_plan``):

- **the record's bytes** are the core's own encoding (``layout_record.encode_record``) of the
  save's layout and of where each value that every rank holds lies: its writer's file, the
  offset after the items written before it (DCP's writer puts a rank's values that are not
  tensors first, then its tensors, in the plan's order) and its length, all from the item
  sizes the save's prediction computed. Exact where those are (``cost``);
- **a rank's load planning** at the same layout: the record read and checked (per byte), the
  saved geometries computed again (per mesh position, the save's unit cost), then its walk
  over the values and the saved items it reads of its own shards (per value, per item: under
  HSDP the items it wrote, its replicas reading the rest), for the rank with the most, and
  per value that replicas share, the split of its items between them. The unit costs are
  measured by :func:`calibrate_load_planning`, timing the core's own reader and its overlap
  search (``ChunkSources.metadata_of``, with the replicas' split under HSDP) on synthetic
  states in this process. The reads of the writers' indexes and of the data are not in it.
"""

from __future__ import annotations

import platform
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.planner import WriteItemType

from shardkit.core.checkpoint.local_plan.chunk_sources import Boxes, ChunkSources
from shardkit.core.checkpoint.local_plan.chunk_writers import SaveLayout
from shardkit.core.checkpoint.local_plan.layout_record import (
    encode_record,
    read_record,
    write_record,
)
from shardkit.core.checkpoint.local_plan.replica_pieces import (
    PieceSplit,
    ReplicaLoads,
    replica_line,
)
from shardkit.tools.plan.checkpoint.timing import best_of, synthetic_values

__all__ = ["LoadCosts", "calibrate_load_planning", "load_plan_seconds", "record_bytes"]

_CHUNKED = ("dtensor", "sharded")
_WORLD = 512
_REPLICAS = 64  # HSDP's calibration: 64 replicas of 8


@dataclass(frozen=True, slots=True)
class LoadCosts:
    """Seconds per unit of a load's planning from the record, on the machine that measured."""

    per_record_byte_s: float
    per_value_s: float
    per_overlap_s: float
    source: str
    """What was timed, where (as ``timing.SaveCosts.source``)."""
    per_split_value_s: float = 0.0
    """More per value whose shards several replicas hold: the split of its saved items."""


def record_bytes(
    layout: SaveLayout, item_sizes: dict[int, list[int]], plain_files: dict[str, int]
) -> int:
    """The record's bytes for ``layout`` (0: a placement it cannot describe).

    ``item_sizes``: per chunked value's ordinal, each item's bytes in its file;
    ``plain_files``: per value every rank holds, its item's bytes.
    """
    ordinal_of = {v.fqn: o for o, v in enumerate(layout.values)}
    plain = [o for o, v in enumerate(layout.values) if v.kind not in _CHUNKED]
    places = np.zeros((len(plain), 3), dtype=np.int64)
    turn_of = {o: t for t, o in enumerate(plain)}
    for writer in range(min(layout.world_size, len(plain))):
        items = layout.items_of(writer)
        # DCP's writer: a rank's values that are not tensors first, then its tensors.
        ordered = [i for i in items if i.type == WriteItemType.BYTE_IO]
        ordered += [i for i in items if i.type != WriteItemType.BYTE_IO]
        offset = 0
        for item in ordered:
            ordinal = ordinal_of[item.index.fqn]
            if ordinal in turn_of:
                length = plain_files[item.index.fqn]
                places[turn_of[ordinal]] = (0, offset, length)
            else:
                assert item.index.index is not None
                length = item_sizes[ordinal][item.index.index]
            offset += length
    encoded = encode_record(layout, places)
    return 0 if encoded is None else len(encoded)


def most_overlaps(layout: SaveLayout) -> int:
    """The most saved items one rank plans, loading at the same layout.

    Every value that every rank holds, and of its shards the items it wrote: under HSDP the
    replicas of a shard split its saved items (``local_plan.replica_pieces``), each planning
    only those it wrote, not every piece its shard meets; without replicas a rank wrote all
    of its shard's items.
    """
    written = np.zeros(layout.world_size, dtype=np.int64)
    plain = 0
    for ordinal, value in enumerate(layout.values):
        if value.kind not in _CHUNKED:
            plain += 1  # read whole by every rank
            continue
        pieces = layout.cut_pieces(ordinal)
        written += np.bincount(layout.writers(ordinal, pieces), minlength=layout.world_size)
    return plain + int(written.max())


def load_plan_seconds(
    layout: SaveLayout, record: int, costs: LoadCosts, per_position_s: float = 0.0
) -> float:
    """A rank's load planning at the same layout (the rank with the most overlaps).

    ``per_position_s``: a geometry's cost per mesh position (``timing.SaveCosts``): the
    saved layout, read from the record, computes its geometries again.
    """
    for value in layout.values:
        if value.kind in _CHUNKED:
            layout.geometry(value)  # every distinct geometry, computed once
    positions = sum(g.ranks.size for g in layout.geometries.values())
    return (
        record * costs.per_record_byte_s
        + positions * per_position_s
        + len(layout.values) * costs.per_value_s
        + _replicated(layout) * costs.per_split_value_s
        + most_overlaps(layout) * costs.per_overlap_s
    )


def _replicated(layout: SaveLayout) -> int:
    """The DTensors that replicas hold (HSDP's): their replicas split the saved items.

    Of the rank at the middle (every rank of an HSDP mesh has replicas alike).
    """
    rank = layout.world_size // 2
    return sum(
        1
        for value in layout.values
        if value.kind == "dtensor"
        and value.mesh is not None
        and replica_line(value.mesh, value.placements, rank) is not None
    )


class _NoIndexes(ChunkSources):
    """The core's lookup with the writers' indexes made up (their reading is I/O, not timed).

    The places of the values every rank holds come from the record, as at a real load
    (:func:`_sources`), not from their writers' indexes.
    """

    def index_of(self, writer: int) -> np.ndarray:
        items = int((self.written_by(writer) >= 0).sum())
        rows = np.zeros((items, 3), dtype=np.int64)
        rows[:, 2] = 4096
        return rows


def _sources(layout: SaveLayout) -> _NoIndexes:
    """:class:`_NoIndexes` over ``layout``, with the record's places of the plain values."""
    plain = sum(value.kind not in _CHUNKED for value in layout.values)
    return _NoIndexes(Path(), layout, np.zeros((plain, 3), dtype=np.int64))


def _held(layout: SaveLayout, rank: int, whole: bool) -> dict[str, Boxes]:
    """Rank ``rank``'s own chunk of each value, or (``whole``) every value whole."""
    held: dict[str, Boxes] = {}
    for value in layout.values:
        if whole or value.kind not in _CHUNKED:
            held[value.fqn] = None
            continue
        geometry = layout.geometry(value)
        chunk = int(geometry.group_of[geometry.position_of[rank]])
        box = (tuple(geometry.offsets[chunk].tolist()), tuple(geometry.sizes[chunk].tolist()))
        held[value.fqn] = (box,)
    return held


def calibrate_load_planning(runs: int = 3) -> LoadCosts:
    """Time the core's record reader and overlap search on a synthetic state (about a second).

    The record of a synthetic FSDP state at W=512 is written and read (per byte); a rank's
    lookup of its own shards (one overlap a value) and of every value whole (W overlaps a
    value) give the cost per value and per overlap.
    """
    layout = SaveLayout.from_values(synthetic_values(_WORLD), _WORLD)
    plain = np.zeros((sum(v.kind not in _CHUNKED for v in layout.values), 3), dtype=np.int64)
    with tempfile.TemporaryDirectory() as folder:
        size = write_record(Path(folder), layout, plain)
        per_byte = best_of(runs, lambda: read_record(Path(folder))) / size
    own, whole = _held(layout, _WORLD // 2, False), _held(layout, _WORLD // 2, True)
    seconds, overlaps = [], []
    for held in (own, whole):
        found = _sources(layout).metadata_of(held)  # warm: geometries, writers' rows
        overlaps.append(len(found.storage_data))
        seconds.append(best_of(runs, lambda held=held: _sources(layout).metadata_of(held)))
    per_overlap = max(0.0, (seconds[1] - seconds[0]) / (overlaps[1] - overlaps[0]))
    per_value = max(0.0, seconds[0] - per_overlap * overlaps[0]) / len(layout.values)
    hsdp = SaveLayout.from_values(synthetic_values(_WORLD, _REPLICAS), _WORLD)
    split_s, split_items, split_values = _split_timed(hsdp, runs)
    rest = split_s - per_value * len(hsdp.values) - per_overlap * split_items
    per_split = max(0.0, rest) / split_values
    source = (
        f"measured now on {platform.node() or 'this machine'} (torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads): the core's read_record on a {size:,}-byte record "
        f"and ChunkSources.metadata_of for {overlaps[0]:,} and {overlaps[1]:,} overlaps of "
        f"{len(layout.values)} values at W={_WORLD}, and with the replicas' split of "
        f"{split_values} values under HSDP {_REPLICAS} x {_WORLD // _REPLICAS}; best of {runs}"
    )
    return LoadCosts(per_byte, per_value, per_overlap, source, per_split)


def _split_timed(layout: SaveLayout, runs: int) -> tuple[float, int, int]:
    """A rank's lookup with its replicas' split (as ``local_plan.load``): seconds, items, values.

    Of the rank at the middle of an HSDP ``layout``, at the same layout.
    """
    rank = layout.world_size // 2
    held = _held(layout, rank, False)

    def splits() -> dict[str, PieceSplit]:
        found: dict[str, PieceSplit] = {}
        lines: dict[str, ReplicaLoads] = {}
        for value in layout.values:
            if value.kind != "dtensor" or value.mesh is None:
                continue
            loads = lines.get(value.mesh_id)
            if loads is None:
                line = replica_line(value.mesh, value.placements, rank)
                assert line is not None, "an HSDP mesh"
                loads = lines[value.mesh_id] = ReplicaLoads(line, int(np.argmax(line == rank)))
            found[value.fqn] = PieceSplit(loads)
        return found

    warm = _sources(layout).metadata_of(held, splits=splits())
    items = len(warm.storage_data)
    split_values = len(splits())
    seconds = best_of(runs, lambda: _sources(layout).metadata_of(held, splits=splits()))
    return seconds, items, split_values
