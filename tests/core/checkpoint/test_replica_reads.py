"""HSDP loads that read each unique byte once (``checkpoint/replica_reads.py``), counted per rank.

At W=4 on a 2x2 mesh (two replicas of FSDP over two ranks; and at W=2, two replicas of one
rank), a checkpoint saved as HSDP, and one saved as plain FSDP over every rank (a reshard),
is loaded through ``CheckpointManager.load`` and, as the oracle, through DCP's own load
planning with the same counting reader. The loaded state must equal the saved one exactly;
the two replicas of a shard must together read what one of them reads alone under DCP's
planning (plus the values every rank reads), each about half of it, and receive from each
other the rest of their local tensors. The manager plans from the layout record, where the
replicas split the saved items rather than the tensors (``local_plan/replica_pieces.py``): at
the same layout each rank reads back exactly the items it wrote.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from tests.core.checkpoint.checkpoint_app import build_app, state_of, train_app


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def _load_both_ways(rank: int, world_size: int, root: str, saved_replicas: int) -> dict[str, Any]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from shardkit.core import CheckpointManager
    from shardkit.core.checkpoint.dcp_reading import SafeLoadPlanner
    from shardkit.core.checkpoint.replica_reads import ReadCounts, ReplicaSplitReader

    app = build_app(world_size, replicas=saved_replicas)
    train_app(app, 1, rank, world_size)
    saved = state_of(app)
    manager = CheckpointManager(root)
    checkpoint = manager.save(1, {"app": app})

    split = build_app(world_size, replicas=2, seed=7)
    assert not _same(state_of(split), saved)
    manager.load({"app": split})
    plain = build_app(world_size, replicas=2, seed=7)
    plain_counts = ReadCounts()
    reader = ReplicaSplitReader(checkpoint, counts=plain_counts)
    dcp_load(
        {"app": plain}, checkpoint_id=checkpoint, storage_reader=reader, planner=SafeLoadPlanner()
    )
    flat, _ = flatten_state_dict({"app": split.state_dict()})
    local = [v.to_local() for v in flat.values() if isinstance(v, DTensor)]
    return {
        "split_is_saved": _same(state_of(split), saved),
        "plain_is_saved": _same(state_of(plain), saved),
        "split": dataclasses.asdict(manager.last_load_reads),
        "plain": dataclasses.asdict(plain_counts),
        "dtensor_keys": sorted(k for k, v in flat.items() if isinstance(v, DTensor)),
        "local_bytes": sum(t.numel() * t.element_size() for t in local),
        "largest_local": max(t.numel() * t.element_size() for t in local),
        "checkpoint": str(checkpoint),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_hsdp_replicas_read_each_unique_byte_once(world: int, tmp_path: Path) -> None:
    """Two replicas: of one rank each at W=2, of two ranks each at W=4."""
    for saved_replicas in (2, 1):  # saved as HSDP 2xN, then as FSDP over W (resharded)
        root = tmp_path / f"saved_{saved_replicas}"
        results = run_on_ranks(
            world, _load_both_ways, root=str(root), saved_replicas=saved_replicas
        )
        case = f"saved with {saved_replicas} replica(s)"
        assert all(r["split_is_saved"] and r["plain_is_saved"] for r in results), case
        metadata = FileSystemReader(results[0]["checkpoint"]).read_metadata()
        sharded = set(results[0]["dtensor_keys"])
        lengths = [(i.fqn in sharded, info.length) for i, info in metadata.storage_data.items()]
        every_rank_reads = sum(length for is_sharded, length in lengths if not is_sharded)
        for a in range(world // 2):  # a shard's two replicas: mesh [[0, .., W/2 - 1], [W/2, ..]]
            b = a + world // 2
            split_a, split_b = results[a]["split"], results[b]["split"]
            plain_a, plain_b = results[a]["plain"], results[b]["plain"]
            assert plain_a["bytes_read"] == plain_b["bytes_read"], case
            together = split_a["bytes_read"] + split_b["bytes_read"]
            assert together == plain_a["bytes_read"] + every_rank_reads, (case, a, b)
            for split, plain in ((split_a, plain_a), (split_b, plain_b)):
                assert split["bytes_read"] < 0.75 * plain["bytes_read"], (case, split, plain)
                assert plain["bytes_received"] == plain["broadcasts"] == 0
                assert split["broadcasts"] >= 2
            # What each received is the other's part: together, a whole local state.
            received = split_a["bytes_received"] + split_b["bytes_received"]
            assert received == results[a]["local_bytes"], (case, a, b)
            balance = abs(split_a["bytes_received"] - split_b["bytes_received"])
            assert balance <= results[a]["largest_local"], (case, split_a, split_b)
        if saved_replicas == 2:  # the same layout: every stored byte read once in all
            sharded_bytes = sum(length for is_sharded, length in lengths if is_sharded)
            total = sum(r["split"]["bytes_read"] for r in results)
            assert total == sharded_bytes + world * every_rank_reads
            for rank, result in enumerate(results):  # each rank, what it wrote: its own files
                wrote = sum(
                    info.length
                    for index, info in metadata.storage_data.items()
                    if index.fqn in sharded and info.relative_path.startswith(f"__{rank}_")
                )
                assert result["split"]["bytes_read"] == wrote + every_rank_reads, rank
                assert result["split"]["tensors_skipped"] > 0  # small tensors: one writer
