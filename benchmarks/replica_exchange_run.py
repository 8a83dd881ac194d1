"""The exchange after a load's reads under HSDP, at thousands of ranks, in one process.

Usage: python benchmarks/replica_exchange_run.py [--worlds 1024,4096,8192,16384] [--sizes 8b,70b]
       [--before PATH]

A load planned from the layout record splits the reading of HSDP's replicated shards by the
saved items (``replica_pieces``); after the reads each replica broadcasts the boxes it read to
the others (``runtime/replica_exchange.broadcast_parts``, through ``ReplicaSet.all_parts``).
This runs that exchange for one rank of ``save_plan_run``'s Llama with AdamW under HSDP
(8 ranks a replica), its split simulated as ``load_plan_run`` simulates it, at the same
world and at W/2 (a reshard): the rank's local tensors on the ``meta`` device (their shapes
and dtypes, no bytes: a 70B rank holds tens of GB), the broadcasts on torch's fake process
group. Counted: the boxes, the broadcasts, and the copies the exchange dispatches (each an
accelerator's launch: ``copy_``, ``cat``, ``split_with_sizes_copy``, ``clone``), every
operator that launches a kernel (``OpCounter``'s launches, the broadcasts included), and the
CPU time of that dispatching. ``--before PATH`` runs the same exchange through another
``replica_exchange.py`` too (an earlier commit's), for a comparison in one run.

Prints one JSON line per point.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.load_plan_run import SimulatedIndexes, _gathered, held_boxes, replica_splits
from benchmarks.save_plan_run import state_values
from shardkit.core.checkpoint.local_plan.chunk_sources import plain_locations
from shardkit.core.checkpoint.local_plan.chunk_writers import SaveLayout
from shardkit.core.checkpoint.local_plan.layout_record import read_record, write_record
from shardkit.core.checkpoint.replica_reads import PieceParts, ReplicaSet
from shardkit.core.runtime import replica_exchange
from shardkit.tools import OpCounter

_COPIES = frozenset({"copy_", "cat", "split_with_sizes_copy", "clone", "_to_copy"})
"""The operators that copy bytes (``OpCounter``'s names without their ``aten.``)."""


def replica_sets(folder: Path, loading: SaveLayout, rank: int) -> tuple[list[ReplicaSet], int]:
    """``rank``'s replica sets with their pieces, as ``load.py`` builds them; and its boxes."""
    record = read_record(folder)
    sources = SimulatedIndexes(folder, record.layout, record.plain)
    splits = replica_splits(loading, rank)
    held = held_boxes(loading, rank)
    sources.metadata_of(held, splits=splits)  # the split: each key's units and readers
    sets: dict[int, ReplicaSet] = {}
    world = dist.group.WORLD  # the fake group's: its broadcasts touch nothing
    assert world is not None
    boxes = 0
    for value in loading.values:
        split = splits.get(value.fqn)
        if split is None or split.units is None:
            continue
        found = sets.get(id(split.replicas))
        if found is None:
            ranks = [int(r) for r in split.replicas.ranks]
            found = sets[id(split.replicas)] = ReplicaSet(
                group=world,
                ranks=ranks,
                me=split.replicas.me,
                parts=[[] for _ in ranks],
                loads=[0] * len(ranks),
            )
        box = held[value.fqn]
        assert box and value.properties is not None
        local = torch.empty(box[0][1], dtype=value.properties.dtype, device="meta")
        units = split.units
        found.pieces.append(PieceParts(local, units.offsets, units.sizes, units.readers))
        boxes += units.readers.size
    return list(sets.values()), boxes


def exchange(sets: list[ReplicaSet], module: ModuleType) -> dict[str, Any]:
    """Each set's parts broadcast through ``module.broadcast_parts``: copies, broadcasts, CPU."""
    gc.collect()
    counter = OpCounter()
    broadcasts = 0
    cpu = time.thread_time()
    with counter:
        for replica_set in sets:
            parts = replica_set.all_parts()
            _, made = module.broadcast_parts(
                parts, replica_set.ranks, replica_set.me, replica_set.group
            )
            broadcasts += made
    copies = {name: n for name, n in counter.by_op.items() if name.split(".")[-1] in _COPIES}
    return {
        "copies": sum(copies.values()),
        "by_op": copies,
        "launches": counter.launches,
        "broadcasts": broadcasts,
        "cpu_s": time.thread_time() - cpu,
    }


def _load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("replica_exchange_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def point(size: str, world: int, folder: Path, before: ModuleType | None) -> dict[str, Any]:
    saved = SaveLayout.from_values(state_values(size, world, "hsdp"), world)
    write_record(folder, saved, plain_locations(saved, _gathered(saved)))
    out: dict[str, Any] = {"size": size, "world": world, "layout": "hsdp"}
    for name, loading_world in (("same", world), ("half", world // 2)):
        loading = SaveLayout.from_values(state_values(size, loading_world, "hsdp"), loading_world)
        rank = loading_world // 2
        sets, boxes = replica_sets(folder, loading, rank)
        out[f"{name}_rank"] = rank
        out[f"{name}_boxes"] = boxes
        out[f"{name}_replicas"] = len(sets[0].ranks) if sets else 0
        out[f"{name}_now"] = exchange(sets, replica_exchange)
        if before is not None:
            out[f"{name}_before"] = exchange(sets, before)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", default="1024,4096,8192,16384")
    parser.add_argument("--sizes", default="8b,70b")
    parser.add_argument("--before", default="", help="another replica_exchange.py to compare")
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",") if w]
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # The fake group's broadcasts return at once, touching nothing (meta tensors included).
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=max(worlds))
    before = _load(args.before) if args.before else None
    with tempfile.TemporaryDirectory() as folder:
        for size in args.sizes.split(","):
            for world in worlds:
                print(json.dumps(point(size, world, Path(folder), before)), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
