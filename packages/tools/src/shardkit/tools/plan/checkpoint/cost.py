"""A checkpoint save's predicted cost: bytes per rank, ``.metadata``, planning and write time.

From the core's own :class:`SaveLayout` of the state (``layout``):

- the bytes each rank writes: every chunk it writes (the layout's ``writers``), its elements
  times its dtype's size, exact; and its file, ``__<rank>_0.distcp``, which holds each item
  as DCP's ``FileSystemWriter`` writes it (``torch.save`` of the chunk: the data and a header
  of about 1.5 KiB, measured per distinct chunk shape by saving one, exact for chunks up to
  16 MiB and within 64 bytes an item beyond; plain values as they pickle);
- ``.metadata``: its storage entries (one per item of every rank) and its size, pickled as
  the core writes it (every entry when there are at most 200,000, else a sample of ranks'
  entries scaled up);
- time: the planning per rank and rank 0's metadata from counted work and the per-unit costs
  of :mod:`timing`; the write, the busiest rank's file over the disk's bandwidth;
- a restart's side (:mod:`load_cost`): the layout record's bytes, exact, and a rank's load
  planning from it at the same layout.
"""

from __future__ import annotations

import io
import math
import pickle
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from shardkit.core.checkpoint.local_plan.chunk_writers import SaveLayout
from shardkit.tools.plan.checkpoint.load_cost import LoadCosts, load_plan_seconds, record_bytes
from shardkit.tools.plan.checkpoint.timing import ByteCounter, SaveCosts

__all__ = ["DEFAULT_DISK_GIB_S", "CheckpointCost", "checkpoint_cost"]

DEFAULT_DISK_GIB_S = 1.0
"""Write bandwidth per rank, GiB/s, when none is given: of the order of what one rank gets of
a shared parallel file system or a local NVMe drive under other traffic (pass --disk-gib-s)."""

_EXACT_HEADER_BYTES = 16 * 2**20  # chunks up to this are saved for real to size their header
_EXACT_METADATA_ENTRIES = 200_000
_SAMPLED_RANKS = 16


@dataclass(frozen=True, slots=True)
class CheckpointCost:
    """A save's predicted figures (bytes exact; times a model, see :mod:`timing`)."""

    world_size: int
    values: int
    """Values of the flat state dict (``.metadata``'s keys)."""
    geometries: int
    entries: int
    """Storage entries of ``.metadata``: the items of every rank."""
    data_bytes: list[int]
    """Per rank: the elements of the chunks it writes, in bytes."""
    file_bytes: list[int]
    """Per rank: its ``.distcp`` file (the data and each item's serialization)."""
    items: list[int]
    metadata_bytes: int
    metadata_exact: bool
    disk_gib_s: float
    plan_s: float
    """Per rank, at each save: the digest and its own items (the rank with the most)."""
    first_plan_s: float
    """Per rank, at the first save of a layout (its geometries too)."""
    rank0_metadata_s: float
    """Rank 0 after the write, at the first save of a layout: every entry's key, storage
    entry and pickle (later saves reuse the keys and entries: less)."""
    write_s: float
    """The busiest rank's file over the disk's bandwidth."""
    costs: SaveCosts
    record_bytes: int = 0
    """The layout record (``layout.json``), exact; 0 where the record cannot describe it."""
    load_plan_s: float | None = None
    """A rank's load planning from the record at the same layout (None: not calibrated)."""
    load_costs: LoadCosts | None = None
    dcp_fallback: str = ""
    """Why this save would go through DCP's own planning ('' if planned locally); then the
    figures are the local plan's, which that save does not follow."""
    assumption: str = field(
        default="SPMD: every rank holds the same keys, on meshes of all the ranks; a state "
        "whose keys differ between ranks (pipeline stages) is saved through DCP's own "
        "planning instead, which this does not predict"
    )

    @property
    def busiest_rank(self) -> int:
        """The rank with the largest file (the write's critical path)."""
        return int(np.argmax(self.file_bytes))

    def spread(self, per_rank: list[int]) -> dict[str, float]:
        """Min, median and max over ranks."""
        return {
            "min": min(per_rank),
            "median": float(np.median(per_rank)),
            "max": max(per_rank),
        }

    def to_dict(self, per_rank_up_to: int = 64) -> dict[str, Any]:
        """The figures; per-rank lists only for worlds up to ``per_rank_up_to`` ranks."""
        data = asdict(self)
        data["costs"] = self.costs.to_dict()
        if self.world_size > per_rank_up_to:
            for key in ("data_bytes", "file_bytes", "items"):
                del data[key]
        data["data_bytes_spread"] = self.spread(self.data_bytes)
        data["file_bytes_spread"] = self.spread(self.file_bytes)
        data["items_spread"] = self.spread(self.items)
        data["busiest_rank"] = self.busiest_rank
        return data


def checkpoint_cost(
    layout: SaveLayout,
    plain_sizes: dict[str, int],
    costs: SaveCosts,
    disk_gib_s: float = DEFAULT_DISK_GIB_S,
    mappings: dict[str, Any] | None = None,
    dcp_fallback: str = "",
    load_costs: LoadCosts | None = None,
) -> CheckpointCost:
    """The cost of saving ``layout``'s state.

    Args:
        layout: the core's layout of the flat state.
        plain_sizes: each value that is not a tensor, its bytes as DCP saves it.
        costs: the per-unit costs of the planning.
        disk_gib_s: each rank's write bandwidth, GiB/s.
        mappings: DCP's flattening mappings (``.metadata`` holds them as planner data).
        dcp_fallback: why the core would save through DCP's planning (``dcp_fallback_reason``).
        load_costs: the per-unit costs of a load's planning (None: its time is not predicted).

    Raises:
        ValueError: a bandwidth that is not positive, or a value without its size.
    """
    if not disk_gib_s > 0:
        raise ValueError(f"--disk-gib-s must be positive, got {disk_gib_s}")
    world = layout.world_size
    data = np.zeros(world, dtype=np.int64)
    files = np.zeros(world, dtype=np.int64)
    items = np.zeros(world, dtype=np.int64)
    headers: dict[tuple[tuple[int, ...], torch.dtype], int] = {}
    item_sizes: dict[int, list[int]] = {}  # per ordinal: the file bytes of each chunk
    plain_files: dict[str, int] = {}  # per plain value: its item's bytes in the file
    plain = 0
    for ordinal, value in enumerate(layout.values):
        if value.kind not in ("dtensor", "sharded"):
            rank = plain % world
            plain += 1
            items[rank] += 1
            if value.kind == "bytes":
                if value.fqn not in plain_sizes:
                    raise ValueError(f"{value.fqn}: no size for this plain value")
                files[rank] += plain_files.setdefault(value.fqn, plain_sizes[value.fqn])
                continue
            assert value.properties is not None
            dtype = value.properties.dtype
            nbytes = math.prod(value.shape) * dtype.itemsize
            data[rank] += nbytes
            plain_files[value.fqn] = nbytes + _header(value.shape, dtype, headers)
            files[rank] += plain_files[value.fqn]
            continue
        assert value.properties is not None
        dtype = value.properties.dtype
        pieces, _ = layout.pieces(ordinal)  # chunks, cut where their holders share them
        writers = layout.writers(ordinal, pieces)
        chunk_bytes = pieces.sizes.prod(axis=1) * dtype.itemsize
        chunk_files = chunk_bytes + np.array(
            [_header(tuple(s), dtype, headers) for s in pieces.sizes.tolist()], dtype=np.int64
        )
        item_sizes[ordinal] = chunk_files.tolist()
        np.add.at(data, writers, chunk_bytes)
        np.add.at(files, writers, chunk_files)
        np.add.at(items, writers, 1)
    entries = int(items.sum())
    assert entries == layout.entry_count()  # the benchmarks count them so
    metadata_bytes, exact = _metadata_bytes(layout, item_sizes, plain_files, entries, mappings)
    record = record_bytes(layout, item_sizes, plain_files)
    load_s = None
    if load_costs is not None:
        load_s = load_plan_seconds(layout, record, load_costs)
    busiest = int(files.max()) if world else 0
    positions = sum(g.ranks.size for g in layout.geometries.values())
    # The busiest rank by items: its walk and its items made.
    plan_s = len(layout.values) * costs.per_value_s + int(items.max()) * costs.per_item_s
    return CheckpointCost(
        world_size=world,
        values=len(layout.values),
        geometries=len(layout.geometries),
        entries=entries,
        data_bytes=data.tolist(),
        file_bytes=files.tolist(),
        items=items.tolist(),
        metadata_bytes=metadata_bytes,
        metadata_exact=exact,
        disk_gib_s=disk_gib_s,
        plan_s=plan_s,
        first_plan_s=plan_s + positions * costs.per_position_s,
        rank0_metadata_s=entries * costs.per_entry_s,
        write_s=busiest / (disk_gib_s * 2**30),
        costs=costs,
        record_bytes=record,
        load_plan_s=load_s,
        load_costs=load_costs,
        dcp_fallback=dcp_fallback,
    )


def _header(shape: tuple[int, ...], dtype: torch.dtype, known: dict[Any, int]) -> int:
    """Bytes ``torch.save`` adds to a chunk of ``shape`` (saved for real, once per shape)."""
    key = (shape, dtype)
    found = known.get(key)
    if found is not None:
        return found
    nbytes = math.prod(shape) * dtype.itemsize
    # Beyond the bound: a one-element chunk's header, which differs by its alignment only.
    probe = shape if nbytes <= _EXACT_HEADER_BYTES else (1,) * len(shape)
    stream = io.BytesIO()
    tensor = torch.zeros(probe, dtype=dtype)
    torch.save(tensor, stream)
    found = known[key] = stream.tell() - tensor.numel() * dtype.itemsize
    return found


def _metadata_bytes(
    layout: SaveLayout,
    item_sizes: dict[int, list[int]],
    plain_files: dict[str, int],
    entries: int,
    mappings: dict[str, Any] | None,
) -> tuple[int, bool]:
    """``.metadata``'s pickled size, and whether every entry was pickled (else scaled up)."""
    world = layout.world_size
    exact = entries <= _EXACT_METADATA_ENTRIES
    ranks = range(world) if exact else np.linspace(0, world - 1, _SAMPLED_RANKS).astype(int)
    storage: dict[MetadataIndex, _StorageInfo] = {}
    sampled = 0
    by_fqn = {v.fqn: (o, v) for o, v in enumerate(layout.values)}
    for rank in sorted(set(int(r) for r in ranks)):
        offset = 0
        name = f"__{rank}_0.distcp"
        for item in layout.items_of(rank):
            ordinal, value = by_fqn[item.index.fqn]
            if value.kind in ("dtensor", "sharded"):
                assert item.index.index is not None
                length = item_sizes[ordinal][item.index.index]
            else:
                length = plain_files[value.fqn]
            storage[item.index] = _StorageInfo(name, offset, length)
            offset += length
            sampled += 1
    metadata = Metadata(layout.state_dict_metadata(), planner_data=mappings)
    metadata.version = CURRENT_DCP_VERSION
    bare = ByteCounter()
    pickle.dump(metadata, bare)
    metadata.storage_data = storage
    full = ByteCounter()
    pickle.dump(metadata, full)
    if exact or sampled == 0:
        return full.size, exact
    return bare.size + round((full.size - bare.size) * entries / sampled), False
