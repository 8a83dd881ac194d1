"""Checkpoint directories that an interrupted save or a corrupt file can never break.

Each save is a torch.distributed.checkpoint (DCP) save into a fresh hidden directory. Only
when every rank has finished does rank 0 mark it complete, with every file's size and
checksum, rename it into place and repoint ``latest`` (each an atomic rename). A save killed
part-way leaves a ``.step_N.partial`` directory that nothing loads, and the previous
checkpoint stays current. The newest ``keep`` checkpoints are kept.

Loading checks a checkpoint's files against their checksums before DCP reads any of them,
so a corrupt checkpoint is passed over with nothing loaded, and the ranks agree on which
checkpoint they load (``load_checks``: each rank lists and checks the candidates itself, and
one all-reduce of 24 bytes agrees on the verdict; messages travel only on a failure). A
checkpoint with the layout record is then planned by each rank alone (``local_plan.load``).

An asynchronous save (``save(..., async_save=True)``) stages the state into reused CPU
buffers, returns, and writes in the background (``async_save``). It is published, the
same way, by the next save, ``wait()`` or ``close()``; until then it is a ``.partial``
directory like any unfinished save.

Publishing a finished save (the marker with its checksums, the renames, the pruning, the
ordered deletes) is ``publish``'s: it needs nothing of DCP, the staging buffers or a pending
save.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
import weakref
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from shardkit.core.checkpoint import async_save as background
from shardkit.core.checkpoint.async_save import PendingSave
from shardkit.core.checkpoint.files import COMPLETE, FileSum
from shardkit.core.checkpoint.load_checks import load_first, no_checkpoint_loads
from shardkit.core.checkpoint.local_plan.layout_record import RECORD
from shardkit.core.checkpoint.local_plan.save import LayoutCache, save_planned_locally
from shardkit.core.checkpoint.process_writer import WriterProcess
from shardkit.core.checkpoint.publish import (
    DCP_METADATA,
    LATEST,
    MARKERS,
    checksums,
    publish,
    remove,
    step_of,
)
from shardkit.core.checkpoint.replica_reads import ReadCounts
from shardkit.core.checkpoint.staging import StagingBuffers
from shardkit.core.errors import (
    CheckpointLoadError,
    CheckpointSaveError,
    IncompleteCheckpointError,
)
from shardkit.core.runtime.groups import checkpoint_group
from shardkit.core.runtime.p2p.agreement import everyone, from_rank, raise_shared

__all__ = [
    "CheckpointLoadError",
    "CheckpointManager",
    "CheckpointSaveError",
    "IncompleteCheckpointError",
]

logger = logging.getLogger(__name__)


def _saved_by_torch(path: Path) -> bool:
    """Whether ``path`` is a checkpoint of torch's ``dcp.save``, not one of the manager's.

    A manager's save killed between its ``.metadata`` and its marker has the layout record
    (written before ``.metadata``): that one is incomplete, not torch's.
    """
    return (path / DCP_METADATA).is_file() and not (path / RECORD).is_file()


class CheckpointManager:
    """Numbered DCP checkpoints under ``root``: save, keep the newest, load the newest complete.

    Every method that touches the checkpoint is collective: call it on every rank.

    With asynchronous saves, call ``close()`` (or use the manager as a context manager) before
    the process group is destroyed: it publishes the last save. A save still pending at exit
    is never published, and a warning says so.

    Args:
        root: the directory that holds ``step_00000010/``, ``step_00000020/``, ``latest``.
        keep: how many complete checkpoints to keep (older ones are deleted after a save).
        writer: where asynchronous saves write: ``"thread"``, a thread of the training
            process; ``"process"``, a writer process per rank reading the staging buffers
            from shared memory (``process_writer``; see docs/checkpoints.md).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep: int = 2,
        writer: Literal["thread", "process"] = "thread",
    ) -> None:
        if keep < 1:
            raise ValueError(f"CheckpointManager keeps at least 1 checkpoint, got keep={keep}")
        if writer not in ("thread", "process"):
            raise ValueError(f"CheckpointManager's writer is 'thread' or 'process', got {writer!r}")
        self.root = Path(root)
        self.keep = keep
        self._pending: PendingSave | None = None
        # Allocated by the first asynchronous save; in shared memory for a writer process.
        self._staging = StagingBuffers(shared=writer == "process")
        self._writer_process = WriterProcess() if writer == "process" else None
        self._layouts = LayoutCache()  # the last save's plan, reused while the layout stays
        self.last_load_reads = ReadCounts()
        """What this rank read from storage, and received from its replicas, at the last load."""
        atexit.register(_warn_if_pending, weakref.ref(self))

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if kind is None:
            self.close()
        elif self._pending is not None:
            # This rank is failing, maybe alone: publishing takes collectives that the other
            # ranks may never join. Let the write end, unpublished.
            self._abandon()

    @property
    def pending(self) -> Path | None:
        """Where the save being written in the background will go, or None."""
        return self._pending.target if self._pending is not None else None

    @property
    def staging(self) -> StagingBuffers:
        """The CPU buffers that asynchronous saves copy the state into."""
        return self._staging

    def path_for(self, step: int) -> Path:
        """Where the checkpoint of ``step`` lives once complete."""
        return self.root / f"step_{step:08d}"

    def complete(self) -> list[Path]:
        """Every complete checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob("step_*") if (p / COMPLETE).is_file()]
        return sorted(found, key=step_of)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        pointer = self.root / LATEST
        if pointer.is_file():
            named = self.root / pointer.read_text().strip()
            if (named / COMPLETE).is_file():
                return named
            logger.warning("%s names %s, which is not complete; scanning", pointer, named)
        done = self.complete()
        return done[-1] if done else None

    def save(self, step: int, state: dict[str, Any], *, async_save: bool = False) -> Path:
        """Save ``state`` (DCP state: tensors, DTensors, ``Stateful`` objects) as ``step``.

        A save still pending is published first (``wait()``).

        Args:
            step: the step number; the checkpoint is ``path_for(step)``.
            state: what to save, as for ``torch.distributed.checkpoint.save``.
            async_save: copy ``state`` into the manager's CPU staging buffers and return;
                the files are written in the background while training goes on, and the
                checkpoint becomes current only at the next ``save()``, ``wait()`` or
                ``close()``. Training may change ``state`` as soon as this returns.

        Returns:
            Where the checkpoint is (or will be, once published).

        Raises:
            CheckpointSaveError: the pending asynchronous save failed, or this one could not
                be planned: a value that is not a tensor and that a load would refuse to
                unpickle (a class outside ``torch.load(weights_only=True)``'s allowlist; add it
                with ``torch.serialization.add_safe_globals``). On every rank.
        """
        self.wait()
        target = self.path_for(step)
        partial = self.root / f".{target.name}.partial"
        started = time.perf_counter()

        def prepare() -> None:
            self.root.mkdir(parents=True, exist_ok=True)
            remove(partial, ignore_errors=True)  # remains of an interrupted save

        # Rank 0 prepares, the others wait: its failure is theirs (see [Note: agreed loads]).
        from_rank(0, prepare, doing=f"prepare {partial}")
        if async_save:
            staged = self._stage(state)
            self._pending = background.start(
                staged,
                step=step,
                partial=partial,
                target=target,
                leave_out=MARKERS,
                layouts=self._layouts,
                process=(
                    (self._writer_process, self._staging)
                    if self._writer_process is not None
                    else None
                ),
            )
            logger.info(
                "staged %s in %.3f s; writing it in the background",
                target,
                time.perf_counter() - started,
            )
            return target
        try:
            # Planned by each rank alone; the outcome is every rank's once it returns (and
            # every rank's files are written by then).
            save_planned_locally(state, partial, self._layouts, checkpoint_group())
        except RuntimeError as error:  # raised on every rank, the same text
            raise CheckpointSaveError(f"the save of step {step} failed: {error}") from None
        files = checksums(partial)
        self._publish_on_rank0(step, partial, target, files)
        logger.info("saved %s in %.1f s", target, time.perf_counter() - started)
        return target

    def wait(self) -> Path | None:
        """Finish the pending asynchronous save and publish it; its path, or None if none.

        Collective. On failure every rank raises the same ``CheckpointSaveError`` and the
        previous checkpoint stays the latest.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        files = background.finish(pending, self.latest())
        self._publish_on_rank0(pending.step, pending.partial, pending.target, files)
        logger.info(
            "saved %s in %.1f s (asynchronous)",
            pending.target,
            time.perf_counter() - pending.started,
        )
        return pending.target

    def poll(self) -> Path | None:
        """Publish the pending save if every rank's write has finished; its path, else None.

        Collective (one small exchange while a save is pending, none otherwise): call it on
        every rank at the same point, once per step for example, so that a finished save
        becomes current without waiting for the next one.
        """
        if self._pending is None:
            return None
        sums = self._pending.sums
        if all(outcome.value for outcome in everyone(sums.done)):
            return self.wait()
        return None

    def close(self) -> None:
        """Publish the pending asynchronous save, if any (collective); end the writer process."""
        try:
            self.wait()
        finally:
            if self._writer_process is not None:
                self._writer_process.stop()

    @property
    def writer_pid(self) -> int | None:
        """The writer process's id (``writer="process"``, once a save started it), or None."""
        return self._writer_process.pid if self._writer_process is not None else None

    def _abandon(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.sums.exception()  # the write ends either way; its result is dropped
            logger.warning("the save of %s was abandoned, never published", pending.target)

    def _stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` copied into the staging buffers; any rank's failure raised on every rank."""
        staged: dict[str, Any] = {}

        def stage() -> None:
            staged.update(self._staging.stage(state))

        raise_shared(everyone(stage))
        return staged

    def _publish_on_rank0(
        self, step: int, partial: Path, target: Path, files: dict[str, FileSum]
    ) -> None:
        """Rank 0 publishes; nobody goes on before the checkpoint is current (collective).

        A failure (a full disk for the marker, a rename refused) is raised on every rank, with
        the previous checkpoint still the latest, instead of leaving the others waiting.
        """
        from_rank(
            0,
            lambda: publish(self.root, self.keep, step, partial, target, files),
            doing=f"publish {target}",
        )

    def load(
        self, state: dict[str, Any], path: str | os.PathLike[str] | None = None
    ) -> Path | None:
        """Load the newest complete checkpoint that loads on every rank (or ``path``) in place.

        A checkpoint whose files do not match the checksums recorded at save, or that DCP
        fails to load, is passed over with a warning that says why, for the one before it.
        Every rank loads the same one.

        ``path`` may also name a checkpoint that torch's ``dcp.save`` wrote (a ``.metadata``,
        no ``COMPLETE`` marker, no layout record): it loads through DCP's planning, its
        ``.metadata`` and values read without running pickled code; it has no checksums to
        check.

        Returns:
            The path loaded, or None if there is no complete checkpoint (a fresh start).

        Raises:
            IncompleteCheckpointError: ``path`` names a save that never finished.
            CheckpointLoadError: no candidate loads (``path`` when given); the message says
                why for each. Checkpoints found corrupt were never loaded from, so the state
                is as it was unless a load was attempted and failed (the message says so).
        """
        self.wait()  # a save in flight may become the newest
        if path is not None:
            chosen = Path(path)
            if not (chosen / COMPLETE).is_file() and not _saved_by_torch(chosen):
                alternatives = ", ".join(p.name for p in self.complete()) or "none"
                raise IncompleteCheckpointError(
                    f"checkpoint {chosen} is incomplete: its save was interrupted before every "
                    f"rank finished (no {COMPLETE} marker). Complete checkpoints here: "
                    f"{alternatives}"
                )
            candidates = [chosen]
        else:  # each rank lists them (no collective); verify agrees that they are the same
            candidates = self._newest_first()
        outcome = load_first(state, candidates)
        if outcome is None:  # the ranks see different checkpoints: rank 0's list, as before
            names: list[str] = from_rank(0, lambda: [str(p) for p in candidates])
            outcome = load_first(state, [Path(name) for name in names])
            assert outcome is not None, "the ranks walk rank 0's candidates"
        self.last_load_reads = outcome.reads
        if outcome.loaded is not None or not outcome.reasons:
            return outcome.loaded
        raise CheckpointLoadError(
            no_checkpoint_loads(self.root, outcome.reasons, outcome.attempted)
        )

    def _newest_first(self) -> list[Path]:
        """The complete checkpoints, ``latest``'s first, then the others newest first."""
        done = self.complete()[::-1]
        latest = self.latest()
        return [latest, *(p for p in done if p != latest)] if latest is not None else done


def _warn_if_pending(manager: weakref.ref[CheckpointManager]) -> None:
    alive = manager()
    if alive is not None and alive.pending is not None:
        logger.warning(
            "exiting with the save of %s still pending: it is not published. Call "
            "CheckpointManager.close() on every rank before destroying the process group",
            alive.pending,
        )
