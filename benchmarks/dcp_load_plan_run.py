"""DCP's load planning at thousands of ranks, measured with torch's own planner, in one process.

Usage: python benchmarks/dcp_load_plan_run.py [--worlds 1024,4096,8192,16384] [--sizes 8b,70b]
       [--layouts fsdp,hsdp,fsdp1] [--all-plans-items 6000000] [--unpickle-entries 2500000]

The checkpoint is ``save_plan_run``'s state (a Llama with AdamW under FSDP, HSDP or FSDP1's
ShardedTensors) saved at W ranks and loaded at W: the planning a ``dcp.load`` does before its
first read (``state_dict_loader._load_state_dict``'s ``reduce_scatter``), step by step:

- each rank reads ``.metadata`` (``pickle.loads`` of its bytes, timed where the metadata has at
  most ``--unpickle-entries`` entries: beyond, its objects alone take several GiB here);
- each rank's local plan: ``DefaultLoadPlanner.set_up_planner`` and ``create_local_plan``
  against the whole metadata, for ranks 0 and W-1 (W-1 sweeps every chunk of each tensor),
  then pickled as ``gather_object`` pickles it (its bytes);
- rank 0's global step on every rank's plan: the W pickled plans unpickled (the gather),
  ``DefaultLoadPlanner.create_global_plan`` on the list, each result pickled (the scatter).
  Done for real where the W plans hold at most ``--all-plans-items`` read items (memory and
  time on this machine), and reported as not run beyond. Every point counts the W plans'
  read items exactly (:func:`counted_items`, equal to the built plans' where they are built);
  beyond, the plans' bytes are that count times the sampled plans' bytes per item, an
  estimate, and rank 0's time a fit (``bench_dcp_load_plan.py``), labelled as such.

The W plans of the global step are built by torch's ``create_default_local_load_plan`` (what
``create_local_plan`` returns) against a metadata that lists, per tensor, only the chunks whose
rows meet the rank's (by torch's own overlap test, so no chunk it would read is left out), the
storage indexes then set back to the whole list's positions: the same plans at O(chunks a rank
reads), checked item by item (storage index positions included) against the whole planner's at
the sampled ranks. A rank's state stands in as tensors of the global shape without storage whose
``__create_chunk_list__`` gives the rank's shards: all the planner asks of a DTensor or a
ShardedTensor (their size and chunks).

Times are wall-clock (``_s``) and this thread's CPU (``_cpu_s``): on a shared machine the first
grows with the others' load. Prints one JSON line per point.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.load_plan_run import held_boxes
from benchmarks.save_plan_run import LAYOUTS, state_values
from shardkit.core.checkpoint.local_plan.chunk_writers import SaveLayout
from shardkit.core.checkpoint.local_plan.save_results import storage_entries


class HeldShards(torch.Tensor):
    """A rank's part of one sharded value, as DCP's load planner sees a DTensor or a
    ShardedTensor: the global size, and the rank's chunks from ``__create_chunk_list__``."""

    chunks: list[ChunkStorageMetadata]

    @staticmethod
    def of(shape: tuple[int, ...], chunks: list[ChunkStorageMetadata]) -> HeldShards:
        # Expanded from one element: the global size with no storage behind it.
        held = torch.Tensor._make_subclass(HeldShards, torch.empty(1).expand(shape))
        held.chunks = chunks
        return held

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return self.chunks


def rank_state(layout: SaveLayout, rank: int) -> dict[str, Any]:
    """``rank``'s flat state as the loading world's rank holds it."""
    held = held_boxes(layout, rank)
    state: dict[str, Any] = {}
    for value in layout.values:
        if value.kind == "bytes":
            state[value.fqn] = 0.0  # a param group's value: read whole (BytesStorageMetadata)
        elif value.kind == "tensor":
            state[value.fqn] = torch.zeros(value.shape)
        else:
            boxes = held[value.fqn] or ()
            chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes]
            state[value.fqn] = HeldShards.of(value.shape, chunks)
    return state


@dataclasses.dataclass(slots=True)
class RowIndex:
    """One listed chunk list's rows (dim 0) as arrays, to find the chunks a box meets."""

    starts: np.ndarray
    ends: np.ndarray

    @staticmethod
    def of(listed: list[ChunkStorageMetadata]) -> RowIndex:
        starts = np.array([c.offsets[0] for c in listed], dtype=np.int64)
        sizes = np.array([c.sizes[0] for c in listed], dtype=np.int64)
        return RowIndex(starts, starts + sizes)

    def meeting(self, start: int, end: int) -> np.ndarray:
        """Positions of the chunks whose rows torch's overlap test does not rule out: its
        test (``_check_shard_metadata_pair_overlap``) on dim 0, negated."""
        return np.flatnonzero(~((start >= self.ends) | (self.starts >= end)))


class PrunedPlans:
    """Every rank's local plan by torch's ``create_default_local_load_plan``, against only the
    chunks a rank's rows meet (storage indexes set back to the whole list's positions)."""

    def __init__(self, layout: SaveLayout, metadata: Metadata) -> None:
        self.layout = layout
        self.metadata = metadata
        self.rows: dict[int, RowIndex] = {}

    def plan(self, rank: int) -> LoadPlan:
        state = rank_state(self.layout, rank)
        pruned: dict[str, Any] = {}
        positions: dict[str, np.ndarray] = {}
        for fqn, entry in self.metadata.state_dict_metadata.items():
            chunks = (
                state[fqn].__create_chunk_list__() if isinstance(state[fqn], HeldShards) else []
            )
            if not isinstance(entry, TensorStorageMetadata) or not chunks or not entry.size:
                pruned[fqn] = entry
                continue
            index = self.rows.get(id(entry.chunks))
            if index is None:
                index = self.rows[id(entry.chunks)] = RowIndex.of(entry.chunks)
            met = np.unique(
                np.concatenate(
                    [index.meeting(c.offsets[0], c.offsets[0] + c.sizes[0]) for c in chunks]
                )
            )
            positions[fqn] = met
            listed = [entry.chunks[i] for i in met.tolist()]
            pruned[fqn] = TensorStorageMetadata(entry.properties, entry.size, listed)
        plan = create_default_local_load_plan(state, Metadata(state_dict_metadata=pruned))
        return LoadPlan([_whole_index(item, positions) for item in plan.items])


def counted_items(layout: SaveLayout, metadata: Metadata) -> int:
    """The read items of every rank's plan at the same W, counted without building them.

    Per sharded value: each loading chunk's count of the saved chunks its rows meet (torch's
    test on dim 0; the other dims are whole here), times the ranks that hold it; one item a
    rank for every value each rank reads whole.
    """
    total, per_geometry = 0, {}
    for value in layout.values:
        if value.kind not in ("dtensor", "sharded"):
            total += layout.world_size
            continue
        entry = metadata.state_dict_metadata[value.fqn]
        assert isinstance(entry, TensorStorageMetadata)
        geometry = layout.geometry(value)
        key = (id(geometry), id(entry.chunks))
        if key not in per_geometry:
            saved = RowIndex.of(entry.chunks)
            # Saved chunks listed in row order: those meeting [start, end) are one run.
            assert np.all(np.diff(saved.starts) >= 0) and np.all(np.diff(saved.ends) >= 0)
            starts = geometry.offsets[:, 0]
            ends = starts + geometry.sizes[:, 0]
            first = np.searchsorted(saved.ends, starts, side="right")
            past = np.searchsorted(saved.starts, ends, side="left")
            per_geometry[key] = int((np.maximum(past - first, 0) * geometry.counts).sum())
        total += per_geometry[key]
    return total


def _whole_index(item: ReadItem, positions: dict[str, np.ndarray]) -> ReadItem:
    where = positions.get(item.storage_index.fqn)
    if where is None or item.storage_index.index is None:
        return item
    storage = item.storage_index
    whole = MetadataIndex(storage.fqn, storage.offset, int(where[storage.index]))
    return dataclasses.replace(item, storage_index=whole)


def _same_plans(a: LoadPlan, b: LoadPlan) -> bool:
    """Equal item by item, storage and destination index positions included (which
    ``MetadataIndex``'s equality leaves out)."""
    return len(a.items) == len(b.items) and all(
        x == y
        and x.storage_index.index == y.storage_index.index
        and x.dest_index.index == y.dest_index.index
        for x, y in zip(a.items, b.items, strict=True)
    )


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def point(
    size: str, world: int, layout_name: str, all_plans_items: int, unpickle_entries: int
) -> dict[str, Any]:
    layout = SaveLayout.from_values(state_values(size, world, layout_name), world)
    metadata = Metadata(state_dict_metadata=layout.state_dict_metadata())
    out: dict[str, Any] = {
        "engine": "torch",
        "size": size,
        "world": world,
        "layout": layout_name,
        "metadata_entries": layout.entry_count(),
        "planning_collectives": 2,  # the plans gathered to rank 0, the global plan scattered
    }
    if out["metadata_entries"] <= unpickle_entries:
        out.update(_unpickle(layout))
    pruned = PrunedPlans(layout, metadata)
    sampled: list[LoadPlan] = []
    for rank, name in ((0, "first"), (world - 1, "last")):
        planner = DefaultLoadPlanner()
        state = rank_state(layout, rank)
        started, cpu = time.perf_counter(), time.thread_time()
        planner.set_up_planner(state, metadata, is_coordinator=rank == 0)
        plan = planner.create_local_plan()
        wall_s, cpu_s = time.perf_counter() - started, time.thread_time() - cpu
        assert _same_plans(plan, pruned.plan(rank)), f"pruned plan differs at rank {rank}"
        sampled.append(plan)
        out[f"local_plan_s_{name}_rank"] = wall_s
        out[f"local_plan_cpu_s_{name}_rank"] = cpu_s
    plan_bytes = [len(pickle.dumps(p)) for p in sampled]
    items = [len(p.items) for p in sampled]
    counted = counted_items(layout, metadata)
    out["plan_items_per_rank"] = max(items)
    out["plan_bytes_per_rank"] = max(plan_bytes)
    out["plans_items_counted"] = counted
    # Beyond the points where every plan is pickled: the sampled plans' bytes per item.
    out["plans_gathered_bytes_estimated"] = counted * sum(plan_bytes) // sum(items)
    if counted <= all_plans_items:
        out.update(_global_step(pruned, world))
    return out


def _unpickle(layout: SaveLayout) -> dict[str, Any]:
    """Every rank's read of ``.metadata``: its pickle unpickled (file offsets made up)."""
    bodies = []
    for count in layout.expected_items():
        rows = torch.zeros((count, 4), dtype=torch.int64)
        rows[:, 1], rows[:, 2:] = torch.arange(count) * 4096, 4096
        bodies.append(rows.reshape(-1))
    whole = Metadata(
        state_dict_metadata=layout.state_dict_metadata(),
        storage_data=storage_entries(layout, bodies),
    )
    pickled = pickle.dumps(whole)
    del whole, bodies
    started, cpu = time.perf_counter(), time.thread_time()
    pickle.loads(pickled)
    return {
        "metadata_bytes": len(pickled),
        "unpickle_s_per_rank": time.perf_counter() - started,
        "unpickle_cpu_s_per_rank": time.thread_time() - cpu,
    }


def _global_step(pruned: PrunedPlans, world: int) -> dict[str, Any]:
    """Rank 0's side of DCP's plan exchange, on every rank's real plan."""
    sent = [pickle.dumps(pruned.plan(rank)) for rank in range(world)]  # each rank's gather send
    before = _rss()
    started, cpu = time.perf_counter(), time.thread_time()
    gathered = [pickle.loads(b) for b in sent]
    unpickle_s, unpickle_cpu_s = time.perf_counter() - started, time.thread_time() - cpu
    held_bytes = _rss() - before
    started, cpu = time.perf_counter(), time.thread_time()
    planned = DefaultLoadPlanner().create_global_plan(gathered)
    scattered = [pickle.dumps(p) for p in planned]
    rest_s, rest_cpu_s = time.perf_counter() - started, time.thread_time() - cpu
    return {
        "plans_items": sum(len(p.items) for p in gathered),
        "plans_gathered_bytes": sum(map(len, sent)),
        "plans_scattered_bytes": sum(map(len, scattered)),
        "rank0_plans_held_bytes": held_bytes,
        "rank0_global_s": unpickle_s + rest_s,
        "rank0_global_cpu_s": unpickle_cpu_s + rest_cpu_s,
        "rank0_unpickle_cpu_s": unpickle_cpu_s,
    }


def fit_rank0(records: list[dict[str, Any]]) -> dict[str, float]:
    """Rank 0's CPU and the memory of the plans it holds, per read item, over the points
    where its global step ran (a least-squares line through zero: it handles each plan on
    its own, and ``create_global_plan`` returns the list as it came)."""
    measured = [r for r in records if "plans_items" in r]
    items = np.array([r["plans_items"] for r in measured], dtype=np.float64)
    cpu = np.array([r["rank0_global_cpu_s"] for r in measured])
    held = np.array([r["rank0_plans_held_bytes"] for r in measured], dtype=np.float64)
    squares = float(items @ items)
    return {
        "cpu_s_per_item": float(items @ cpu) / squares,
        "bytes_per_item": float(items @ held) / squares,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", default="1024,4096,8192,16384")
    parser.add_argument("--sizes", default="8b,70b")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--all-plans-items", type=int, default=6_000_000)
    parser.add_argument("--unpickle-entries", type=int, default=2_500_000)
    args = parser.parse_args()
    for size in args.sizes.split(","):
        for layout in args.layouts.split(","):
            for world in map(int, args.worlds.split(",")):
                record = point(size, world, layout, args.all_plans_items, args.unpickle_entries)
                print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
