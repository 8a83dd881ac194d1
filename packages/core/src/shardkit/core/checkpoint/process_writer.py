"""A rank's checkpoint writer in a process of its own: serialization, file I/O, fsync, hashes.

With ``CheckpointManager(root, writer="process")`` an asynchronous save still plans and meets
the other ranks in the training process (``local_plan.save``: the plan, cached per layout, the
gather of results and the outcome, on ``checkpoint_group()``), but the work that holds the
GIL or the disk goes to one long-lived child per rank:

- the child gets the staging buffers once (they live in shared memory, ``staging``), and again
  only when a save re-allocated one;
- per save, the parent sends this rank's write items, which buffer backs each item and the
  few small values already serialized; the child writes DCP's files with DCP's writer and
  sends back DCP's write results;
- rank 0's child builds and writes ``.metadata`` from the layout (sent once per layout) and
  every rank's result rows (sent per save): the pickle of a large world's metadata stays out
  of the training process;
- then the child hashes this rank's share of the files.

Only our own dataclasses cross the pipe, between a process and the child it started.

The child dies with its parent: ``PR_SET_PDEATHSIG`` on Linux (SIGKILL when the parent goes,
even while the child is in the middle of a write) and, everywhere, the end of its pipe. It
writes only into the ``.step_N.partial`` directory it was given, which is published (renamed)
only after every rank's child reported its files written, and which the next save of that
step removes first. A child that dies or fails fails the save on every rank (the gather's
failure flag); the next save starts a new child.

A child that hangs without dying (stopped, or blocked on a pipe or a stuck file system) is
bounded too: every request (a write, rank 0's metadata, the hashes) must be answered within
``bound_s`` seconds (``SHARDKIT_CHECKPOINT_WRITER_BOUND_S``, default 1,800 s: far beyond a
healthy rank's share of a save), sending and receiving included; a new child's first request
has :data:`START_S` more, for its start (a Python interpreter importing torch). Past it the
child is
killed and the request fails with a :class:`WriterProcessError` naming the bound, which fails
the save on every rank with the same error, as a dead child's does.
"""

from __future__ import annotations

import ctypes
import io
import logging
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as torch_mp
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor

from shardkit.core.checkpoint.files import FileSum, checksum, list_files, share
from shardkit.core.checkpoint.local_plan.chunk_writers import SaveLayout
from shardkit.core.checkpoint.local_plan.save import LocalPlanSavePlanner, cut_rows
from shardkit.core.checkpoint.local_plan.save_results import (
    Gathered,
    storage_entries,
    write_metadata_file,
)
from shardkit.core.errors import WriterProcessError

__all__ = [
    "BOUND_VARIABLE",
    "DEFAULT_BOUND_S",
    "START_S",
    "WriterProcess",
    "WriterProcessError",
    "writer_bound_s",
]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>

BOUND_VARIABLE = "SHARDKIT_CHECKPOINT_WRITER_BOUND_S"
DEFAULT_BOUND_S = 1800.0
START_S = 300.0
"""What a new child's first request may take beyond the bound: the child's start."""


def writer_bound_s() -> float:
    """The bound on a writer request, seconds: ``SHARDKIT_CHECKPOINT_WRITER_BOUND_S`` or 1,800.

    Raises:
        ValueError: the variable is set to something other than a positive number.
    """
    text = os.environ.get(BOUND_VARIABLE, "")
    if not text:
        return DEFAULT_BOUND_S
    try:
        bound = float(text)
    except ValueError:
        bound = float("nan")
    if not bound > 0:
        raise ValueError(f"{BOUND_VARIABLE} must be a positive number of seconds, got {text!r}")
    return bound


@dataclass(frozen=True, slots=True)
class _Buffers:
    buffers: dict[str, torch.Tensor]  # shared memory: the child maps the same pages


@dataclass(frozen=True, slots=True)
class _Write:
    partial: Path
    rank: int
    plan: SavePlan
    buffer_of: dict[str, str]  # a tensor item's fqn -> its staging buffer's key
    serialized: dict[str, bytes]  # a byte item's fqn -> its bytes, serialized by the parent
    rows: dict[str, tuple[int, int]]  # a tensor item written as a row piece: its rows


@dataclass(frozen=True, slots=True)
class _Layout:
    layout: SaveLayout
    mappings: Any  # the planner's flattening mappings, as DCP keeps them in .metadata


@dataclass(frozen=True, slots=True)
class _Metadata:
    partial: Path
    bodies: list[torch.Tensor]  # every rank's result rows, in rank order


@dataclass(frozen=True, slots=True)
class _Checksums:
    partial: Path
    leave_out: frozenset[str]
    rank: int
    world_size: int


@dataclass(frozen=True, slots=True)
class _Failed:
    message: str


class _BufferPlanner:
    """What DCP's writer asks a planner for: each item's data, from the shared buffers."""

    def __init__(self, buffers: Mapping[str, torch.Tensor], job: _Write) -> None:
        self._buffers, self._job = buffers, job

    def resolve_data(self, item: WriteItem) -> torch.Tensor | io.BytesIO:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self._job.serialized[fqn])
        return cut_rows(self._buffers[self._job.buffer_of[fqn]], self._job.rows.get(fqn))


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent:  # the parent died before the prctl above
        os._exit(1)


def _serve(connection: multiprocessing.connection.Connection, parent: int) -> None:
    """The child's loop: one reply per request until the pipe ends."""
    _die_with_parent(parent)
    torch.set_num_threads(1)  # the write is I/O and pickling: leave the cores to training
    try:
        # The lowest CPU priority, as the writer thread has (async_save): where training keeps
        # every core busy the write takes the cycles training leaves instead of a step's.
        os.nice(19)
    except OSError as error:
        logger.debug("checkpoint writer process keeps its priority: %s", error)
    buffers: dict[str, torch.Tensor] = {}
    layout: _Layout | None = None
    while True:
        try:
            request = connection.recv()
        except (EOFError, OSError):
            return  # the parent closed the pipe or died
        try:
            reply: Any = None
            if isinstance(request, _Buffers):
                buffers = request.buffers
            elif isinstance(request, _Write):
                writer = FileSystemWriter(request.partial)
                writer.set_up_storage_writer(request.rank == 0, rank=request.rank)
                future = writer.write_data(request.plan, _BufferPlanner(buffers, request))  # type: ignore[arg-type]
                future.wait()
                reply = future.value()
            elif isinstance(request, _Layout):
                layout = request
            elif isinstance(request, _Metadata):
                if layout is None:
                    raise WriterProcessError("asked for metadata before any layout")
                metadata = Metadata(
                    state_dict_metadata=layout.layout.state_dict_metadata(),
                    planner_data=layout.mappings,
                    storage_data=storage_entries(layout.layout, request.bodies),
                )
                write_metadata_file(FileSystemWriter(request.partial), metadata)
            elif isinstance(request, _Checksums):
                files = list_files(request.partial, leave_out=request.leave_out)
                names = share(files, request.rank, request.world_size)
                reply = {name: checksum(request.partial / name) for name in names}
            else:
                raise WriterProcessError(f"unknown request {type(request).__name__}")
        except Exception as error:
            reply = _Failed(f"{type(error).__name__}: {error}")
        connection.send(reply)


class WriterProcess:
    """This rank's writer child, started when first needed and again after it died."""

    def __init__(self, bound_s: float | None = None) -> None:
        """``bound_s``: the bound on each request (None: :func:`writer_bound_s`)."""
        self.bound_s = bound_s if bound_s is not None else writer_bound_s()
        self._starting = False
        self._allowed = self.bound_s
        self._process: Any = None
        self._connection: multiprocessing.connection.Connection | None = None
        self._generation = -1  # the staging buffers' generation the child holds
        self._layout_digest = ""  # the layout the child holds (rank 0)

    @property
    def pid(self) -> int | None:
        """The child's process id, while one runs."""
        return self._process.pid if self._process is not None else None

    def ensure_started(self) -> None:
        """Start the child if none runs.

        Call it from the thread that lives as long as training: on Linux the child is killed
        when the thread that started it ends (``PR_SET_PDEATHSIG`` follows the thread).
        """
        if self._process is not None and self._process.is_alive():
            return
        self.stop()
        context = torch_mp.get_context("spawn")
        mine, theirs = context.Pipe()
        process = context.Process(
            target=_serve, args=(theirs, os.getpid()), name="shardkit-checkpoint-writer"
        )
        process.daemon = False  # a daemon may not start children; PDEATHSIG and EOF end it
        process.start()
        theirs.close()
        self._process, self._connection = process, mine
        self._generation, self._layout_digest = -1, ""
        self._starting = True

    def stop(self) -> None:
        """End the child (its pipe closed, then killed if it lingers)."""
        process, connection = self._process, self._connection
        self._process = self._connection = None
        if connection is not None:
            connection.close()
        if process is not None:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()

    def share_buffers(self, buffers: Mapping[str, torch.Tensor], generation: int) -> None:
        """Hand the child the staging buffers, unless it holds this generation already."""
        if generation != self._generation:
            self._ask(_Buffers(dict(buffers)))
            self._generation = generation

    def write(
        self,
        partial: Path,
        rank: int,
        plan: SavePlan,
        planner: LocalPlanSavePlanner,
        buffers: Mapping[str, torch.Tensor],
    ) -> list[WriteResult]:
        """Write ``plan``'s items in the child; DCP's write results."""
        key_of = {(b.data_ptr(), b.shape): key for key, b in buffers.items()}
        buffer_of: dict[str, str] = {}
        serialized: dict[str, bytes] = {}
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item)
                assert isinstance(data, io.BytesIO)
                serialized[fqn] = data.getvalue()
                continue
            value = planner.state_dict[fqn]
            local = value.to_local() if isinstance(value, DTensor) else value
            key = key_of.get((local.data_ptr(), local.shape))
            if key is None:
                raise WriterProcessError(f"{fqn} is not backed by a staging buffer")
            buffer_of[fqn] = key
        results = self._ask(_Write(partial, rank, plan, buffer_of, serialized, planner.rows))
        assert isinstance(results, list)
        return results

    def write_metadata(
        self, partial: Path, planner: LocalPlanSavePlanner, gathered: Gathered
    ) -> None:
        """Rank 0: build and write ``.metadata`` in the child."""
        layout = planner.layout
        assert layout is not None
        if layout.digest != self._layout_digest:
            self._ask(_Layout(layout, planner.mappings))
            self._layout_digest = layout.digest
        self._ask(_Metadata(partial, [body for _, _, body, _ in gathered]))

    def checksums(
        self, partial: Path, leave_out: frozenset[str], rank: int, world_size: int
    ) -> dict[str, FileSum]:
        """This rank's share of the checkpoint's checksums, computed in the child."""
        sums = self._ask(_Checksums(partial, leave_out, rank, world_size))
        assert isinstance(sums, dict)
        return sums

    def _ask(self, request: object) -> Any:
        """Send ``request``; the child's reply, or an error if it failed, died or hung."""
        process, connection = self._process, self._connection
        if process is None or connection is None:
            raise WriterProcessError("no writer process runs")
        self._allowed = self.bound_s + (START_S if self._starting else 0.0)
        deadline = time.monotonic() + self._allowed
        try:
            self._within(lambda: connection.send(request), connection, deadline)
            while not connection.poll(0):
                left = deadline - time.monotonic()
                if left <= 0:
                    hung = self._hung(process)
                    connection.close()
                    raise hung
                # Wakes on the reply, on the child's exit, or at the bound.
                multiprocessing.connection.wait([connection, process.sentinel], timeout=left)
                if not connection.poll(0) and not process.is_alive():
                    raise WriterProcessError(
                        f"the writer process {process.pid} died (exit code {process.exitcode})"
                    )
            reply = self._within(connection.recv, connection, deadline)
        except (EOFError, OSError, BrokenPipeError) as error:
            raise WriterProcessError(
                f"the writer process {process.pid} is gone ({type(error).__name__})"
            ) from None
        self._starting = False  # it answered: it has started
        if isinstance(reply, _Failed):
            raise WriterProcessError(f"the writer process failed: {reply.message}")
        return reply

    def _within(
        self,
        call: Callable[[], Any],
        connection: multiprocessing.connection.Connection,
        deadline: float,
    ) -> Any:
        """``call()`` (a send or a receive on the pipe, which may block), ended at the bound.

        On a thread of its own: a pipe whose reader is stopped blocks the writer in the kernel.
        Killing the child at the bound ends the call (a broken pipe, or the end of it).
        """
        outcome: list[Any] = []

        def run() -> None:
            try:
                outcome.append((True, call()))
            except BaseException as error:  # handed to the caller
                outcome.append((False, error))

        thread = threading.Thread(target=run, name="shardkit-checkpoint-writer-pipe", daemon=True)
        thread.start()
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            hung = self._hung(self._process)
            thread.join()  # the child's death ends the call
            connection.close()
            raise hung
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def _hung(self, process: Any) -> WriterProcessError:
        """Kill a child that did not answer within the bound; the error that says so."""
        pid = process.pid if process is not None else None
        if process is not None and process.is_alive():
            process.kill()  # SIGKILL ends a stopped process too
            process.join()
        self._process = self._connection = None  # the next save starts another
        return WriterProcessError(
            f"the writer process {pid} did not answer within {self._allowed:g} s "
            f"({BOUND_VARIABLE}{', with its start' if self._starting else ''}): it hung "
            "without dying and was killed"
        )
