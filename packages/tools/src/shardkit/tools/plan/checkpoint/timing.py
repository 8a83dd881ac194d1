"""The per-unit costs of a save's planning, measured once by timing the core's own code here.

The core's planning of a save (``shardkit.core.checkpoint.local_plan.chunk_writers``) does work
that is easy to count and whose unit cost depends on the machine:

- per rank, at every save: the layout's digest and the walk over the values, O(1) per value
  of the flat state dict (``per_value_s``), and each of the rank's own items made
  (``per_item_s``: under HSDP a rank writes a chunk of only some of the tensors);
- per rank, at the first save of a layout: each geometry's chunks, O(W) per geometry (numpy
  over the mesh's positions, ``per_position_s``);
- on rank 0, after the write: every chunk's key and storage entry and ``.metadata``'s pickle,
  O(entries) (``per_entry_s``).

:func:`calibrate_save_planning` times those steps of the core on a synthetic state (a few
geometries, a thousand values, a 512-rank mesh; 32 ranks for rank 0's part) in this process;
the predicted times are counted work times these costs.
"""

from __future__ import annotations

import pickle
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, TensorProperties
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from shardkit.core.checkpoint.local_plan.chunk_writers import (
    Geometry,
    SaveLayout,
    ValueLayout,
    mesh_key,
)

__all__ = ["ByteCounter", "SaveCosts", "best_of", "calibrate_save_planning", "synthetic_values"]

_WORLD = 512
_RANK0_WORLD = 32  # rank 0's work is per entry: a small world keeps the timing short
_VALUES = 1000
_SHAPES = ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (4096,))


@dataclass(frozen=True, slots=True)
class SaveCosts:
    """Seconds per unit of a save's planning work on the machine that measured them."""

    per_value_s: float
    per_item_s: float
    per_position_s: float
    per_entry_s: float
    source: str
    """Where the figures come from (machine, what was timed)."""

    def to_dict(self) -> dict[str, Any]:
        """The costs and their provenance."""
        return asdict(self)


class ByteCounter:
    """A sink that counts the bytes written to it (a pickle's size, without keeping it)."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, data: bytes) -> int:
        """Count ``data``'s bytes; keep nothing."""
        self.size += len(data)
        return len(data)


def synthetic_values(world: int, replicas: int = 1) -> list[ValueLayout]:
    """A state like a decoder's: parameters and two moments sharded, a plain step each.

    With ``replicas`` > 1, HSDP's mesh: the replicas take turns, so a rank writes a chunk of
    one tensor in ``replicas``.
    """
    ranks: np.ndarray = np.arange(world, dtype=np.int64)
    placements: tuple[Placement, ...] = (Shard(0),)
    if replicas > 1:
        ranks = ranks.reshape(replicas, world // replicas)
        placements = (Replicate(), Shard(0))
    key = mesh_key(ranks)
    props = TensorProperties(dtype=torch.float32)
    values: list[ValueLayout] = []
    for i in range(_VALUES):
        shape = _SHAPES[i % len(_SHAPES)]
        if i % 4 == 3:
            values.append(ValueLayout(f"optim.state.v{i}.step", "tensor", (), props))
        else:
            values.append(ValueLayout(f"v{i}", "dtensor", shape, props, ranks, placements, key))
    return values


def best_of(runs: int, work: Any, clock: Callable[[], float] = time.perf_counter) -> float:
    """The shortest of ``runs`` timings of ``work()`` (the least disturbed by other load).

    ``clock``: wall-clock by default; ``time.thread_time`` for this thread's CPU time, which
    others' load on a shared machine moves much less.
    """
    best = float("inf")
    for _ in range(runs):
        started = clock()
        work()
        best = min(best, clock() - started)
    return best


def calibrate_save_planning(runs: int = 3) -> SaveCosts:
    """Time the core's planning steps on a synthetic state in this process (about 1 s)."""
    values = synthetic_values(_WORLD)
    few = synthetic_values(_WORLD, replicas=_WORLD // 8)  # a rank writes few items
    seconds, made = [], []
    for state in (values, few):
        warm = SaveLayout.from_values(state, _WORLD)
        made.append(len(warm.items_of(_WORLD // 2)))  # the geometries, computed once

        def steady(state: list[ValueLayout] = state, warm: SaveLayout = warm) -> None:
            layout = SaveLayout.from_values(state, _WORLD)
            layout.geometries = warm.geometries
            layout.items_of(_WORLD // 2)

        seconds.append(best_of(3 * runs, steady))  # milliseconds each: more runs, less noise
    # Two states of the same values, one rank's items many and few: the walk and the items.
    per_item = max(0.0, (seconds[0] - seconds[1]) / (made[0] - made[1]))
    per_value = max(0.0, seconds[1] - per_item * made[1]) / len(values)
    sharded = [v for v in values if v.kind == "dtensor"]
    geometries = {v.geometry_key(): v for v in sharded}

    def geometry() -> None:
        for value in geometries.values():
            Geometry.of(value)

    per_position = best_of(3 * runs, geometry) / (len(geometries) * _WORLD)

    small = synthetic_values(_RANK0_WORLD)

    def rank0() -> int:
        layout = SaveLayout.from_values(small, _RANK0_WORLD)
        storage: dict[Any, _StorageInfo] = {}
        for rank, keys in enumerate(layout.written()):
            name = f"__{rank}_0.distcp"
            for n, key in enumerate(keys):
                storage[key] = _StorageInfo(name, n * 4096, 4096)
        sink = ByteCounter()
        pickle.dump(Metadata(layout.state_dict_metadata(), storage_data=storage), sink)
        return len(storage)

    entries = rank0()
    per_entry = best_of(runs, rank0) / entries
    source = (
        f"measured now on {platform.node() or 'this machine'} ({platform.processor() or '?'}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads): the core's "
        f"SaveLayout on {len(values)} values at W={_WORLD}, FSDP and HSDP (digest + one "
        f"rank's {made[0]} and {made[1]} items), "
        f"Geometry.of on {len(geometries)} geometries, rank 0's keys, entries and .metadata "
        f"pickle for {entries:,} entries (W={_RANK0_WORLD}); best of {3 * runs} and {runs}"
    )
    return SaveCosts(per_value, per_item, per_position, per_entry, source)
