"""A restart's predicted cost beside the save's: the layout record's size, a load's planning.

A checkpoint saved by ``CheckpointManager`` carries its layout record (``layout.json``), from
which each rank plans its load alone (``shardkit.core.checkpoint.local_plan``):

- **the record's bytes** are the core's own encoding (``layout_record.encode_record``) of the
  save's layout and of where each value that every rank holds lies: its writer's file, the
  offset after the items written before it (DCP's writer puts a rank's values that are not
  tensors first, then its tensors, in the plan's order) and its length, all from the item
  sizes the save's prediction computed. Exact where those are (``cost``);
- **a rank's load planning** at the same layout: the record read and checked (per byte), the
  saved geometries computed again (per mesh position), then its walk over the values and the
  saved items it reads of its own shards (per value, per item: under HSDP the items it
  wrote, its replicas reading the rest), for the rank with the most, and per value that
  replicas share, the split of its items between them (per value, and per replica of the
  set: the sharing rule and the split's numpy run over the R replicas). The unit costs are
  measured by :func:`calibrate_load_planning`, timing the core's own reader and its overlap
  search (``ChunkSources.metadata_of``, with the replicas' split under HSDP) on synthetic
  states in this process, in this thread's CPU time: the benchmark's figure
  (``benchmarks/load_plan_run.py``), and one that others' load on a shared machine moves much
  less (timed by wall-clock, the same calibration gave 20 and 54 us a split value minutes
  apart). Costs that grow with W or R are timed at two sizes and taken as slopes: at one
  size, a geometry's or a split's fixed cost counted as per position or per value had made
  FSDP grow with W about twice as fast as measured, and HSDP's split flat in R. The reads of
  the writers' indexes and of the data are not in it.
"""

from __future__ import annotations

import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.planner import WriteItemType

from shardkit.core.checkpoint.local_plan.chunk_sources import Boxes, ChunkSources
from shardkit.core.checkpoint.local_plan.chunk_writers import SaveLayout, ValueLayout
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

__all__ = [
    "LoadCosts",
    "calibrate_load_planning",
    "load_plan_seconds",
    "load_plan_terms",
    "record_bytes",
]

_CHUNKED = ("dtensor", "sharded")
_WORLD = 512
_REPLICAS = 64  # HSDP's calibration: 64 replicas of 8
_WIDE = 8  # and at 8 times the world and the replicas: the slopes in W and R


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
    per_split_replica_s: float = 0.0
    """More per such value per replica of its set (R): the sharing and the split over R."""
    per_position_s: float = 0.0
    """The saved geometries, computed again from the record, per mesh position."""


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


def load_plan_seconds(layout: SaveLayout, record: int, costs: LoadCosts) -> float:
    """A rank's load planning at the same layout (the rank with the most overlaps)."""
    return sum(load_plan_terms(layout, record, costs).values())


def load_plan_terms(layout: SaveLayout, record: int, costs: LoadCosts) -> dict[str, float]:
    """:func:`load_plan_seconds` term by term.

    Seconds for the record's bytes, the saved geometries' positions, the values, the
    replicated values' split and the overlaps.
    """
    for value in layout.values:
        if value.kind in _CHUNKED:
            layout.geometry(value)  # every distinct geometry, computed once
    positions = sum(g.ranks.size for g in layout.geometries.values())
    replicated, replicas = _replicated(layout)
    per_split = costs.per_split_value_s + replicas * costs.per_split_replica_s
    return {
        "record": record * costs.per_record_byte_s,
        "positions": positions * costs.per_position_s,
        "values": len(layout.values) * costs.per_value_s,
        "split": replicated * per_split,
        "overlaps": most_overlaps(layout) * costs.per_overlap_s,
    }


def _replicated(layout: SaveLayout) -> tuple[int, int]:
    """How many DTensors replicas hold (HSDP's), and the most replicas one has.

    Their replicas split the saved items. Of the rank at the middle (every rank of an HSDP
    mesh has replicas alike).
    """
    rank = layout.world_size // 2
    count = replicas = 0
    for value in layout.values:
        if value.kind != "dtensor" or value.mesh is None:
            continue
        line = replica_line(value.mesh, value.placements, rank)
        if line is not None:
            count, replicas = count + 1, max(replicas, line.size)
    return count, replicas


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
    """Time the core's record reader and overlap search on synthetic states.

    About 20 s on the 2-core VM beside other work (17 s before the slopes and the cold
    lookups), most of it the lookup of every value whole (W overlaps a value at W=512).

    The record of a synthetic FSDP state at W=512 is written and read (per byte); a rank's
    lookup of its own shards (one overlap a value) and of every value whole (W overlaps a
    value) give the cost per value and per overlap; the saved geometries at W and 8 W, the
    cost per position; a rank's lookup with its replicas' split under HSDP, 64 x 8 and
    512 x 8, the cost per split value and per replica. In this thread's CPU time.
    """
    layout = SaveLayout.from_values(synthetic_values(_WORLD), _WORLD)
    plain = np.zeros((sum(v.kind not in _CHUNKED for v in layout.values), 3), dtype=np.int64)
    with tempfile.TemporaryDirectory() as folder:
        size = write_record(Path(folder), layout, plain)
        per_byte = _cpu_best_of(runs, lambda: read_record(Path(folder))) / size
    own, whole = _held(layout, _WORLD // 2, False), _held(layout, _WORLD // 2, True)
    seconds, overlaps = [], []
    for held in (own, whole):
        overlaps.append(len(_sources(layout).metadata_of(held).storage_data))
        seconds.append(_cold_lookup_s(layout, held, runs))
    per_overlap = max(0.0, (seconds[1] - seconds[0]) / (overlaps[1] - overlaps[0]))
    per_value = max(0.0, seconds[0] - per_overlap * overlaps[0]) / len(layout.values)
    per_split: list[float] = []
    for replicas in (_REPLICAS, _WIDE * _REPLICAS):
        world = _WORLD * replicas // _REPLICAS
        hsdp = SaveLayout.from_values(synthetic_values(world, replicas), world)
        split_s, split_items, split_values = _split_timed(hsdp, runs)
        rest = split_s - per_value * len(hsdp.values) - per_overlap * split_items
        per_split.append(max(0.0, rest) / split_values)
    per_replica = max(0.0, (per_split[1] - per_split[0]) / ((_WIDE - 1) * _REPLICAS))
    source = (
        f"measured now on {platform.node() or 'this machine'} (torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads), CPU time: the core's read_record on a "
        f"{size:,}-byte record, ChunkSources.metadata_of for {overlaps[0]:,} and "
        f"{overlaps[1]:,} overlaps of {len(layout.values)} values at W={_WORLD}, the saved "
        f"geometries at W={_WORLD} and {_WIDE * _WORLD}, and with the replicas' split under "
        f"HSDP {_REPLICAS} and {_WIDE * _REPLICAS} x {_WORLD // _REPLICAS}; best of {runs}"
    )
    return LoadCosts(
        per_byte,
        per_value,
        per_overlap,
        source,
        per_split_value_s=max(0.0, per_split[0] - _REPLICAS * per_replica),
        per_split_replica_s=per_replica,
        per_position_s=_per_position(runs),
    )


def _per_position(runs: int) -> float:
    """The saved geometries and the sources' tables made again, per mesh position.

    Timed at W and 8 W: the slope, not a geometry's fixed cost spread over W positions.
    """
    timed, positions = [], []
    for world in (_WORLD, _WIDE * _WORLD):
        values = synthetic_values(world)

        def geometries(values: list[ValueLayout] = values, world: int = world) -> SaveLayout:
            fresh = _with_geometries(SaveLayout.from_values(values, world))
            _sources(fresh)
            return fresh

        positions.append(sum(g.ranks.size for g in geometries().geometries.values()))
        timed.append(_cpu_best_of(runs, geometries))
    return max(0.0, (timed[1] - timed[0]) / (positions[1] - positions[0]))


def _cold_lookup_s(
    layout: SaveLayout,
    held: dict[str, Boxes],
    runs: int,
    splits: Callable[[], dict[str, PieceSplit]] | None = None,
) -> float:
    """A rank's lookup timed as a load runs it, best of ``runs``, CPU.

    On the layout made again each run, as the record's reader makes it: its geometries and
    the sources' tables made before the clock starts (the per-position term), what the
    lookup then finds first (the writers' tables, the replicas' shares over R, the cut
    pieces) inside it. Timed on a layout that earlier runs had warmed, those were missed:
    about half of 8B HSDP's lookup at 16,384 ranks (cProfile), and its growth with R.
    """
    best = float("inf")
    for _ in range(runs):
        fresh = _with_geometries(layout)
        sources = _sources(fresh)
        split = None if splits is None else splits()
        started = time.thread_time()
        sources.metadata_of(held, splits=split)
        best = min(best, time.thread_time() - started)
    return best


def _with_geometries(layout: SaveLayout) -> SaveLayout:
    """``layout`` made again from its values, its geometries computed (nothing else)."""
    fresh = SaveLayout.from_values(layout.values, layout.world_size, layout.rule)
    for value in fresh.values:
        if value.kind in _CHUNKED:
            fresh.geometry(value)
    return fresh


def _cpu_best_of(runs: int, work: Callable[[], object]) -> float:
    return best_of(runs, work, clock=time.thread_time)


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

    items = len(_sources(layout).metadata_of(held, splits=splits()).storage_data)
    return _cold_lookup_s(layout, held, runs, splits), items, len(splits())
