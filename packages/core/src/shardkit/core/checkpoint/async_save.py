"""The background half of an asynchronous checkpoint: DCP's async save, then checksums.

``CheckpointManager.save(..., async_save=True)`` stages the state (``staging``) on
the training thread, then hands it to ``torch.distributed.checkpoint.async_save``, which writes
it from a thread of its own while training goes on. When the write is done, the same thread
hashes this rank's share of the checkpoint's files, so that publishing it later costs the
training thread one small exchange of checksums.

Which thread talks to which ranks (see [Note: async checkpoint threads] in
``docs/notes/011-async-checkpoints.md``): DCP's writer exchanges plans and results with the
other ranks through collectives. It does so on ``checkpoint_group()``, a gloo group that
nothing else uses, never on the default group: two threads issuing collectives on one group
can pair one rank's checkpoint message with another rank's training collective. Everything
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

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import async_save

from shardkit.core.checkpoint.dcp_reading import LoadableSavePlanner
from shardkit.core.checkpoint.files import FileSum, checksum, list_files, share
from shardkit.core.errors import first_sentence
from shardkit.core.runtime.agreement import everyone
from shardkit.core.runtime.groups import checkpoint_group, global_rank, world_size

__all__ = ["CheckpointSaveError", "PendingSave", "describe_dcp_failure", "finish", "start"]

logger = logging.getLogger(__name__)

# The writer thread's niceness: the lowest CPU priority. Where training keeps every core busy
# (CPU training, one rank per core), the write then takes the cycles training leaves, waiting
# on its collectives, instead of stretching a step; where cores are free it runs at full speed.
_WRITER_NICENESS = 19


class CheckpointSaveError(RuntimeError):
    """A save failed and was not published; the message says why, per rank.

    An asynchronous save's writing, or any save's planning (a value the safe reader could not
    read back: ``dcp_reading.LoadableSavePlanner``).
    """


@dataclass(frozen=True, kw_only=True, slots=True)
class PendingSave:
    """A save whose files are being written in the background."""

    step: int
    partial: Path  # where DCP writes
    target: Path  # where the checkpoint goes once published
    started: float  # time.perf_counter() when the save began
    sums: Future[dict[str, FileSum]]  # this rank's share of the checksums, once written


class _AlreadyStaged(AsyncStager):
    """Hands async_save a state that is staged already (into the manager's reused buffers)."""

    # Staging finished before async_save was called: nothing to wait for after it returns.
    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        return None  # nothing in flight: the copy was made before async_save

    def close(self) -> None:
        return None  # the buffers belong to the manager and outlive this save


class _BackgroundPlanner(LoadableSavePlanner):
    """The manager's save plan, set up from the writer thread, which it first deprioritizes.

    DCP calls ``set_up_planner`` at the start of the save, in the thread that writes (the
    planner is DCP's extension point for what happens there).
    """

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        _deprioritize_this_thread()
        super().set_up_planner(state_dict, storage_meta, is_coordinator)


def _deprioritize_this_thread() -> None:
    # On Linux, PRIO_PROCESS with a thread id sets that thread's niceness only.
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _WRITER_NICENESS)
    except (AttributeError, OSError) as error:  # not Linux, or not allowed: run as is
        logger.debug("checkpoint writer keeps its priority: %s", error)


def start(
    staged: dict[str, Any], *, step: int, partial: Path, target: Path, leave_out: frozenset[str]
) -> PendingSave:
    """Begin writing ``staged`` into ``partial`` in the background (collective: every rank)."""
    started = time.perf_counter()
    sums: Future[dict[str, FileSum]] = Future()
    upload = async_save(
        staged,
        checkpoint_id=partial,
        process_group=checkpoint_group(),
        planner=_BackgroundPlanner(),
        async_stager=_AlreadyStaged(),
    )
    assert isinstance(upload, Future), "an already staged state gives a plain future"

    def hash_my_share(written: Future[Any]) -> None:
        # Runs in DCP's writer thread once the write ended: DCP's last collective has told
        # every rank that every file, the metadata included, is in place.
        try:
            written.result()
            names = share(list_files(partial, leave_out=leave_out), global_rank(), world_size())
            sums.set_result({name: checksum(partial / name) for name in names})
        except CheckpointException as error:  # a BaseException: `except Exception` misses it
            sums.set_exception(RuntimeError(describe_dcp_failure(error, "save")))
        except Exception as error:
            sums.set_exception(error)

    upload.add_done_callback(hash_my_share)
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


def describe_dcp_failure(error: CheckpointException, what: str) -> str:
    """DCP's failures, one line per rank (its str is every rank's traceback)."""
    failures = error.failures.items()
    lines = [f"rank {r}: {type(e).__name__}: {first_sentence(str(e))}" for r, (e, _) in failures]
    return f"DCP failed to {what}: " + "; ".join(lines)
