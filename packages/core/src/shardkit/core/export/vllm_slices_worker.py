"""One worker of a tensor-parallel engine elsewhere taking its windows of a TP-sliced export.

Called inside each of a vLLM engine's K workers by ``collective_rpc`` (the worker extension's
``shardkit_serve_slices``; the trainer's side is ``vllm_slices_remote.py``). Every worker gets
the same arguments, a socket address and a window table per engine rank, and takes its own by
its rank in the engine's tensor-parallel group. It listens there for at most the bound, for
the one trainer rank that sends this engine rank's windows through the shared-memory
transport (``shared_memory.py``: JSON headers and raw bytes, never pickle), stages each bucket
as it comes (copied out of the reused segment), and at the export's end loads them all in one
call through vLLM's own loaders, each window a
:class:`~shardkit.core.export.windowed_weight.WindowedWeight`: the loaders narrow it to their
rank's part, which is the window, and a narrow outside it raises (a wrong cut never loads).
That load keeps the model as it was (``vllm_worker_load.commit_on_worker`` with ``hold``) until the
trainer's driver settles it on every worker (``shardkit_settle``): kept once every trainer
rank agreed, undone if any failed, so the engine's K ranks serve one export, complete.

What comes over the socket is checked against the table before a byte is loaded: the names,
each window's shape, the engine's dtype. The table itself comes from the trainer (its plan,
``tp_slices.py``), so user rules (``EngineTP(kinds=...)``) hold on both sides alike.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from typing import Any

from shardkit.core.errors import WeightLoadError
from shardkit.core.export.messages import ExportManifest, WeightBucket
from shardkit.core.export.shared_memory import serve_connection
from shardkit.core.export.tp_slices import Window
from shardkit.core.export.vllm_server_worker import accept_within
from shardkit.core.export.vllm_versions import drop_staged, stage_on_worker
from shardkit.core.export.vllm_worker_load import choose_path, commit_on_worker
from shardkit.core.export.windowed_weight import windowed

__all__ = ["serve_slices_on_worker", "tp_place_of_worker", "window_table", "windows_of_table"]

logger = logging.getLogger(__name__)

WindowTable = dict[str, list[Any]]
"""``{name: [full shape, cut dim or None, start, stop]}``: one engine rank's windows, plain
values (what vLLM's RPC and JSON carry without pickle)."""


def window_table(windows: list[Window]) -> WindowTable:
    """One engine rank's windows as plain values (see :data:`WindowTable`)."""
    return {w.name: [list(w.shape), w.dim, w.start, w.stop] for w in windows}


def windows_of_table(table: object) -> dict[str, Window]:
    """The windows of a :data:`WindowTable`, every field checked (it crossed a process).

    Raises:
        WeightLoadError: a malformed entry, named.
    """
    if not isinstance(table, dict):
        raise WeightLoadError(f"a window table must be an object, not {type(table).__name__}")
    windows = {}
    for name, entry in table.items():
        ok = isinstance(name, str) and isinstance(entry, list) and len(entry) == 4
        shape, dim, start, stop = entry if ok else ([], None, 0, 0)
        ints = [*shape, start, stop, *([] if dim is None else [dim])] if ok else []
        ok = ok and isinstance(shape, list) and all(type(i) is int and i >= 0 for i in ints)
        ok = ok and (dim is None or dim < len(shape)) and start <= stop
        ok = ok and stop <= (shape[dim] if dim is not None else stop)
        if not ok:
            raise WeightLoadError(f"a malformed window for {name!r}: {entry!r}")
        windows[name] = Window(name, tuple(shape), dim, start, stop)
    return windows


def tp_place_of_worker(worker: Any) -> tuple[int, int]:
    """On the worker: its rank in the engine's tensor-parallel group, and the group's size."""
    state = importlib.import_module("vllm.distributed.parallel_state")
    return int(state.get_tensor_model_parallel_rank()), int(
        state.get_tensor_model_parallel_world_size()
    )


class _SliceWorkerReceiver:
    """On one worker: one engine rank's windows, checked against its table, loaded in place."""

    def __init__(self, worker: Any, windows: dict[str, Window], rank: int) -> None:
        path, dtype, reason = choose_path(worker, "auto")
        if path is None:
            raise WeightLoadError(f"this vLLM engine cannot take weights in place: {reason}")
        self.worker, self.path, self.dtype = worker, path, dtype
        self.windows, self.rank = windows, rank
        self.received_bytes = 0
        """The bytes of the windows this worker loaded (this call's exports)."""
        self.failure: str | None = None
        """Why the last export failed here (None: it did not)."""
        self.export_id = -1

    def begin(self, manifest: ExportManifest) -> None:
        problems = []
        for entry in manifest.tensors:
            window = self.windows.get(entry.name)
            if window is None:
                problems.append(f"{entry.name}: not in this engine rank's window table")
            elif entry.shape != window.local_shape:
                problems.append(
                    f"{entry.name}: sent as {list(entry.shape)}, engine rank {self.rank}'s "
                    f"window is {list(window.local_shape)}"
                )
            if entry.dtype.is_floating_point and entry.dtype != self.dtype:
                why = f"sent as {entry.dtype}, the engine computes in {self.dtype}"
                problems.append(f"{entry.name}: {why}")
        if problems:
            raise WeightLoadError(
                f"export {manifest.export_id} does not fit engine rank {self.rank}; nothing was "
                "written: " + "; ".join(problems)
            )
        self.export_id = manifest.export_id

    def receive(self, bucket: WeightBucket) -> None:
        # Copied: the bucket's tensors view a shared segment the sender reuses.
        items = [(name, windowed(self.windows[name], data.clone())) for name, data in bucket.full]
        stage_on_worker(self.worker, self.export_id, items)
        self.received_bytes += sum(t.numel() * t.element_size() for _, t in bucket.full)

    def finish(self) -> None:
        """Every bucket staged: all loaded in one call, held until the driver settles it."""
        try:
            commit_on_worker(self.worker, self.export_id, self.path, hold=True)
        except Exception as error:  # put back already; the driver reads why in the answer
            self.failure = f"{type(error).__name__}: {error}"
            raise

    def abort(self, error: BaseException) -> None:
        self.failure = str(error)
        drop_staged(self.worker)
        logger.warning("engine rank %s: a TP-sliced export failed: %s", self.rank, error)


def serve_slices_on_worker(
    worker: Any, addresses: list[str], authkey_hex: str, bound_s: float, tables: list[Any]
) -> dict[str, Any]:
    """On each worker: serve this engine rank's windows of one export, then return.

    Args:
        worker: vLLM's worker (``collective_rpc`` passes it).
        addresses: a Unix socket path per engine rank.
        authkey_hex: the key the trainer's senders hold.
        bound_s: the longest wait for this rank's sender to connect.
        tables: a :data:`WindowTable` per engine rank.

    Returns:
        ``{"rank", "degree", "finished": exports finished, "received_bytes", "error": why
        none was served, or None}`` (plain values).
    """
    rank, degree = tp_place_of_worker(worker)
    out: dict[str, Any] = {"rank": rank, "degree": degree, "finished": 0, "received_bytes": 0}
    if len(addresses) != degree or len(tables) != degree:
        out["error"] = (
            f"the trainer sent {len(addresses)} addresses and {len(tables)} window tables for "
            f"an engine of TP degree {degree}"
        )
        return out
    try:
        receiver = _SliceWorkerReceiver(worker, windows_of_table(tables[rank]), rank)
    except WeightLoadError as error:
        out["error"] = str(error)
        return out
    address = str(addresses[rank])
    with contextlib.suppress(FileNotFoundError):  # a socket a killed worker left there
        os.unlink(address)
    conn = accept_within(address, bytes.fromhex(authkey_hex), float(bound_s))
    if conn is None:
        out["error"] = f"no sender connected to {address} within {bound_s} s"
        return out
    out["finished"] = serve_connection(conn, receiver)
    out["received_bytes"] = receiver.received_bytes
    out["error"] = receiver.failure
    return out
