"""A checkpoint checked before anything of it loads, then loaded: one verdict on every rank.

``CheckpointManager.load`` walks its candidates (``latest`` first) through these. ``verify``
checks a candidate's files against the checksums its ``COMPLETE`` marker recorded at save,
each rank its share (``files.share``), and reads what the load plans from without running
pickled code: the layout record where the checkpoint has one (then ``.metadata``, torch's
readers' file, is never opened: its size is checked, not its bytes), else DCP's metadata
and the values that are not tensors (``dcp_reading``). A candidate that fails is passed over
with nothing written. ``try_load`` loads, planned from the record by each rank alone, else by
DCP's planning. Each returns '' or why not, the same text on every rank.

The verdicts are agreed by ``agreement.problems_agreed``: one all-reduce of 24 bytes when
every rank passes (no object collective, no plan, nothing that grows with the world); the
ranks' messages travel only when one has a problem. That one small collective stays before
the reads because a file that only one rank checks can be bad: without it that rank would
raise alone and the others would wait in their reads' collectives (HSDP's) or load a
checkpoint that another rank refused.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from shardkit.core.checkpoint.dcp_reading import read_dcp_metadata, unsafe_values, value_keys
from shardkit.core.checkpoint.files import COMPLETE, FileSum, manifest_of, problems_with, share
from shardkit.core.checkpoint.local_plan.layout_record import RECORD, Record, read_record
from shardkit.core.checkpoint.local_plan.load import load_planned_locally, recorded_problems
from shardkit.core.checkpoint.local_plan.save import describe_dcp_failure
from shardkit.core.checkpoint.replica_reads import (
    ReadCounts,
    ReplicaSplitPlanner,
    ReplicaSplitReader,
)
from shardkit.core.runtime.groups import global_rank, world_size
from shardkit.core.runtime.p2p.agreement import problems_agreed

__all__ = ["LoadOutcome", "load_first", "no_checkpoint_loads", "try_load", "verify"]

logger = logging.getLogger(__name__)

_METADATA = ".metadata"  # DCP's, for torch's readers
_PART_WAY = " [after its reads began]"  # a rank's failure that may have written some state
_INDEX = re.compile(r"__\d+\.index")  # a rank's index (``rank_index.index_name``)


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    """What :func:`load_first` found, the same on every rank."""

    loaded: Path | None
    """The checkpoint loaded, or None (none loads, or there is none)."""
    reasons: list[str]
    """Why each candidate before it was passed over."""
    attempted: bool
    """Whether a load began reading (and may have written part of the state)."""
    reads: ReadCounts
    """What this rank read, and received from its replicas, at the last load attempted."""


def load_first(state: dict[str, Any], candidates: list[Path]) -> LoadOutcome | None:
    """Load the first of ``candidates`` that passes ``verify`` and loads on every rank.

    None where the ranks' ``candidates`` differ (nothing is then loaded or exchanged but the
    agreement's 24 bytes).
    """
    key = "\n".join(str(p) for p in candidates)
    reasons: list[str] = []
    reads = ReadCounts()
    if not candidates:  # a fresh start, where every rank finds none
        return (
            None
            if problems_agreed(key, lambda: []) is None
            else LoadOutcome(None, [], False, reads)
        )
    attempted = False
    for candidate in candidates:
        verdict = verify(candidate, key)
        if verdict is None:
            return None
        reason, metadata = verdict
        if not reason and metadata is not None:
            reads = ReadCounts()
            reason, written = try_load(state, candidate, metadata, reads)
            attempted |= written
        if not reason:
            return LoadOutcome(candidate, reasons, attempted, reads)
        reasons.append(f"{candidate.name}: {reason}")
        logger.warning("checkpoint %s does not load, passed over: %s", candidate, reason)
    return LoadOutcome(None, reasons, attempted, reads)


def verify(checkpoint: Path, key: str) -> tuple[str, Metadata | Record | None] | None:
    """What is wrong with ``checkpoint``'s files ('' if nothing), the same on every rank.

    Also what the load plans from, as this rank read it (None where it got no further): the
    layout record where the checkpoint has one (``.metadata`` is then never opened), else
    DCP's metadata.

    ``key``: what this rank believes the ranks are choosing between (its candidates' names);
    None when the ranks' keys differ (nothing is then decided: ``problems_agreed``).
    """
    read: list[Metadata | Record] = []

    def check_my_share() -> list[str]:
        # No marker: torch's dcp.save wrote it (the manager lets no other through).
        has_marker = (checkpoint / COMPLETE).is_file()
        marker = json.loads((checkpoint / COMPLETE).read_text()) if has_marker else {}
        files = manifest_of(marker)
        recorded = (checkpoint / RECORD).is_file()
        if files is None:
            logger.info("%s was saved without checksums: its files are not checked", checkpoint)
        else:
            problems = _problems_with_my_share(checkpoint, files, recorded)
            if problems:
                return problems
        if recorded:
            record = read_record(checkpoint)
            read.append(record)
            problems = _record_against_marker(record, marker, files)
            return problems or recorded_problems(checkpoint, record, global_rank(), world_size())
        # Before anything loads: DCP's metadata and the values that are not tensors, read
        # without running pickled code (a refused one fails the checkpoint, nothing written).
        metadata = read_dcp_metadata(checkpoint)
        read.append(metadata)
        keys = share(value_keys(metadata), global_rank(), world_size())
        return unsafe_values(checkpoint, metadata, keys)

    found = problems_agreed(key, check_my_share)  # a marker one rank cannot read fails all
    if found is None:
        return None
    problems: list[str] = []
    for rank, outcome in enumerate(found):
        failed = [f"rank {rank} could not check its files: {outcome.message}"]
        problems += failed if outcome.failed else outcome.value
    return "; ".join(sorted(problems)), read[0] if read else None


def _problems_with_my_share(
    checkpoint: Path, files: dict[str, FileSum], recorded: bool
) -> list[str]:
    """This rank's share of the manifest's checks.

    With the layout record, ``.metadata`` is torch's readers' file and no load of ours reads
    it: its size is compared (a ``stat``), its bytes are not hashed, so no rank opens it.
    """
    mine = {name: files[name] for name in share(sorted(files), global_rank(), world_size())}
    problems: list[str] = []
    metadata = mine.pop(_METADATA, None) if recorded else None
    if metadata is not None:
        path = checkpoint / _METADATA
        size = path.stat().st_size if path.is_file() else -1
        if size != metadata["bytes"]:
            problems.append(f"{_METADATA} holds {size} bytes, {metadata['bytes']} were saved")
    return problems + problems_with(checkpoint, mine)


def _record_against_marker(
    record: Record, marker: dict[str, Any], files: dict[str, FileSum] | None
) -> list[str]:
    """Where the record's counts disagree with what the manager recorded at the save.

    A record can parse, its checksum and digest recomputed, and still describe another save
    (a bit flipped in its world size): its world against the marker's, and against the
    indexes the save wrote, one per rank.
    """
    world = record.layout.world_size
    saved = marker.get("world_size")
    if saved is not None and saved != world:
        return [f"{RECORD} describes a save by {world} ranks, its {COMPLETE} marker {saved}"]
    if files is not None:
        indexes = sum(1 for name in files if _INDEX.fullmatch(name))
        if indexes != world:
            return [f"{RECORD} describes a save by {world} ranks, which wrote {indexes} indexes"]
    return []


def try_load(
    state: dict[str, Any], checkpoint: Path, metadata: Metadata | Record, counts: ReadCounts
) -> tuple[str, bool]:
    """Load ``checkpoint``: '' if every rank did, else why not; and whether any rank had begun.

    Begun: had begun reading, and so may have written part of the state. Both are the same
    on every rank.

    ``metadata``: as ``verify`` read it, so that the load does not read it again; a layout
    record's layout is loaded by each rank alone (``local_plan.load``). The
    replicas of each replicated DTensor (HSDP's) split its reading (``replica_reads``);
    ``counts`` gets what this rank read and received. A load refused by DCP's planner (a
    saved shape that is not the state's) fails before any rank reads: nothing is written.
    """

    def load() -> list[str]:
        try:
            if isinstance(metadata, Record):
                load_planned_locally(state, checkpoint, metadata, counts)
                return []
            reader = ReplicaSplitReader(checkpoint, metadata, counts)
            planner = ReplicaSplitPlanner()
            dcp_load(state, checkpoint_id=checkpoint, storage_reader=reader, planner=planner)
        except CheckpointException as error:  # a BaseException: `except Exception` misses it
            began = counts.items_read > 0 or counts.broadcasts > 0
            text = describe_dcp_failure(error, "load")
            raise RuntimeError(text + (_PART_WAY if began else "")) from None
        return []

    found = problems_agreed(checkpoint.name, load)
    assert found is not None, "every rank loads the candidate it agreed on"
    by_message: dict[str, list[int]] = {}  # DCP raises the same error on every rank
    written = False
    for rank, outcome in enumerate(found):
        if outcome.failed:
            message = outcome.message.removesuffix(_PART_WAY)
            written |= outcome.error_type != "RuntimeError" or message != outcome.message
            by_message.setdefault(f"{outcome.error_type}: {message}", []).append(rank)
    reason = "; ".join(f"on rank(s) {ranks}: {m}" for m, ranks in by_message.items())
    return reason, written


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
