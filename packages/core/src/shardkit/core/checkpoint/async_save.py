"""The background half of an asynchronous checkpoint: the save in a thread, then checksums.

``CheckpointManager.save(..., async_save=True)`` stages the state (``staging``) on
the training thread, then a thread of its own saves it (``local_plan.save``: planned by each rank
alone, DCP's files) while training goes on. When the write is done, the same thread hashes
this rank's share of the checkpoint's files, so that publishing it later costs the training
thread one small exchange of checksums.

Which thread talks to which ranks (see [Note: async checkpoint threads] in
``docs/notes/011-async-checkpoints.md``): the writer exchanges its results and the outcome
with the other ranks' writers through collectives. It does so on ``checkpoint_group()``, a
gloo group that nothing else uses, never on the default group: two threads issuing
collectives on one group can pair one rank's checkpoint message with another rank's training
collective. Everything
that publishes the checkpoint (sharing the outcome and the checksums, the barrier, the
rename) runs on the training thread, in ``CheckpointManager.wait()``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from shardkit.core.checkpoint.files import FileSum, checksum, list_files, share
from shardkit.core.checkpoint.local_plan.save import (
    LayoutCache,
    LocalPlanSavePlanner,
    save_planned_locally,
)
from shardkit.core.checkpoint.local_plan.save_results import Gathered
from shardkit.core.checkpoint.process_writer import WriterProcess
from shardkit.core.checkpoint.staging import StagingBuffers
from shardkit.core.errors import CheckpointSaveError
from shardkit.core.runtime.groups import checkpoint_group, global_rank, world_size
from shardkit.core.runtime.p2p.agreement import everyone

__all__ = ["PendingSave", "finish", "start"]

logger = logging.getLogger(__name__)

# The writer thread's niceness: the lowest CPU priority. Where training keeps every core busy
# (CPU training, one rank per core), the write then takes the cycles training leaves, waiting
# on its collectives, instead of stretching a step; where cores are free it runs at full speed.
_WRITER_NICENESS = 19


@dataclass(frozen=True, kw_only=True, slots=True)
class PendingSave:
    """A save whose files are being written in the background."""

    step: int
    partial: Path  # where DCP writes
    target: Path  # where the checkpoint goes once published
    started: float  # time.perf_counter() when the save began
    sums: Future[dict[str, FileSum]]  # this rank's share of the checksums, once written


def _deprioritize_this_thread() -> None:
    # On Linux, PRIO_PROCESS with a thread id sets that thread's niceness only.
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _WRITER_NICENESS)
    except (AttributeError, OSError) as error:  # not Linux, or not allowed: run as is
        logger.debug("checkpoint writer keeps its priority: %s", error)


def start(
    staged: dict[str, Any],
    *,
    step: int,
    partial: Path,
    target: Path,
    leave_out: frozenset[str],
    layouts: LayoutCache,
    process: tuple[WriterProcess, StagingBuffers] | None = None,
) -> PendingSave:
    """Begin writing ``staged`` into ``partial`` in the background (collective: every rank).

    The writer thread plans alone (``local_plan.save``: no collective until the files are written),
    writes, meets the other ranks' writers on ``checkpoint_group()`` for the results and the
    outcome, then hashes this rank's share of the files. With ``process`` (the writer child
    and the shared buffers ``staged`` lives in), the writing, rank 0's metadata and the hashes
    run in the child; the thread only plans, waits and meets the other ranks.
    """
    started = time.perf_counter()
    sums: Future[dict[str, FileSum]] = Future()
    group = checkpoint_group()  # made here, on the training thread, on every rank
    rank, world = global_rank(), world_size()
    if process is not None:
        process[0].ensure_started()  # on the training thread: see ensure_started

    def write() -> None:
        _deprioritize_this_thread()
        try:
            if process is None:
                save_planned_locally(staged, partial, layouts, group)
                names = share(list_files(partial, leave_out=leave_out), rank, world)
                sums.set_result({name: checksum(partial / name) for name in names})
                return
            child, buffers = process

            def write_items(
                _: FileSystemWriter, planner: LocalPlanSavePlanner, plan: SavePlan
            ) -> list[WriteResult]:
                child.share_buffers(buffers.buffers, buffers.generation)
                return child.write(partial, rank, plan, planner, buffers.buffers)

            def write_metadata(
                _: FileSystemWriter, planner: LocalPlanSavePlanner, gathered: Gathered
            ) -> None:
                child.write_metadata(partial, planner, gathered)

            save_planned_locally(
                staged,
                partial,
                layouts,
                group,
                write_items=write_items,
                write_metadata=write_metadata,
            )
            sums.set_result(child.checksums(partial, leave_out, rank, world))
        except Exception as error:
            sums.set_exception(error)

    threading.Thread(target=write, name="shardkit-checkpoint-writer", daemon=True).start()
    return PendingSave(step=step, partial=partial, target=target, started=started, sums=sums)


def finish(pending: PendingSave, current: Path | None) -> dict[str, FileSum]:
    """Wait for the write; every file's checksum, or the same error on every rank.

    Collective, on the training thread. ``current`` is the checkpoint that stays the latest
    if this one failed (named in the error).
    """

    def my_share() -> dict[str, FileSum]:
        return pending.sums.result()

    outcomes = everyone(my_share)
    failures = [
        f"rank {r}: {o.error_type}: {o.message}" for r, o in enumerate(outcomes) if o.failed
    ]
    if failures:
        stays = current.name if current is not None else "none"
        raise CheckpointSaveError(
            f"the asynchronous save of step {pending.step} into {pending.partial} failed and "
            f"was not published (the latest checkpoint is still {stays}): " + "; ".join(failures)
        )
    return {name: part[name] for o in outcomes for part in [o.value] for name in part}
