"""Writing memory snapshots: the copy on the training thread, the rest on a thread of its own.

After a step, the training thread copies the state's tensors into the next slot of the node's
shared memory (a memory copy) and returns; an accelerator's state is staged on its device
instead and moved to the slot by the background thread (``device_staging``). A background
thread then checksums the bytes (a GPU's share on several threads),
writes the header, marks the slot complete, and replicates it: it sends the snapshot to this
rank's peer on the next node while it receives its source's into a replica slot. Each rank's
thread does the same at the same steps, so the transfers pair up.

At most one snapshot is in flight: the next one waits for it before it overwrites anything. A
kill at any point therefore leaves the snapshot of the step before complete, here and at the
peer, and loses at most the step in flight. Where only every ``replicate_every``-th snapshot is
replicated (a network that cannot carry a rank's share every step), each rank keeps its own
copy of the newest replicated step in a slot the rotation skips: a lost node's ranks restore
that step from their replicas, and every other rank from that slot. See [Note: memory
snapshots].
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from shardkit.core.runtime.groups import SNAPSHOT_NICENESS, lower_thread_priority
from shardkit.core.runtime.p2p.peer_transfer import Message, transfer
from shardkit.core.snapshots.checksum import PARALLEL_BYTES, checksums_of
from shardkit.core.snapshots.contents import JSONValue, Layout, Leaves
from shardkit.core.snapshots.device_staging import DeviceStaging
from shardkit.core.snapshots.format import (
    Header,
    SnapshotError,
    layout_json_of,
    peek_step,
)
from shardkit.core.snapshots.gradient_log import GradientLog, LogEntry
from shardkit.core.snapshots.slots import SlotFile, SnapshotDirectory, Topology
from shardkit.core.snapshots.state_copy import FitCheck, SlotCopier
from shardkit.core.snapshots.writer_plan import WriterPlan

__all__ = ["SnapshotWriter"]

logger = logging.getLogger(__name__)


class _Worker:
    """One daemon thread that runs jobs in order: it never holds up the interpreter's exit.

    It runs at ``SNAPSHOT_NICENESS``, as the snapshot group's gloo threads do.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], Future[None]] | None]
        self._jobs = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> Future[None]:
        done: Future[None] = Future()
        self._jobs.put((job, done))
        return done

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        _lower_this_thread()
        while (item := self._jobs.get()) is not None:
            job, done = item
            try:
                job()
                done.set_result(None)
            except BaseException as error:  # reported to the training thread, which raises
                done.set_exception(error)


@dataclass(frozen=True, slots=True)
class _SlotFiles:
    """The shared-memory files a writer holds: its own slots, its source's replicas and log."""

    own: list[SlotFile]
    replicas: list[SlotFile]
    logs: list[SlotFile]

    @staticmethod
    def create(plan: WriterPlan, directory: SnapshotDirectory, *, logged: bool) -> _SlotFiles:
        """Make (or map again, after a restart) every slot file of ``plan`` in ``directory``."""
        directory.prepare()
        data_bytes = plan.layout.data_bytes
        own = [
            SlotFile.create(directory.own(k), capacity=plan.capacity, data_bytes=data_bytes)
            for k in range(plan.slots)
        ]
        replication = plan.replication
        if replication is None:
            return _SlotFiles(own, [], [])
        replicas = [
            SlotFile.create(
                directory.replica(replication.source, k),
                capacity=replication.source_capacity,
                data_bytes=replication.source_data_bytes,
            )
            for k in range(plan.replica_count)
        ]
        logs = [  # one for each step between two replicated ones
            SlotFile.create(
                directory.log(replication.source, k),
                capacity=replication.source_log_capacity,
                data_bytes=replication.source_log_bytes,
            )
            for k in range(plan.replicate_every - 1 if logged else 0)
        ]
        return _SlotFiles(own, replicas, logs)


class SnapshotWriter:
    """Writes one rank's snapshots into its slots and replicates them to its peer."""

    def __init__(
        self, plan: WriterPlan, directory: SnapshotDirectory, log: GradientLog | None = None
    ) -> None:
        """Make the slots of ``plan`` in ``directory``, and take ``log``'s entries (if any).

        ``log``: the steps between two replicated ones send a log entry (``gradient_log``);
        with no replication it is not used.
        """
        topology, layout, replication = plan.topology, plan.layout, plan.replication
        replicate_every = plan.replicate_every
        self.topology, self.layout, self.replication = topology, layout, replication
        self._layout_json = layout_json_of(layout)  # every header repeats it
        self._log = log if replication is not None else None
        files = _SlotFiles.create(plan, directory, logged=self._log is not None)
        self._own, self._replicas = files.own, files.replicas
        self._logs = files.logs  # the source's log entries, by step after its base
        self._base = -1  # the newest replicated step: log entries follow it
        # Each tensor's place in each slot, made once: a snapshot every step copies into them.
        self._views: list[list[torch.Tensor]] = [
            [entry.view(slot.data()) for entry in layout.entries] for slot in self._own
        ]
        self._copier = SlotCopier(layout)
        self._fits = FitCheck(layout)  # the state at each snapshot against the first's layout
        self._replicate_every = replicate_every
        # The first snapshot is replicated whatever its step (every rank's writer starts at the
        # same step, so the exchanges still pair): after a restart, a replica of a step after
        # it exists from then on, whatever became of the exchange in flight at the kill.
        self._replicated_any = False
        # The step each own slot holds (-1: none complete), and the slot of the newest step
        # whose replica was sent: a lost node's ranks restore from replicas of that step, so
        # every rank keeps its own copy of it until the next one is replicated.
        self._steps = [_step_in(slot) for slot in self._own]
        replicated = [
            k for k, step in enumerate(self._steps) if step >= 0 and step % replicate_every == 0
        ]
        self._pinned = max(replicated, key=lambda k: self._steps[k], default=None)
        self._next_replica = _oldest(self._replicas)
        self._in_flight: Future[None] | None = None
        self._worker = _Worker(f"shardkit-snapshots-rank{topology.rank}")
        # A share this large is summed on this node's fair part of its cores (a GPU node's
        # host cores are mostly idle); the demo's few megabytes stay on the one thread.
        self._pieces = _cores_per_rank(topology)
        self._summers: ThreadPoolExecutor | None = None
        if layout.data_bytes >= PARALLEL_BYTES and self._pieces > 1:
            self._summers = ThreadPoolExecutor(
                self._pieces, "shardkit-snapshot-sums", initializer=_lower_this_thread
            )
        self._staging: DeviceStaging | None = None
        if plan.staging_on is not None:  # bounce buffers for the copying threads, and one more
            depth = self._pieces + 1 if self._summers is not None else 1
            self._staging = DeviceStaging(layout, plan.staging_on, depth=depth)

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory this rank's slots take (own and replicas)."""
        return sum(slot.raw.numel() for slot in self.files())

    def write(self, step: int, leaves: Leaves) -> None:
        """Copy ``leaves`` into the next slot; the rest happens in the background.

        Raises:
            SnapshotError: the snapshot before this one failed (its error), or the state's
                tensors are not those of the first snapshot.
        """
        self.wait()
        entry = self._log.take() if self._log is not None else None
        # A step too far after the base for a log slot (snapshots skipped) is replicated in
        # full; every rank sees the same steps, so the exchanges still pair.
        replicate = (
            step % self._replicate_every == 0
            or not self._replicated_any
            or (entry is not None and step - self._base > len(self._logs))
        )
        if not self._fits(leaves):
            raise SnapshotError(
                f"memory snapshot of step {step}: the state's tensors changed since the first "
                f"snapshot ({Layout.of(leaves).first_difference(self.layout) or 'their layout'})"
            )
        free = [k for k in range(len(self._own)) if k != self._pinned]
        index = min(free, key=lambda k: self._steps[k])  # the oldest slot not pinned
        slot = self._own[index]
        slot.mark_writing()
        self._steps[index] = -1  # torn, and so the next one written, if the copy raises
        if self._staging is not None:
            self._staging.stage(leaves)  # launched on the device; moved to the slot below
        else:
            self._copier.copy(slot.data(), self._views[index], leaves)
        values = dict(leaves.values)  # plain values: immutable, safe to hand to the thread
        replica, logged = None, None
        if self._replicas and replicate:
            replica = self._replicas[self._next_replica]
            self._next_replica = (self._next_replica + 1) % len(self._replicas)
        elif entry is not None and self._logs:
            logged = _Logged(entry, self._logs[step - self._base - 1], self._base)
        self._in_flight = self._worker.submit(
            lambda: self._finish(step, slot, replica, values, logged)
        )
        self._steps[index] = step
        if replicate:
            self._pinned, self._replicated_any, self._base = index, True, step

    def wait(self) -> None:
        """Wait for the snapshot in flight; raise its error if it failed."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return
        try:
            in_flight.result()
        except Exception as error:
            raise SnapshotError(
                f"rank {self.topology.rank}: the memory snapshot in flight failed: "
                f"{type(error).__name__}: {error}"
            ) from error

    def close(self) -> None:
        """Wait for the snapshot in flight, then stop the thread."""
        try:
            self.wait()
        finally:
            self._worker.stop()
            if self._summers is not None:
                self._summers.shutdown()

    def files(self) -> list[SlotFile]:
        """Every slot file of this rank, own and replicas."""
        return self._own + self._replicas + self._logs

    def _finish(
        self,
        step: int,
        slot: SlotFile,
        replica: SlotFile | None,
        values: dict[str, JSONValue],
        logged: _Logged | None,
    ) -> None:
        data = slot.data()
        if self._staging is not None:  # summed chunk by chunk as it lands
            sums = self._staging.to_host(data, self._summers)
        else:
            sums = checksums_of(data, self._summers, self._pieces)
        who = self.topology
        header = Header(who.run_id, who.world_size, who.rank, step, self.layout, sums, values)
        slot.write_header(header.to_json(self._layout_json))
        slot.mark_complete()
        if self.replication is None:
            return
        if logged is not None and self._log is not None:  # this step's log entry, not all of it
            span = self._log.finish(logged.entry, header, data, logged.base)
            logged.held.mark_writing()
            transfer(
                sends=[Message(span, self.replication.peer)],
                receives=[Message(logged.held.span(), self.replication.source)],
            )
            logged.held.mark_complete()
        if replica is None:
            return
        replica.mark_writing()
        # Header and data in one message each way, straight from the slot into the replica
        # slot: no staging copy, and the fewest calls that give up the GIL and wait to get it
        # back (the checksums travel in the header: the holder never computes them).
        transfer(
            sends=[Message(slot.span(), self.replication.peer)],
            receives=[Message(replica.span(), self.replication.source)],
        )
        replica.mark_complete()


@dataclass(frozen=True, slots=True)
class _Logged:
    """A step's log entry: what goes to the peer, and the slot that takes the source's."""

    entry: LogEntry
    held: SlotFile
    base: int


def _lower_this_thread() -> None:
    lower_thread_priority(threading.get_native_id(), SNAPSHOT_NICENESS)


def _cores_per_rank(topology: Topology) -> int:
    """This rank's fair share of its node's cores (at most 8).

    A process bound to some cores (a launcher's NUMA or core binding) has those to itself;
    otherwise the node's cores are shared by its ranks.
    """
    machine = os.cpu_count() or 1
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else machine
    share = allowed if allowed < machine else machine // topology.ranks_per_node
    return max(1, min(8, share))


def _oldest(slots: list[SlotFile]) -> int:
    """The slot to write first: one that holds no complete snapshot, else the oldest step's."""
    steps = [_step_in(slot) for slot in slots]
    return min(range(len(slots)), key=lambda k: steps[k], default=0)


def _step_in(slot: SlotFile) -> int:
    """The step of the complete snapshot in ``slot``, or -1."""
    step = peek_step(slot.raw)
    return -1 if step is None else step
