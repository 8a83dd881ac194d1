"""A DCP load planned by each rank alone, from the checkpoint's layout record.

DCP's ``load`` reads the whole ``.metadata`` on every rank (one entry per chunk: O(W) per
tensor), gathers every rank's load plan to the coordinator and scatters the global plan back
(``reduce_scatter``). Neither is needed where the checkpoint carries its layout record: each
rank finds the chunks that overlap its own shards and where they lie (``chunk_sources``),
builds the part of the metadata its load needs, and runs DCP's load planner and file reader
on it alone (``no_dist``: the plan is local, and so is DCP's global step over one plan).

DCP's planner then does what it always does with that metadata: per key of the state, the
overlaps of the rank's shards with the listed chunks become read items, so the values land
exactly where DCP's own load puts them (same keys, flattening, Stateful round trip).
``ReplicaSplitPlanner`` is the base, so HSDP's replicas still split the reading and share
what they read (``replica_reads``): those collectives come after the reads, as before. With
the record they split it by the saved items rather than by tensors (``replica_pieces``), so
that a rank plans only the pieces it reads: about 1/R of its shard's, whatever R.

Collectives before the reads: none.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from shardkit.core.checkpoint.dcp_reading import unsafe_values
from shardkit.core.checkpoint.files import share
from shardkit.core.checkpoint.local_plan.chunk_sources import ChunkSources
from shardkit.core.checkpoint.local_plan.layout_record import Record
from shardkit.core.checkpoint.local_plan.rank_index import check_inside
from shardkit.core.checkpoint.local_plan.replica_pieces import PieceSplit, ReplicaLoads
from shardkit.core.checkpoint.replica_reads import (
    PieceParts,
    ReadCounts,
    ReplicaSet,
    ReplicaSplitPlanner,
    ReplicaSplitReader,
)

__all__ = ["RecordLoadPlanner", "load_planned_locally", "recorded_problems"]


class RecordLoadPlanner(ReplicaSplitPlanner):
    """DCP's load planner over the metadata this rank builds from the record.

    DCP hands the planner and the reader the same ``Metadata`` object (what the reader's
    ``read_metadata`` returned); it starts empty and is filled here, once the state's flat
    keys and this rank's shards are known, before the reader is set up from it.
    """

    def __init__(self, sources: ChunkSources) -> None:
        super().__init__()
        self.sources = sources
        self._splits: dict[str, tuple[PieceSplit, torch.Tensor, ReplicaSet]] = {}
        self._loads: dict[int, ReplicaLoads] = {}  # id of a replica set -> its split's loads

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """Flatten the state and split the replicas' reading, then fill in the metadata.

        The metadata: of what this rank reads (``ChunkSources.metadata_for``), which also
        splits each replicated key's saved items between its replicas.
        """
        self._splits.clear()
        self._loads.clear()
        super().set_up_planner(state_dict, metadata, is_coordinator)
        assert metadata is not None, "the reader's shared metadata"
        splits = {fqn: split for fqn, (split, _, _) in self._splits.items()}
        mine = self.sources.metadata_for(self.state_dict, frozenset(self._others), splits)
        metadata.state_dict_metadata = mine.state_dict_metadata
        metadata.storage_data = mine.storage_data
        for split, local, replica_set in self._splits.values():
            units = split.units
            if units is not None:  # else not in the record as chunks: every replica reads it
                parts = PieceParts(local, units.offsets, units.sizes, units.readers)
                replica_set.pieces.append(parts)

    def _share(self, fqn: str, local: torch.Tensor, replica_set: ReplicaSet) -> None:
        """Split the key by its saved items (when the metadata is made), not whole."""
        loads = self._loads.get(id(replica_set))
        if loads is None:
            ranks = np.array(replica_set.ranks, dtype=np.int64)
            loads = self._loads[id(replica_set)] = ReplicaLoads(ranks, replica_set.me)
        self._splits[fqn] = (PieceSplit(loads), local, replica_set)

    @property
    def tensors_skipped(self) -> int:
        """How many tensors other replicas read all of for this rank."""
        skipped = 0
        for split, _, replica_set in self._splits.values():
            units = split.units
            if units is not None and units.readers.size:
                skipped += int(not (units.readers == replica_set.me).any())
        return skipped + super().tensors_skipped


def load_planned_locally(
    state: dict[str, Any], checkpoint: Path, record: Record, counts: ReadCounts
) -> None:
    """Load ``state`` in place from ``checkpoint`` by its ``record``, planned on this rank alone.

    Raises:
        torch.distributed.checkpoint.api.CheckpointException: as DCP's load raises (this
            rank's failure only: no rank waits on another before the reads).
    """
    metadata = Metadata(state_dict_metadata={})
    reader = ReplicaSplitReader(checkpoint, metadata, counts)
    planner = RecordLoadPlanner(ChunkSources(checkpoint, record.layout, record.plain))
    with warnings.catch_warnings():
        # no_dist is the point (the plan is this rank's alone); DCP warns that it is set.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load(
            state, checkpoint_id=checkpoint, storage_reader=reader, planner=planner, no_dist=True
        )


def recorded_problems(checkpoint: Path, record: Record, rank: int, world: int) -> list[str]:
    """This rank's share of the checks before a recorded checkpoint loads ([] if it passes).

    The saved ranks' indexes, every ``world``-th from this rank's (each is read again, by the
    ranks that need it, at the load), the record's places of the values every rank holds,
    and the values that are not tensors, each read with
    ``weights_only`` (``dcp_reading``) before anything is loaded.

    Raises:
        StateDictFileError: an index is missing or damaged, or a value reaches past its
            data file's end (naming the file).
    """
    layout = record.layout
    sources = ChunkSources(checkpoint, layout, record.plain)
    for writer in range(rank, layout.world_size, world):
        sources.index_of(writer)
    for turn in range(rank, record.plain.shape[0], world):  # inside its file, as the indexes'
        check_inside(checkpoint, turn % layout.world_size, record.plain[turn : turn + 1])
    keys = share(sorted(v.fqn for v in layout.values if v.kind == "bytes"), rank, world)
    metadata = sources.metadata_for(dict.fromkeys(keys))
    return unsafe_values(checkpoint, metadata, keys)
