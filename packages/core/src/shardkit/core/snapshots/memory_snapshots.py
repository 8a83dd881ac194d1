"""Memory snapshots: the training state in the node's shared memory, replicated to another node.

``MemorySnapshots`` copies each rank's state (shards, optimizer state, the loop's own state)
into slot files under ``/dev/shm`` after every step (or every ``every``), and a background
thread replicates each snapshot to the same local rank on the next node. When ``torchrun
--max-restarts`` starts the workers again, ``resume`` restores the newest step that every rank
holds, its own copy or its peer's replica, with no read from storage; without one it falls
back to the newest disk checkpoint of a ``CheckpointManager``. A kill costs the step in
flight, not a checkpoint interval. The pieces: ``contents`` (what a snapshot holds),
``format`` (its bytes and checks), ``slots`` (the files),
``writer`` (copy, checksum, replicate), ``restore`` (the agreed restore).
See [Note: memory snapshots] in ``docs/notes/021-memory-snapshots.md``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import torch

from shardkit.core.checkpoint.manager import CheckpointManager
from shardkit.core.runtime.groups import global_rank, is_distributed, snapshot_group, world_size
from shardkit.core.runtime.p2p.agreement import from_rank, raise_shared
from shardkit.core.snapshots.contents import Layout, Leaves, leaves_of
from shardkit.core.snapshots.device_staging import staging_device
from shardkit.core.snapshots.gradient_log import GradientLog, LogPlan
from shardkit.core.snapshots.restore import Restored, gathered, restore
from shardkit.core.snapshots.slots import SnapshotDirectory, Topology, default_directory
from shardkit.core.snapshots.writer import SnapshotWriter
from shardkit.core.snapshots.writer_plan import Replication, WriterPlan, header_capacity

__all__ = ["MemorySnapshots", "ResumePoint"]

logger = logging.getLogger(__name__)

_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True, kw_only=True, slots=True)
class ResumePoint:
    """Where ``MemorySnapshots.resume`` took the state from; the same on every rank."""

    source: Literal["memory", "disk", "none"]
    """A memory snapshot, a disk checkpoint, or nothing (a fresh start)."""
    step: int | None
    """The step the state is at now (None for a fresh start)."""
    path: Path | None = None
    """The disk checkpoint loaded, if that is the source."""
    from_replicas: tuple[int, ...] = ()
    """The ranks whose state came from a peer's replica (their own copy was gone or refused)."""
    refused: tuple[str, ...] = ()
    """Every snapshot refused, and why ("rank 0's own slot 1 (step 7): torn: ...")."""
    seconds: float = 0.0
    """How long the restore took on this rank."""


class MemorySnapshots:
    """Per-step snapshots in the node's shared memory, each replicated to a rank of the next node.

    Every method is called on every rank; ``snapshot`` at the same steps everywhere (its
    replicas pair up between ranks). Call ``close()`` at the end of training (or use the
    object as a context manager): it frees the shared memory. A rank that dies leaves its
    files for the restart that follows.

    Memory: each rank keeps ``slots`` snapshots of its own state and ``slots`` replicas of its
    source's, so about ``2 * slots`` times its share of parameters and optimizer state.

    Args:
        run_id: names the job (letters, digits, ``.``, ``_``, ``-``). A snapshot is restored
            only into the run that wrote it; torchrun's ``TORCHELASTIC_RUN_ID`` fits.
        directory: where this node's slot files go; default ``/dev/shm/shardkit-<run_id>``.
        every: take a snapshot every this many steps (``snapshot`` ignores the others).
        slots: how many of its own snapshots a rank keeps (at least 2: one being written, one
            complete), and how many replicas of its source's.
        replicate_every: replicate only the snapshots of steps that are a multiple of this
            (default: ``every``, each one). A multiple of ``every``; above it, every rank keeps
            one more slot, its own copy of the newest replicated step. Then a killed process
            still costs at most one step, and a lost node's memory up to ``replicate_every``
            steps (the job goes back to the newest replicated step); the replicas' traffic is
            divided by ``replicate_every / every``.
        ranks_per_node: ranks on each node, consecutive; a rank's replica goes to the same
            local rank on the next node. Default: torchrun's ``LOCAL_WORLD_SIZE``, else the
            world size (one node: no replicas).
        optimizer: with ``replicate_every`` above ``every`` (which must be 1), the steps
            between two replicated ones send the peer a log entry instead of nothing: the
            gradients this optimizer consumed (taken by a step pre-hook), its groups' values,
            and the tensors it does not produce (``gradient_log``). A lost node's ranks then
            replay from the newest replicated step with this optimizer, so a lost node also
            costs at most one step, for about a third of the bytes of replicating every step
            (fp32 AdamW). The optimizer must be the one the state's optimizer state is of,
            and its ``step()`` local to the rank (no collective: SGD, Adam, AdamW ...); a
            replay that does not reproduce the step's checksums is refused, and an older
            step is restored.
    """

    def __init__(
        self,
        run_id: str,
        *,
        directory: str | os.PathLike[str] | None = None,
        every: int = 1,
        slots: int = 2,
        ranks_per_node: int | None = None,
        replicate_every: int | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        if not _RUN_ID.fullmatch(run_id):
            raise ValueError(f"MemorySnapshots: run_id {run_id!r} must be [A-Za-z0-9._-]+")
        if every < 1 or slots < 2:
            raise ValueError(
                f"MemorySnapshots needs every >= 1 and slots >= 2, got {every}, {slots}"
            )
        if ranks_per_node is not None and ranks_per_node < 1:
            raise ValueError(f"MemorySnapshots: ranks_per_node={ranks_per_node} must be >= 1")
        replicate_every = every if replicate_every is None else replicate_every
        if replicate_every < every or replicate_every % every:
            raise ValueError(
                f"MemorySnapshots: replicate_every={replicate_every} must be a multiple of "
                f"every={every}"
            )
        if optimizer is not None and replicate_every > every and every != 1:
            raise ValueError(
                f"MemorySnapshots: the gradient log (optimizer=) needs a snapshot every step, "
                f"got every={every}"
            )
        self.run_id, self.every, self.slots = run_id, every, slots
        self.replicate_every = replicate_every
        self.root = Path(directory) if directory is not None else default_directory(run_id)
        self._ranks_per_node = ranks_per_node
        self._writer: SnapshotWriter | None = None
        # Hooked now, so that its steps are taken from the first snapshot's next step on.
        self._log = GradientLog(optimizer) if optimizer and replicate_every > every else None

    def __enter__(self) -> MemorySnapshots:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if kind is None:
            self.close()
        # On an error the snapshots stay: they are what a restart restores from.

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory this rank's slots take (0 before the first snapshot)."""
        return self._writer.nbytes if self._writer is not None else 0

    def topology(self) -> Topology:
        """This rank, the world and the nodes, as the snapshots see them."""
        rank, world = (global_rank(), world_size()) if is_distributed() else (0, 1)
        per_node = self._ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if world % per_node != 0:
            raise ValueError(
                f"MemorySnapshots: {per_node} ranks per node do not divide the world size {world}"
            )
        return Topology(self.run_id, rank, world, per_node)

    def snapshot(self, step: int, state: Mapping[str, Any]) -> None:
        """Copy ``state`` (as ``CheckpointManager.save`` takes it) into shared memory as ``step``.

        Returns once the copy is made; checksums, the header and the replica to the peer follow
        in the background. Steps that are not a multiple of ``every`` are skipped. The first
        call is collective (it allocates the slots and learns the source's sizes).

        Raises:
            SnapshotError: the previous snapshot failed in the background, or the state's
                tensors changed since the first snapshot.
            TypeError: a value of the state is neither a tensor nor a JSON value.
        """
        if step % self.every != 0:
            return
        leaves = leaves_of(state)
        if self._writer is None:
            self._writer = self._start(leaves)
        self._writer.write(step, leaves)

    def wait(self) -> None:
        """Wait until the snapshot in flight is complete here and at the peer."""
        if self._writer is not None:
            self._writer.wait()

    def restore(self, state: dict[str, Any], *, not_before: int = 0) -> Restored:
        """Restore ``state`` from the newest step every rank holds, at least ``not_before``.

        Collective. Every snapshot is checked before it is trusted, and the ranks agree on the
        step before any rank writes (see ``restore``); refusals are logged on every
        rank. ``Restored.step`` is None, and the state untouched, if none fits.
        """
        if self._writer is not None:
            raise RuntimeError("MemorySnapshots.restore: call it before the first snapshot")
        if is_distributed():
            snapshot_group()  # made here, on the training thread, by every rank
        topology = self.topology()
        restored = restore(state, self._directory(topology), topology, not_before, self._log)
        for reason in restored.refused:
            logger.warning("memory snapshot refused: %s", reason)
        return restored

    def resume(
        self, state: dict[str, Any], checkpoints: CheckpointManager | None = None
    ) -> ResumePoint:
        """Resume ``state`` from memory, else from ``checkpoints``' newest disk checkpoint.

        The memory snapshot is taken when every rank holds one at least as new as the newest
        disk checkpoint. Otherwise ``checkpoints.load(state)`` loads from disk, and every
        snapshot of this run is discarded (none is newer than the state now).

        Returns:
            Where the state came from; ``source="none"`` when there was nothing (a fresh start).
        """
        started = time.perf_counter()
        disk_step = _disk_step(checkpoints)
        restored = self.restore(state, not_before=disk_step)
        if restored.step is not None:
            seconds = time.perf_counter() - started
            logger.info("restored step %d from memory in %.3f s", restored.step, seconds)
            return ResumePoint(
                source="memory",
                step=restored.step,
                from_replicas=restored.from_replicas,
                refused=restored.refused,
                seconds=seconds,
            )
        path = checkpoints.load(state) if checkpoints is not None else None
        self._discard(self.topology())
        return ResumePoint(
            source="disk" if path is not None else "none",
            step=_step_of(path) if path is not None else None,
            path=path,
            refused=restored.refused,
            seconds=time.perf_counter() - started,
        )

    def close(self, *, remove: bool = True) -> None:
        """Finish the snapshot in flight, stop the background thread, free the shared memory.

        Args:
            remove: delete this rank's slot files (False keeps them, for a restart to find).
        """
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
        if self._log is not None:
            self._log.close()
        if remove:
            self._discard(self.topology())

    def _directory(self, topology: Topology) -> SnapshotDirectory:
        return SnapshotDirectory(self.root, topology.rank)

    def _start(self, leaves: Leaves) -> SnapshotWriter:
        """Allocate the slots and a GPU state's device buffer, learn the source's (collective)."""
        layout = Layout.of(leaves)
        staging_on = staging_device(layout, leaves)
        topology = self.topology()
        capacity = header_capacity(topology, layout, leaves.values)
        if is_distributed():
            snapshot_group()
        log = self._log if topology.replicated else None
        log_sizes = [0, 0]
        if log is not None:
            plan = LogPlan.of(layout, leaves, log.optimizer)
            log.start(plan, topology, layout, leaves.values, staging_on)
            log_sizes = [log.capacity, log.data_bytes]
        sizes = raise_shared(gathered(lambda: [capacity, layout.data_bytes, *log_sizes]))
        if len({bool(size[2]) for size in sizes}) > 1:
            raise ValueError("MemorySnapshots: optimizer= was given on some ranks only")
        replication = None
        if topology.replicated:
            source = topology.source(topology.rank)
            replication = Replication(topology.peer(topology.rank), source, *sizes[source])

        # Without a peer (one node) nothing is replicated, so no slot is pinned for it.
        replicate_every = self.replicate_every if replication is not None else self.every

        def allocate() -> SnapshotWriter:
            plan = WriterPlan(
                topology=topology,
                layout=layout,
                capacity=capacity,
                slots=self.slots + (replicate_every > self.every),
                replication=replication,
                staging_on=staging_on,
                replica_slots=self.slots,
                replicate_every=replicate_every,
            )
            return SnapshotWriter(plan, self._directory(topology), log)

        made: list[SnapshotWriter] = []
        raise_shared(gathered(lambda: made.append(allocate())))
        logger.info(
            "memory snapshots every %d step(s) in %s: %d slots, %.1f MiB of shared memory%s",
            self.every,
            self.root,
            self.slots,
            made[0].nbytes / 2**20,
            f", replicated to rank {replication.peer} every {self.replicate_every} step(s)"
            if replication
            else " (not replicated)",
        )
        return made[0]

    def _discard(self, topology: Topology) -> None:
        """Remove this rank's slot files (own, and the replicas it holds)."""
        directory = self._directory(topology)
        files = [path for _, path in directory.own_files()]
        if topology.replicated:
            files += directory.held_files(topology.source(topology.rank))
        for path in files:
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # the last rank of the node to leave removes it
            self.root.rmdir()


def _disk_step(checkpoints: CheckpointManager | None) -> int:
    """The newest disk checkpoint's step, as rank 0 sees it (0 if none)."""
    if checkpoints is None:
        return 0

    def newest() -> int:
        latest = checkpoints.latest()
        return _step_of(latest) if latest is not None else 0

    step: int = from_rank(0, newest) if is_distributed() else newest()
    return step


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_"))
