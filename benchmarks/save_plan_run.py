"""A save's planning at thousands of ranks, in one process: shardkit's local plan beside DCP's.

Usage: python benchmarks/save_plan_run.py [--torch-worlds 64,256] [--worlds 1024,4096,8192]
       [--sizes 8b,70b] [--layouts fsdp,hsdp,fsdp1]
       python benchmarks/save_plan_run.py --fsdp1-metadata 8192 [--sizes 8b]

The state is a Llama's under FSDP (``Shard(0)`` on a 1-D mesh of W ranks), HSDP (8 ranks a
replica: ``(Replicate(), Shard(0))`` on a (W/8, 8) mesh) or FSDP1's SHARDED_STATE_DICT
without a device mesh (``fsdp1``: ShardedTensors of ``torch.chunk``'s dim-0 cut over the W
ranks, one shard a rank, none on the ranks past the last chunk) with AdamW's state, flattened
as ``get_state_dict`` + DCP's planner flatten it: every parameter, its ``exp_avg`` and
``exp_avg_sq`` (sharded), its ``step`` (a plain tensor) and the param group's values (the
keys of torch's own AdamW's group, so that the counts equal ``shardkit-plan --checkpoint``'s).

- shardkit (``checkpoint/local_plan/chunk_writers.py``): what a rank computes alone. Its wait
  at a save is the layout's digest (every save: it says whether the layout changed) and its
  own items (from the cached layout). The first save of a layout also computes the
  geometries. Rank 0 builds the metadata (once per layout) and, after the write, checks every
  rank's results against the layout; the metadata's bytes are its pickle's, as DCP writes
  ``.metadata``. The bytes each rank writes (min, median, max, mean), by the layout's rule
  (``replica_shares``: by bytes, large chunks in row pieces) and by the earlier one (whole
  chunks, the replicas taking turns tensor by tensor), and ``.metadata``'s entries
  (``SaveLayout.entry_count``, what the planner reports).
- ``--fsdp1-metadata W``: FSDP1's ShardedTensors of W shards (real ones, on a fake process
  group of W ranks in this process), and the time a rank takes to read their shards into the
  layout at a save: without the cache (every save before it), at the first save of a layout
  and at a later one (``sharded_tensor_chunks.ShardedParts``).
- torch: the W ranks' local plans built as DCP builds them (each rank's DTensor chunks, every
  plain tensor and value on every rank), then ``DefaultSavePlanner.create_global_plan`` timed
  as rank 0 runs it, and the plans' pickled bytes (what DCP gathers to rank 0). Where both
  run, their metadata are compared (every tensor's chunks as sets).

Prints one JSON line per point.
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import Replicate, Shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardkit.core.checkpoint.local_plan.chunk_writers import SaveLayout, ValueLayout, mesh_key
from shardkit.core.checkpoint.local_plan.sharded_tensor_chunks import Shards
from shardkit.tools.plan.checkpoint.timing import ByteCounter

LLAMAS = {
    "8b": {"dim": 4096, "layers": 32, "ffn": 14336, "kv": 1024, "vocab": 128256},
    "70b": {"dim": 8192, "layers": 80, "ffn": 28672, "kv": 1024, "vocab": 128256},
}
REPLICA = 8  # ranks a replica under HSDP
PROPS = TensorProperties(dtype=torch.float32)


def parameters(size: str) -> list[tuple[str, tuple[int, ...]]]:
    """A Llama's parameters, torchtitan's names and shapes."""
    c = LLAMAS[size]
    dim, ffn, kv = c["dim"], c["ffn"], c["kv"]
    out: list[tuple[str, tuple[int, ...]]] = [("tok_embeddings.weight", (c["vocab"], dim))]
    for i in range(c["layers"]):
        p = f"layers.{i}"
        out += [
            (f"{p}.attention.wq.weight", (dim, dim)),
            (f"{p}.attention.wk.weight", (kv, dim)),
            (f"{p}.attention.wv.weight", (kv, dim)),
            (f"{p}.attention.wo.weight", (dim, dim)),
            (f"{p}.feed_forward.w1.weight", (ffn, dim)),
            (f"{p}.feed_forward.w2.weight", (dim, ffn)),
            (f"{p}.feed_forward.w3.weight", (ffn, dim)),
            (f"{p}.attention_norm.weight", (dim,)),
            (f"{p}.ffn_norm.weight", (dim,)),
        ]
    return [*out, ("norm.weight", (dim,)), ("output.weight", (c["vocab"], dim))]


LAYOUTS = ("fsdp", "hsdp", "fsdp1")


def state_values(size: str, world: int, layout: str) -> list[ValueLayout]:
    """The flat state's values, as every rank describes them."""
    mesh: np.ndarray = np.arange(world, dtype=np.int64)
    placements: tuple[Any, ...] = (Shard(0),)
    if layout == "hsdp":
        mesh = mesh.reshape(world // REPLICA, REPLICA)
        placements = (Replicate(), Shard(0))
    key = mesh_key(mesh)
    params = parameters(size)
    # FSDP1's shards depend on the shape alone: built once per shape here. A real rank reads
    # each ShardedTensor's own metadata (``sharded_tensor_parts``: a walk over its W shards,
    # about 20 ms a tensor at W = 8,192), which this figure leaves out.
    fsdp1_shards: dict[tuple[int, ...], tuple[np.ndarray, tuple[Any, ...], str]] = {}

    def dtensor(fqn: str, shape: tuple[int, ...]) -> ValueLayout:
        if layout != "fsdp1":
            return ValueLayout(fqn, "dtensor", shape, PROPS, mesh, placements, key)
        found = fsdp1_shards.get(shape)
        if found is None:
            ranks, shards = _fsdp1_shards(shape, world)
            found = fsdp1_shards[shape] = (ranks, shards, mesh_key(ranks))
        return ValueLayout(fqn, "sharded", shape, PROPS, *found)

    values = [dtensor(f"model.{n}", s) for n, s in params]
    for n, s in params:
        values.append(ValueLayout(f"optim.state.{n}.step", "tensor", (), PROPS))
        values += [dtensor(f"optim.state.{n}.{k}", s) for k in ("exp_avg", "exp_avg_sq")]
    values += [ValueLayout(f"optim.param_groups.{k}", "bytes") for k in adamw_group_keys()]
    return values


def adamw_group_keys() -> list[str]:
    """The keys of torch's AdamW's param group (each a value of the flat state)."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    return sorted(optimizer.state_dict()["param_groups"][0])


def bytes_per_rank(layout: SaveLayout) -> dict[str, float]:
    """Min, median, max and mean of the tensor bytes each rank writes by ``layout``'s rule."""
    data = np.zeros(layout.world_size, dtype=np.int64)
    for ordinal, value in enumerate(layout.values):
        if value.kind in ("dtensor", "sharded"):
            assert value.properties is not None
            pieces, _ = layout.pieces(ordinal)
            itemsize = value.properties.dtype.itemsize
            np.add.at(data, layout.writers(ordinal, pieces), pieces.sizes.prod(axis=1) * itemsize)
    return {
        "min": int(data.min()),
        "median": float(np.median(data)),
        "max": int(data.max()),
        "mean": float(data.mean()),
    }


def _fsdp1_shards(shape: tuple[int, ...], world: int) -> tuple[np.ndarray, tuple[Any, ...]]:
    """FSDP1's ShardedTensor of ``shape`` at ``world`` ranks, as ``sharded_tensor_chunks``
    describes one: each shard's rank, and its :class:`Shards`."""
    rows = shape[0]
    step = -(-rows // world)  # torch.chunk: ceil(rows / world) a chunk, the last one short
    starts = np.arange(0, rows, step, dtype=np.int64)
    offsets = np.zeros((len(starts), len(shape)), dtype=np.int64)
    offsets[:, 0] = starts
    sizes = np.tile(np.array(shape, dtype=np.int64), (len(starts), 1))
    sizes[:, 0] = np.minimum(step, rows - starts)
    return np.arange(len(starts), dtype=np.int64), (Shards(offsets, sizes),)


def shardkit_point(size: str, world: int, layout_name: str) -> dict[str, Any]:
    values = state_values(size, world, layout_name)
    # Wall clock and this thread's CPU time: on a shared machine the wall clock of a few
    # milliseconds of work is mostly the load's; the CPU time is the work (what "flat in W"
    # is about), as load_plan_run.py measures a load's plan.
    started, cpu = time.perf_counter(), time.thread_time()
    layout = SaveLayout.from_values(values, world)
    digest_s, digest_cpu_s = time.perf_counter() - started, time.thread_time() - cpu
    samples = [0, world // 2, world - 1]
    started = time.perf_counter()
    layout.items_of(samples[0])  # the first save of a layout: its geometries too
    first_s = time.perf_counter() - started
    # A later save comes after training steps, in which Python's collector has run since the
    # first save allocated the layout's geometries: here the next allocations would start a
    # full collection inside the timed save (70B FSDP1 at 8,192: 180 ms of its 190, the
    # collection alone, found with gc.callbacks), which is the heap's cost, not the save's.
    gc.collect()
    warm, warm_cpu = [], []
    for rank in samples:
        started, cpu = time.perf_counter(), time.thread_time()
        items = layout.items_of(rank)
        warm.append(time.perf_counter() - started)
        warm_cpu.append(time.thread_time() - cpu)
    started = time.perf_counter()
    metadata = layout.state_dict_metadata()
    metadata_s = time.perf_counter() - started
    started = time.perf_counter()
    expected = layout.expected_items()
    check_s = time.perf_counter() - started
    entries = layout.entry_count()
    assert entries == sum(expected)
    first_finish_s, finish_s, metadata_bytes = _rank0_finish(layout, metadata)
    return {
        "engine": "shardkit",
        "size": size,
        "world": world,
        "layout": layout_name,
        "tensors": sum(v.kind != "bytes" for v in values),
        "geometries": len(layout.geometries),
        "items_rank0": len(layout.items_of(0)),
        "items_last_rank": len(items),
        "digest_s": digest_s,
        "first_plan_s": first_s,
        "plan_s_per_rank": max(warm),
        "wait_s": digest_s + max(warm),
        "wait_cpu_s": digest_cpu_s + max(warm_cpu),
        "rank0_metadata_s": metadata_s,
        "rank0_check_s": check_s,
        "metadata_chunks": entries,
        "planning_collectives": 0,
        # After the write: rank 0 pairs every rank's result rows with the items the layout
        # gives that rank (each chunk's file, offset and length, DCP's format) and pickles
        # the whole metadata, as it writes ``.metadata``.
        "rank0_first_finish_s": first_finish_s,
        "rank0_finish_s": finish_s,
        "metadata_bytes": metadata_bytes,
        "bytes_per_rank": bytes_per_rank(layout),
        "bytes_per_rank_by_turns": bytes_per_rank(
            SaveLayout.from_values(values, world, rule="turns")
        ),
    }


def fsdp1_metadata_point(size: str, world: int) -> dict[str, Any]:
    """A rank's time to read FSDP1's ShardedTensors' shards into the layout, per save.

    Real ShardedTensors of ``world`` shards (dim-0 chunks, as FSDP1 cuts), one per shape,
    built on a fake process group of ``world`` ranks (rank 0); the state lists one under each
    key of the model's parameters and AdamW's moments, as ``state_values`` does. Each key is
    read on its own, as distinct tensors are.
    """
    import torch.distributed as dist
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
    )
    from torch.distributed._shard.sharded_tensor.metadata import (
        TensorProperties as ShardProperties,
    )
    from torch.distributed._shard.sharded_tensor.shard import Shard as LocalShard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardkit.core.checkpoint.local_plan.sharded_tensor_chunks import ShardedParts

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        built: dict[tuple[int, ...], ShardedTensor] = {}
        started = time.perf_counter()
        for _, shape in parameters(size):
            if shape in built:
                continue
            ranks, (shards,) = _fsdp1_shards(shape, world)
            listed = [
                ShardMetadata(o, s, f"rank:{r}/cpu")
                for o, s, r in zip(
                    shards.offsets.tolist(), shards.sizes.tolist(), ranks.tolist(), strict=True
                )
            ]
            whole = ShardedTensorMetadata(listed, torch.Size(shape), ShardProperties())
            local = [LocalShard(torch.empty(listed[0].shard_sizes), listed[0])]
            built[shape] = ShardedTensor._init_from_local_shards_and_global_metadata(local, whole)
        build_s = time.perf_counter() - started
        state: dict[str, Any] = {}
        for name, shape in parameters(size):
            state[f"model.{name}"] = built[shape]
            for moment in ("exp_avg", "exp_avg_sq"):
                state[f"optim.state.{name}.{moment}"] = built[shape]
        seconds: dict[str, float] = {}
        cache = ShardedParts()
        for name, parts in (("uncached", None), ("first", cache), ("later", cache)):
            started = time.perf_counter()
            layout = SaveLayout.of(state, world, parts)
            seconds[name] = time.perf_counter() - started
        return {
            "engine": "shardkit",
            "size": size,
            "world": world,
            "layout": "fsdp1-metadata",
            "sharded_tensors": len(state),
            "shapes": len(built),
            "build_s": build_s,
            "read_uncached_s": seconds["uncached"],
            "read_first_s": seconds["first"],
            "read_later_s": seconds["later"],
            "geometries_digest": layout.digest[:12],
        }
    finally:
        dist.destroy_process_group()


def _rank0_finish(layout: SaveLayout, metadata: dict[str, Any]) -> tuple[float, float, int]:
    """Rank 0's metadata after the write, from rows like the ranks': seconds at the first
    save of the layout and at the next, and its bytes."""
    from shardkit.core.checkpoint.local_plan.save_results import storage_entries

    bodies = []
    for count in layout.expected_items():
        rows = torch.zeros((count, 4), dtype=torch.int64)
        rows[:, 1] = torch.arange(count) * 4096  # offsets in the rank's file
        rows[:, 2] = 4096
        bodies.append(rows.reshape(-1))
    seconds = []
    for _ in range(2):  # the first save of the layout, then one that reuses its entries
        started = time.perf_counter()
        storage = storage_entries(layout, bodies)
        sink = ByteCounter()
        pickle.dump(Metadata(state_dict_metadata=metadata, storage_data=storage), sink)
        seconds.append(time.perf_counter() - started)
    return seconds[0], seconds[1], sink.size


def torch_local_plans(values: list[ValueLayout], world: int) -> list[SavePlan]:
    """Each rank's local plan as DCP's ``create_default_local_save_plan`` makes it."""
    layout = SaveLayout.from_values(values, world)
    plans: list[list[WriteItem]] = [[] for _ in range(world)]
    for value in values:
        if value.kind == "bytes":
            for items in plans:
                items.append(WriteItem(index=MetadataIndex(value.fqn), type=WriteItemType.BYTE_IO))
            continue
        size = torch.Size(value.shape)
        if value.kind == "tensor":
            chunk = ChunkStorageMetadata(torch.Size([0] * len(size)), size)
            for items in plans:
                items.append(
                    WriteItem(
                        index=MetadataIndex(value.fqn, chunk.offsets),
                        type=WriteItemType.TENSOR,
                        tensor_data=TensorWriteData(chunk, PROPS, size),
                    )
                )
            continue
        geometry = layout.geometry(value)
        chunks = geometry.chunk_list()
        for position, rank in enumerate(geometry.ranks.tolist()):
            chunk = chunks[int(geometry.group_of[position])]
            plans[rank].append(
                WriteItem(
                    index=MetadataIndex(value.fqn, chunk.offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk, PROPS, size),
                )
            )
    return [SavePlan(items, planner_data={}) for items in plans]


def torch_point(size: str, world: int, layout: str, compare: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    values = state_values(size, world, layout)
    plans = torch_local_plans(values, world)
    plans_bytes = len(pickle.dumps(plans, protocol=pickle.HIGHEST_PROTOCOL))
    planner = DefaultSavePlanner()
    started = time.perf_counter()
    _, metadata = planner.create_global_plan(plans)
    global_s = time.perf_counter() - started
    record: dict[str, Any] = {
        "engine": "torch",
        "size": size,
        "world": world,
        "layout": layout,
        "rank0_global_plan_s": global_s,
        "plans_gathered_bytes": plans_bytes,
        "planning_collectives": 2,  # the plans gathered to rank 0, the global plan scattered
    }
    if compare:
        # Whole chunks, as DCP lists them: the even writes (rule "bytes") list HSDP's large
        # chunks as row pieces shared by the replicas, on purpose.
        ours = SaveLayout.from_values(values, world, rule="turns").state_dict_metadata()
        record["metadata_equal"] = _content(ours) == _content(metadata.state_dict_metadata)
    return record


def _content(metadata: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fqn, entry in metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)
            out[fqn] = (entry.properties, tuple(entry.size), chunks)
        else:
            out[fqn] = type(entry).__name__
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", default="1024,4096,8192")
    parser.add_argument("--torch-worlds", default="64,256")
    parser.add_argument("--sizes", default="8b,70b")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--fsdp1-metadata", type=int, default=0, help="W: FSDP1's shards")
    args = parser.parse_args()
    if args.fsdp1_metadata:
        for size in args.sizes.split(","):
            print(json.dumps(fsdp1_metadata_point(size, args.fsdp1_metadata)), flush=True)
        return
    for size in args.sizes.split(","):
        for layout in args.layouts.split(","):
            for world in map(int, filter(None, args.torch_worlds.split(","))):
                for record in (
                    torch_point(size, world, layout, compare=True),
                    shardkit_point(size, world, layout),
                ):
                    print(json.dumps(record), flush=True)
            for world in map(int, filter(None, args.worlds.split(","))):
                print(json.dumps(shardkit_point(size, world, layout)), flush=True)


if __name__ == "__main__":
    main()
