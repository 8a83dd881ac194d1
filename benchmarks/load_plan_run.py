"""A load's planning at thousands of ranks, in one process: from the layout record, per rank.

Usage: python benchmarks/load_plan_run.py [--worlds 1024,4096,8192,16384] [--sizes 8b,70b]
       [--layouts fsdp,hsdp,fsdp1] [--predict]

The saved state is ``save_plan_run``'s (a Llama with AdamW under FSDP, HSDP or FSDP1's
ShardedTensors, at W ranks). For each point:

- the record (``checkpoint/local_plan/layout_record.py``): its bytes and rank 0's time to
  place the values every rank holds in what it gathered, encode and write it (every save),
  beside ``.metadata``'s entries (one per chunk);
- a loading rank's planning, at the same world and at W/2 (a reshard), for the first, the
  middle and the last rank: the record read and checked (its digest recomputed), the saved
  geometries, the overlaps of the rank's shards with the saved chunks, their writers and
  their rows in the writers' indexes (``chunk_sources.py``), as ``load.py`` runs it before
  DCP's planner. Under HSDP the rank's replicas split the reading by the saved items
  (``replica_pieces``, as ``load.py`` splits it): the rank plans only the items it reads;
  the boxes that the exchange then sends and receives are counted, their views not made
  (the exchange makes them, after the reads). The indexes are simulated (rows of the right
  count; their reading is counted in bytes, 24 a row, not timed), and so are the rank's
  shards (its boxes, which a real rank gets from its DTensors in O(1) each). No collective:
  a rank plans alone. The manager's load adds one before its reads, the verdict on the
  checks (an all-reduce of 24 bytes, ``agreement.problems_agreed``), counted in
  ``test_local_load.py``.

DCP's load planning of the same checkpoints: ``dcp_load_plan_run.py``.

``--predict`` adds the planner's prediction of a rank's plan at the same layout
(``shardkit.tools``' ``load_cost.load_plan_seconds``, its unit costs calibrated once in this
process), beside the measured CPU.

Times are wall-clock (``_s``) and this thread's CPU (``_cpu_s``): on a shared machine the
first grows with the load of the others, the second much less.

Prints one JSON line per point.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.save_plan_run import LAYOUTS, state_values
from shardkit.core.checkpoint.local_plan.chunk_sources import (
    Boxes,
    ChunkSources,
    plain_locations,
)
from shardkit.core.checkpoint.local_plan.chunk_writers import SaveLayout
from shardkit.core.checkpoint.local_plan.layout_record import read_record, write_record
from shardkit.core.checkpoint.local_plan.replica_pieces import (
    PieceSplit,
    ReplicaLoads,
    replica_line,
)


class SimulatedIndexes(ChunkSources):
    """``ChunkSources`` whose writers' indexes are made up (their sizes counted)."""

    index_bytes = 0

    def index_of(self, writer: int) -> np.ndarray:
        found = self._indexes.get(writer)
        if found is None:
            items = int((self.written_by(writer) >= 0).sum())
            found = np.zeros((items, 3), dtype=np.int64)
            found[:, 1] = np.arange(items) * 4096
            found[:, 2] = 4096
            self._indexes[writer] = found
            self.index_bytes += 48 + 24 * items
        return found


def _gathered(layout: SaveLayout) -> list[torch.Tensor]:
    """Rank 0's gathered result rows, of the ranks that write values every rank holds (the
    only ones the record reads; 4,096 bytes an item), empty for the others."""
    sources = ChunkSources(Path(), layout)
    writers = min(layout.world_size, sources.plain_ordinals.size)
    bodies = [torch.zeros(0, dtype=torch.int64)] * layout.world_size
    for writer in range(writers):
        n = int((sources.written_by(writer) >= 0).sum())
        rows = torch.zeros((n, 4), dtype=torch.int64)
        rows[:, 1] = torch.arange(n) * 4096
        rows[:, 2:] = 4096
        bodies[writer] = rows.reshape(-1)
    return bodies


def held_boxes(layout: SaveLayout, rank: int) -> dict[str, Boxes]:
    """What ``rank`` holds of each value of ``layout`` (the loading world's)."""
    held: dict[str, Boxes] = {}
    for value in layout.values:
        if value.kind not in ("dtensor", "sharded"):
            held[value.fqn] = None
            continue
        geometry = layout.geometry(value)
        position = geometry.position_of.get(rank)
        if position is None:
            held[value.fqn] = ()
            continue
        group = int(geometry.group_of[position])
        offsets = tuple(geometry.offsets[group].tolist())
        held[value.fqn] = ((offsets, tuple(geometry.sizes[group].tolist())),)
    return held


def replica_splits(layout: SaveLayout, rank: int) -> dict[str, PieceSplit]:
    """``rank``'s split of the keys its replicas read apart (HSDP), as ``load.py`` makes it.

    One set of loads per replica line, shared by the keys on it, in the state's order.
    """
    loads: dict[tuple[str, tuple[Any, ...]], ReplicaLoads] = {}
    lines: dict[tuple[str, tuple[Any, ...]], np.ndarray | None] = {}
    splits: dict[str, PieceSplit] = {}
    for value in layout.values:
        if value.kind != "dtensor" or value.mesh is None:
            continue
        key = (value.mesh_id, tuple(map(str, value.placements)))
        if key not in lines:  # a real rank finds its replicas once per mesh
            lines[key] = replica_line(value.mesh, value.placements, rank)
        line = lines[key]
        if line is None:
            continue
        found = loads.get(key)
        if found is None:
            found = loads[key] = ReplicaLoads(line, int(np.flatnonzero(line == rank)[0]))
        splits[value.fqn] = PieceSplit(found)
    return splits


@functools.cache
def _costs() -> Any:
    """The planner's load costs, timed once (``load_cost.calibrate_load_planning``)."""
    from shardkit.tools.plan.checkpoint.load_cost import calibrate_load_planning

    return calibrate_load_planning()


def predicted_plan_s(saved: SaveLayout, record_bytes: int) -> dict[str, float]:
    """The planner's prediction of a rank's load plan at ``saved``'s own layout, by term."""
    from shardkit.tools.plan.checkpoint.load_cost import load_plan_terms

    fresh = SaveLayout.from_values(saved.values, saved.world_size)  # no geometries cached
    return load_plan_terms(fresh, record_bytes, _costs())


def point(
    size: str, world: int, layout_name: str, folder: Path, predict: bool = False
) -> dict[str, Any]:
    saved = SaveLayout.from_values(state_values(size, world, layout_name), world)
    bodies = _gathered(saved)
    gc.collect()  # see below
    started, cpu = time.perf_counter(), time.thread_time()
    plain = plain_locations(saved, bodies)
    record_bytes = write_record(folder, saved, plain)
    record_s, record_cpu_s = time.perf_counter() - started, time.thread_time() - cpu
    out: dict[str, Any] = {
        "size": size,
        "world": world,
        "layout": layout_name,
        "record_bytes": record_bytes,
        "record_write_s": record_s,
        "record_write_cpu_s": record_cpu_s,
        "metadata_entries": saved.entry_count(),  # as the save benchmark and the planner count
        "planning_collectives": 0,
        "agreement_bytes": 24,  # the manager's one collective before the reads (not timed)
    }
    if predict:
        terms = predicted_plan_s(saved, record_bytes)
        out["predicted_plan_s"] = sum(terms.values())
        out["predicted_terms_s"] = terms
    for name, loading_world in (("same", world), ("half", world // 2)):
        loading = SaveLayout.from_values(
            state_values(size, loading_world, layout_name), loading_world
        )
        seconds, cpu_seconds, reads, writers, units = [], [], [], [], []
        for rank in (0, loading_world // 2, loading_world - 1):
            held = held_boxes(loading, rank)
            # A full collection over this process's layouts (millions of objects) landed in
            # some timings and not others (8B FSDP at W: 32 ms, then 299 ms for the same work).
            gc.collect()
            started, cpu = time.perf_counter(), time.thread_time()
            record = read_record(folder)
            sources = SimulatedIndexes(folder, record.layout, record.plain)
            splits = replica_splits(loading, rank)
            metadata = sources.metadata_of(held, splits=splits)
            seconds.append(time.perf_counter() - started)
            cpu_seconds.append(time.thread_time() - cpu)
            reads.append(len(metadata.storage_data))
            writers.append(len(sources._indexes))
            # The boxes the exchange sends and receives (views made there, not in the plan).
            units.append(sum(s.units.readers.size for s in splits.values() if s.units))
            out[f"{name}_index_bytes"] = max(out.get(f"{name}_index_bytes", 0), sources.index_bytes)
        out[f"{name}_plan_s_per_rank"] = max(seconds)
        out[f"{name}_plan_cpu_s_per_rank"] = max(cpu_seconds)
        out[f"{name}_items_read"] = max(reads)
        out[f"{name}_writers_read"] = max(writers)
        out[f"{name}_exchanged_boxes"] = max(units)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", default="1024,4096,8192,16384")
    parser.add_argument("--sizes", default="8b,70b")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--predict", action="store_true", help="the planner's prediction too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        for size in args.sizes.split(","):
            for layout in args.layouts.split(","):
                for world in map(int, filter(None, args.worlds.split(","))):
                    found = point(size, world, layout, Path(folder), args.predict)
                    print(json.dumps(found), flush=True)


if __name__ == "__main__":
    main()
