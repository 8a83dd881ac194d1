"""A DCP save with no plan exchange: every rank plans alone, rank 0 writes the same metadata.

:func:`save_dcp` is this save for code that calls DCP's ``save`` itself, a drop-in for it
(``CheckpointManager`` saves this way already, through :func:`save_planned_locally`).

The files are DCP's (``FileSystemWriter``: ``__<rank>_<n>.distcp`` and ``.metadata``), so
``torch.distributed.checkpoint.load`` reads them at any world size, and DCP's checkpoints
load here as before. What changes is the coordination. DCP's ``save`` gathers every rank's
plan to rank 0, builds and checks the global plan there and scatters it back, then gathers the
write results. Here:

1. every rank derives its own items from the layout (``chunk_writers``; no collective);
2. every rank writes them, then its index of where each lies (``rank_index``);
3. one gather to rank 0 of what was written: a small fixed header per rank (its layout's
   digest, how many items, whether it failed), then each rank's results as int64 rows
   (file number, offset, length, bytes) in the order of its items, which rank 0 knows
   already: no pickle, every field checked;
4. rank 0 checks that every rank planned the same layout, writes the layout record
   (``layout_record``: what loads plan from, each rank alone), checks that every rank wrote
   what it was due, adds the storage entries to the layout's metadata (built once per
   layout) and writes ``.metadata`` last (for torch's readers); its outcome goes to every
   rank (a broadcast on the save's group), which raises the same error on failure.

Collectives: none before the write; after it, the gather (two point-to-point rounds to
rank 0) and the outcome's broadcast. Values a rank holds that no other rank holds the same
way (a rank's own RNG state, say) are saved as DCP saves them: once, by one rank.

What was written travels and is checked in ``save_results`` (the rows, their gather, rank
0's storage entries and ``.metadata``'s file).

Next to split off: the planner (``LocalPlanSavePlanner``, ``cut_rows``, ``LayoutCache``)
into a ``save_planner`` module.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import (
    FileSystemWriter,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem
from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import WriteResult

from shardkit.core.checkpoint.dcp_reading import LoadableSavePlanner
from shardkit.core.checkpoint.local_plan.chunk_sources import plain_locations
from shardkit.core.checkpoint.local_plan.chunk_writers import SaveLayout
from shardkit.core.checkpoint.local_plan.layout_record import RECORD, write_record
from shardkit.core.checkpoint.local_plan.rank_index import index_name, write_index
from shardkit.core.checkpoint.local_plan.save_results import (
    ROW,
    Gathered,
    gather_results,
    result_rows,
    storage_entries,
    write_metadata_file,
)
from shardkit.core.checkpoint.local_plan.sharded_tensor_chunks import (
    ShardedParts,
    UnplannableValue,
)
from shardkit.core.errors import CheckpointSaveError, first_sentence
from shardkit.core.runtime.groups import checkpoint_group
from shardkit.core.runtime.p2p.object_collectives import broadcast_bytes

__all__ = [
    "cut_rows",
    "LayoutCache",
    "NotPlannableLocally",
    "describe_dcp_failure",
    "LocalPlanSavePlanner",
    "SaveTimes",
    "save_dcp",
    "save_planned_locally",
    "write_items_here",
    "WriteItems",
    "WriteMetadata",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class SaveTimes:
    """Where a save's time went on this rank (seconds)."""

    plan: float = 0.0
    """The local plan (the layout, cached per layout, and this rank's items)."""
    write: float = 0.0
    exchange: float = 0.0
    """The results' gather and the outcome (rank 0: with the metadata written)."""
    metadata: float = 0.0
    """Rank 0: the metadata's entries and its file."""


@dataclasses.dataclass(slots=True)
class LayoutCache:
    """The last layout, kept while the state's layout stays the same (its digest)."""

    layout: SaveLayout | None = None
    dcp_reason: str = ""
    """Why this manager's saves go through DCP's own planning (set once, on every rank)."""
    sharded: ShardedParts = dataclasses.field(default_factory=ShardedParts)
    """FSDP1's ShardedTensors' shards, read once per layout (``sharded_tensor_chunks``)."""


class NotPlannableLocally(Exception):
    """The state's layout is not the same on every rank: DCP's planning must merge it."""


class LocalPlanSavePlanner(LoadableSavePlanner):
    """DCP's planner, with a local plan from the layout instead of DCP's dedup on rank 0."""

    def __init__(self, cache: LayoutCache, rank: int, world_size: int) -> None:
        # Not DCP's flattening of ShardedTensors: it drops a ShardedTensor from the state of a
        # rank that holds no shard of it (FSDP1's last ranks of a short tensor), which would
        # make that rank's keys differ from the others'. Nested ones are refused instead
        # (``sharded_tensor_chunks``: they go through DCP's planning, which flattens them).
        super().__init__(flatten_sharded_tensors=False)
        self.cache, self.rank, self.world_size = cache, rank, world_size
        self.layout: SaveLayout | None = None
        self.rows: dict[str, tuple[int, int]] = {}
        """Keys this rank writes a row piece of (its holders share it): (first row, rows)."""

    def create_local_plan(self) -> SavePlan:
        """This rank's items (each chunk written by one rank: no dedup needed after)."""
        try:
            layout = SaveLayout.of(self.state_dict, self.world_size, self.cache.sharded)
        except UnplannableValue as error:
            raise NotPlannableLocally(str(error)) from None
        for value in layout.values:
            mesh = value.mesh
            if value.kind == "dtensor" and mesh is not None and mesh.size != self.world_size:
                # Pipeline stages, each on a mesh of its own: the other ranks hold other keys.
                raise NotPlannableLocally(
                    f"{value.fqn} is on a mesh of {mesh.size} of the {self.world_size} "
                    "ranks (each rank's keys are not every rank's)"
                )
        cached = self.cache.layout
        if cached is not None and cached.digest == layout.digest:
            layout = cached  # its chunks and rank 0's metadata are computed already
        self.cache.layout = self.layout = layout
        own = layout.own_items(self.rank)
        self.rows = own.rows
        plan = SavePlan(own.items, planner_data=self.mappings)
        self.plan = plan
        return plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        """The item's data: the rank's shard, or the rows of it that this rank writes."""
        data = super().resolve_data(write_item)
        return cut_rows(data, self.rows.get(write_item.index.fqn))


def cut_rows(
    data: torch.Tensor | io.BytesIO, rows: tuple[int, int] | None
) -> torch.Tensor | io.BytesIO:
    """``data``, or its ``rows`` (first row, rows) along dim 0 where its holders share it."""
    if rows is None or not isinstance(data, torch.Tensor):
        return data
    return data.narrow(0, rows[0], rows[1])


"""Rank 0's view of every rank's results: (layout digest, failure, result rows, not local)."""

WriteItems = Callable[[FileSystemWriter, "LocalPlanSavePlanner", SavePlan], list[WriteResult]]
"""Writes a rank's planned items and returns DCP's results (here, or in a writer process)."""

WriteMetadata = Callable[[FileSystemWriter, "LocalPlanSavePlanner", Gathered], None]
"""Rank 0: checks the gathered results and writes ``.metadata`` (here, or in a process)."""


def save_dcp(
    state_dict: dict[str, Any],
    checkpoint_id: str | os.PathLike[str],
    *,
    layout: LayoutCache | None = None,
) -> None:
    """Save ``state_dict`` into the directory ``checkpoint_id`` as ``dcp.save`` would.

    For any training loop that calls DCP's ``save`` itself: FSDP1's SHARDED_STATE_DICT
    (ShardedTensors, or DTensors with a device mesh; torch's FSDP1 or ``shardkit.legacy``), or
    ``fully_shard``'s state dicts. The files are DCP's, so ``torch.distributed.checkpoint.load``
    reads them at any world size.

    Each rank plans its own part from the sharding (no collective before the files are
    written; :func:`save_planned_locally`), then rank 0 gathers what was written and writes
    ``.metadata``. Where the ranks' keys differ (pipeline stages), or a value's chunks cannot
    be placed by each rank alone, the save goes through DCP's own planning instead.

    Collective: every rank of the world calls it. Unlike ``CheckpointManager``, nothing is
    atomic: an interrupted save leaves a directory without ``.metadata`` (or with the last
    save's, if saved over one).

    Args:
        state_dict: what ``dcp.save`` takes (tensors, DTensors, ShardedTensors, ``Stateful``
            objects, other values).
        checkpoint_id: the checkpoint's directory (made if missing).
        layout: keep the plan between saves: pass the same ``LayoutCache`` to every save of
            one training loop, and a save whose layout did not change plans nothing anew.

    Raises:
        CheckpointSaveError: on every rank, the same text: a rank failed to write, or a
            rank's results did not match its plan.
    """
    folder = Path(checkpoint_id)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        save_planned_locally(
            state_dict, folder, layout if layout is not None else LayoutCache(), checkpoint_group()
        )
    except RuntimeError as error:  # raised on every rank, the same text
        raise CheckpointSaveError(f"the save into {folder} failed: {error}") from None


def write_items_here(
    writer: FileSystemWriter, planner: LocalPlanSavePlanner, plan: SavePlan
) -> list[WriteResult]:
    """The items of ``plan`` written by DCP's writer in this process."""
    future = writer.write_data(plan, planner)
    future.wait()
    return future.value()


def save_planned_locally(
    state: dict[str, Any],
    checkpoint_id: Path,
    cache: LayoutCache,
    group: dist.ProcessGroup,
    *,
    write_items: WriteItems = write_items_here,
    write_metadata: WriteMetadata | None = None,
) -> SaveTimes:
    """Save ``state`` into ``checkpoint_id`` as DCP would, planned on each rank alone.

    Collective over ``group`` (every rank of the world, in the world's rank order).
    ``write_items`` and ``write_metadata`` say where the files are written: in this process
    by default, in a writer process for ``process_writer``; the collectives stay here.

    Raises:
        RuntimeError: on every rank, the same text: a rank failed to write, the ranks planned
            different layouts, or a rank's results do not match its plan.
    """
    rank, world = group.rank(), group.size()
    times = SaveTimes()
    if cache.dcp_reason:
        _save_with_dcp(state, checkpoint_id, group)
        return times
    writer = FileSystemWriter(checkpoint_id)
    planner = LocalPlanSavePlanner(cache, rank, world)
    failure, not_local = "", False
    rows = torch.zeros((0, ROW), dtype=torch.int64)
    started = time.perf_counter()
    try:
        # Planned and written without a collective: a rank that fails here says so in the
        # gather below, where every rank meets.
        flat = _stateful_to_state_dict(state)
        planner.set_up_planner(flat, writer.storage_meta(), rank == 0)
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        plan = writer.prepare_local_plan(planner.create_local_plan())
        plan = dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{rank}_"))
        times.plan = time.perf_counter() - started
        started = time.perf_counter()
        final = planner.finish_plan(plan)
        rows = result_rows(final.items, write_items(writer, planner, final), rank)
        write_index(checkpoint_id, rank, rows)  # where this rank's items lie (loads read it)
        times.write = time.perf_counter() - started
    except NotPlannableLocally as error:
        failure, not_local = f"rank {rank}: {error}", True  # nothing written
    except Exception as error:
        failure = f"rank {rank}: {type(error).__name__}: {error}"
    started = time.perf_counter()
    digest = planner.layout.digest if planner.layout is not None else "0" * 32
    gathered = gather_results(digest, rows, failure, not_local, group)

    outcome = b""
    if gathered is not None:  # rank 0
        begun = time.perf_counter()
        try:
            reason = _needs_dcp(planner, gathered)
            if reason:
                outcome = json.dumps({"fallback": reason}).encode()
            else:
                # The record before .metadata: a checkpoint that torch's readers take has it.
                assert planner.layout is not None
                bodies = [body for _, _, body, _ in gathered]
                plain = plain_locations(planner.layout, bodies)
                write_record(checkpoint_id, planner.layout, plain)
                (write_metadata or _write_metadata)(writer, planner, gathered)
                outcome = json.dumps({"metadata_s": time.perf_counter() - begun}).encode()
        except Exception as error:
            outcome = json.dumps({"error": f"{type(error).__name__}: {error}"}).encode()
    # On ``group``, not the world's group: a background save runs all of this off the
    # training thread (see async_save).
    shared = _parse_outcome(broadcast_bytes(outcome, 0, group))
    if "error" in shared:
        raise RuntimeError(shared["error"])
    if "fallback" in shared:
        # Every rank learns it at once, so every rank saves through DCP from now on.
        cache.dcp_reason = shared["fallback"]
        logger.warning("saving through DCP's own planning from now on: %s", cache.dcp_reason)
        for written in Path(checkpoint_id).glob(f"__{rank}_*.distcp"):
            written.unlink()  # what the local plan wrote: DCP writes its own
        (Path(checkpoint_id) / index_name(rank)).unlink(missing_ok=True)  # no record: DCP loads
        if rank == 0:
            (Path(checkpoint_id) / RECORD).unlink(missing_ok=True)  # a last save's, saved over
        _save_with_dcp(state, checkpoint_id, group)
        return times
    times.metadata = float(shared["metadata_s"])
    times.exchange = time.perf_counter() - started - times.metadata
    return times


def _parse_outcome(data: bytes) -> dict[str, Any]:
    """Rank 0's outcome, checked.

    ``{"metadata_s": float}``, ``{"error": str}`` or ``{"fallback": str}`` (save through
    DCP's planning).
    """
    try:
        value = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RuntimeError(f"rank 0's outcome of the save is not JSON: {error}") from None
    for text in ("error", "fallback"):
        if isinstance(value, dict) and isinstance(value.get(text), str) and len(value) == 1:
            return value
    if isinstance(value, dict) and isinstance(value.get("metadata_s"), float) and len(value) == 1:
        return value
    raise RuntimeError(f"rank 0's outcome of the save is malformed: {str(value)[:200]}")


def _write_metadata(
    writer: FileSystemWriter,
    planner: LocalPlanSavePlanner,
    gathered: Gathered,
) -> None:
    """Rank 0: check every rank's results against the layout, then write ``.metadata``."""
    layout = planner.layout
    assert layout is not None
    metadata = Metadata(
        state_dict_metadata=layout.state_dict_metadata(),
        planner_data=planner.mappings,
        storage_data=storage_entries(layout, [body for _, _, body, _ in gathered]),
    )
    write_metadata_file(writer, metadata)


def _needs_dcp(
    planner: LocalPlanSavePlanner, gathered: list[tuple[str, str, torch.Tensor, bool]]
) -> str:
    """Rank 0: why DCP's planning must save this state ('' if the local plans hold).

    Raises:
        RuntimeError: a rank failed otherwise (every rank raises it).
    """
    failures = [text for _, text, _, not_local in gathered if text and not not_local]
    if failures:
        raise RuntimeError("; ".join(failures))
    not_local = [text for _, text, _, flag in gathered if flag]
    if not_local:
        return not_local[0]
    layout = planner.layout
    assert layout is not None
    mine = bytes.fromhex(layout.digest)[:16].hex()
    differ = [r for r, (digest, _, _, _) in enumerate(gathered) if digest != mine]
    if differ:
        return (
            f"ranks {differ[:8]} hold another layout than rank 0 (the state's keys, shapes, "
            "dtypes or placements differ between ranks)"
        )
    return ""


def _save_with_dcp(state: dict[str, Any], checkpoint_id: Path, group: dist.ProcessGroup) -> None:
    """DCP's own save, its collectives on ``group``; its failures the same text everywhere."""
    try:
        dcp_save(
            state, checkpoint_id=checkpoint_id, planner=LoadableSavePlanner(), process_group=group
        )
    except CheckpointException as error:  # raised on every rank, the same failures
        raise RuntimeError(describe_dcp_failure(error, "save")) from None


def describe_dcp_failure(error: CheckpointException, what: str) -> str:
    """DCP's failures, one line per rank (its str is every rank's traceback)."""
    failures = error.failures.items()
    lines = [f"rank {r}: {type(e).__name__}: {first_sentence(str(e))}" for r, (e, _) in failures]
    return f"DCP failed to {what}: " + "; ".join(lines)
