"""A checkpoint checked before anything of it loads, then loaded: one verdict on every rank.

``CheckpointManager.load`` walks its candidates (``latest`` first) through these. ``verify``
checks a candidate's files against the checksums its ``COMPLETE`` marker recorded at save,
each rank its share (``files.share``), and reads DCP's metadata and the values that are not
tensors without running pickled code (``dcp_reading``): a candidate that fails is passed
over with nothing written. ``try_load`` runs DCP's load with those readers. Each returns ''
or why not, the same text on every rank (``runtime.p2p.agreement.everyone``), so the ranks pass
over the same candidates and load the same one.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from shardkit.core.checkpoint.dcp_reading import read_dcp_metadata, unsafe_values, value_keys
from shardkit.core.checkpoint.files import COMPLETE, manifest_of, problems_with, share
from shardkit.core.checkpoint.local_plan.layout_record import RECORD, Record, read_record
from shardkit.core.checkpoint.local_plan.load import load_planned_locally, recorded_problems
from shardkit.core.checkpoint.local_plan.save import describe_dcp_failure
from shardkit.core.checkpoint.replica_reads import (
    ReadCounts,
    ReplicaSplitPlanner,
    ReplicaSplitReader,
)
from shardkit.core.runtime.groups import global_rank, world_size
from shardkit.core.runtime.p2p.agreement import everyone

__all__ = ["no_checkpoint_loads", "try_load", "verify"]

logger = logging.getLogger(__name__)


def verify(checkpoint: Path) -> tuple[str, Metadata | Record | None]:
    """What is wrong with ``checkpoint``'s files ('' if nothing), the same on every rank.

    Also what the load plans from, as this rank read it (None where it got no further): the
    layout record where the checkpoint has one (``.metadata`` is then never read), else
    DCP's metadata.
    """
    read: list[Metadata | Record] = []

    def check_my_share() -> list[str]:
        files = manifest_of(json.loads((checkpoint / COMPLETE).read_text()))
        if files is None:
            logger.info("%s was saved without checksums: its files are not checked", checkpoint)
        else:
            mine = share(sorted(files), global_rank(), world_size())
            problems = problems_with(checkpoint, {name: files[name] for name in mine})
            if problems:
                return problems
        if (checkpoint / RECORD).is_file():
            record = read_record(checkpoint)
            read.append(record)
            return recorded_problems(checkpoint, record, global_rank(), world_size())
        # Before anything loads: DCP's metadata and the values that are not tensors, read
        # without running pickled code (a refused one fails the checkpoint, nothing written).
        metadata = read_dcp_metadata(checkpoint)
        read.append(metadata)
        keys = share(value_keys(metadata), global_rank(), world_size())
        return unsafe_values(checkpoint, metadata, keys)

    found = everyone(check_my_share)  # a marker one rank cannot read fails it for all
    problems: list[str] = []
    for rank, outcome in enumerate(found):
        failed = [f"rank {rank} could not check its files: {outcome.message}"]
        problems += failed if outcome.failed else outcome.value
    return "; ".join(sorted(problems)), read[0] if read else None


def try_load(
    state: dict[str, Any], checkpoint: Path, metadata: Metadata | Record, counts: ReadCounts
) -> str:
    """Load ``checkpoint``; '' if every rank did, else why not (the same on every rank).

    ``metadata``: as ``verify`` read it, so that the load does not read it again; a layout
    record's layout is loaded by each rank alone (``local_plan.load``). The
    replicas of each replicated DTensor (HSDP's) split its reading (``replica_reads``);
    ``counts`` gets what this rank read and received.
    """

    def load() -> None:
        try:
            if isinstance(metadata, Record):
                load_planned_locally(state, checkpoint, metadata, counts)
                return
            reader = ReplicaSplitReader(checkpoint, metadata, counts)
            planner = ReplicaSplitPlanner()
            dcp_load(state, checkpoint_id=checkpoint, storage_reader=reader, planner=planner)
        except CheckpointException as error:  # a BaseException: `except Exception` misses it
            raise RuntimeError(describe_dcp_failure(error, "load")) from None

    by_message: dict[str, list[int]] = {}  # DCP raises the same error on every rank
    for rank, outcome in enumerate(everyone(load)):
        if outcome.failed:
            by_message.setdefault(f"{outcome.error_type}: {outcome.message}", []).append(rank)
    return "; ".join(f"on rank(s) {ranks}: {m}" for m, ranks in by_message.items())


def no_checkpoint_loads(root: Path, reasons: list[str], attempted: bool) -> str:
    """The error's text: why each candidate under ``root`` failed, and what the state holds now.

    ``attempted``: whether a load began (and may have written part of the state).
    """
    state = (
        "A load was attempted and failed part-way, so the state may be partly loaded."
        if attempted
        else "Nothing was loaded: the model and optimizer are as they were."
    )
    listed = "\n".join(f"  {reason}" for reason in reasons)
    return f"no checkpoint under {root} loads on every rank. {state}\n{listed}"
