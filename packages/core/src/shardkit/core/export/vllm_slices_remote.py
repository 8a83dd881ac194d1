"""A TP-sliced export into a vLLM engine whose K workers run in processes of their own.

The engine (vLLM's multiprocessing executor, ``tensor_parallel_size=K``) runs its engine core
and its K workers outside the trainer; one trainer process holds its ``vllm.LLM`` handle, or
the URL of a ``vllm serve --tensor-parallel-size K`` (``vllm_slice_drivers.py``). A
:class:`~shardkit.core.export.tp_export.SlicedExporter` on the trainer's W ranks moves each
engine rank's windows to trainer rank ``r`` (engine rank ``r``) as it does for a colocated
engine (no rank gathers a whole tensor); there, instead of loading them in the same process,
:class:`VLLMRemoteSliceReceiver` sends them to worker ``r`` through the shared-memory
transport (``shared_memory.py``: JSON headers and raw bytes in shared segments, never pickle),
and that worker loads them through vLLM's own loaders (``vllm_slices_worker.py``). Each worker
receives exactly its windows' bytes, from one trainer rank.

One export, on the trainer ranks that hold engine ranks:

1. ``begin`` on the rank with the handle (the *driver*) reaches the workers by method name
   through shardkit's worker extension (``worker_extension_cls=EXTENSION``: no pickled
   function; a server's through its ``/collective_rpc``), each call bounded: the workers'
   tensor-parallel places (ranks 0..K-1 of degree K), their loading path and dtype, and
   that they run in other processes; anything amiss is refused by name before a byte is
   written. It then asks every worker, on a helper thread,
   to serve this export (``shardkit_serve_slices``: a socket address and a window table per
   engine rank); the engine core takes no step until that call returns (a server's
   scheduling is paused first, and resumed after the load or the failure);
2. at its first bucket (after the exporter's agreement on every ``begin``), every such rank
   connects a ``SharedMemorySender`` to its worker's socket (retried until it listens, at
   most the bound) and sends its window manifest (each window's shape); each bucket's
   windows go to the worker, which loads the previous bucket meanwhile;
3. ``commit`` (before the trainer ranks' last agreement, so a failure fails every rank) waits
   until the worker loaded everything (each worker stages its buckets and loads them all at
   the end, in one call, keeping its model as it was: ``vllm_slices_worker.py``), ends its
   serving, and on the driver waits for every worker's answer (each one's received bytes);
4. ``finish`` (every trainer rank agreed) has the driver keep every worker's load
   (``shardkit_settle``), then empty the prefix cache (a server's before its scheduling
   resumes); ``abort`` (any rank failed, at any point) has it undo them instead, so the K
   engine ranks serve the version they served before, complete, never a mix.

Every wait is bounded (``SHARDKIT_EXPORT_BOUND`` or ``bound_s``); a dead or silent worker is a
:class:`~shardkit.core.errors.WeightExportError` on its rank, which the exporter makes every
rank raise. Full exports only; ``version`` is the export the engine holds complete.

This module imports no vLLM (the worker's part is called inside vLLM's workers).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from typing import Any

from shardkit.core.errors import WeightExportError, WeightLoadError
from shardkit.core.export.messages import ExportedTensor, ExportManifest, WeightBucket
from shardkit.core.export.shared_memory import SharedMemorySender
from shardkit.core.export.tp_export import SlicedBucket, SlicedExporter
from shardkit.core.export.tp_slices import EngineTP, Window, engine_window
from shardkit.core.export.vllm_slice_drivers import LLMDriver, ServerDriver, Serving, SliceDriver
from shardkit.core.export.vllm_slices_worker import window_table
from shardkit.core.runtime.export.export_groups import export_bound_s

__all__ = ["VLLMRemoteSliceReceiver", "remote_slice_receiver"]

logger = logging.getLogger(__name__)


class VLLMRemoteSliceReceiver:
    """One trainer rank's side of a TP-sliced export into workers elsewhere (see the module).

    Args:
        tp: the engine's degree and head counts (the exporter's ``engine``).
        engine_rank: the engine rank whose windows this trainer rank holds.
        authkey: the key of the transport's handshake: the same bytes on every trainer rank
            (the workers learn it from the driver's call).
        llm: the engine's ``vllm.LLM``, on the one trainer rank that holds it (the driver);
            None on the others.
        url: instead of ``llm``, on the driver: the base URL of a ``vllm serve`` of
            ``--tensor-parallel-size K`` on this host (``VLLM_SERVER_DEV_MODE=1``, the
            worker extension), whose scheduling is paused around each export.
        socket_dir: where the per-export Unix sockets are made (default: the temporary
            folder; the same on every rank of this host).
        bound_s: the longest wait for one step (``SHARDKIT_EXPORT_BOUND``).
    """

    def __init__(
        self,
        tp: EngineTP,
        engine_rank: int,
        *,
        authkey: bytes,
        llm: Any | None = None,
        url: str | None = None,
        socket_dir: str | None = None,
        bound_s: float | None = None,
    ) -> None:
        if not 0 <= engine_rank < tp.degree:
            raise ValueError(f"engine rank {engine_rank} outside an engine of degree {tp.degree}")
        if llm is not None and url is not None:
            raise ValueError("one engine: its vllm.LLM or its server's URL, not both")
        self.tp, self.engine_rank, self.authkey = tp, engine_rank, authkey
        self.bound_s = export_bound_s(bound_s)
        self.socket_dir = socket_dir or tempfile.gettempdir()
        self._socket_key = hashlib.sha256(authkey).hexdigest()[:12]  # alike on every rank
        self._driver: SliceDriver | None = None
        if llm is not None:
            self._driver = LLMDriver(llm, self.bound_s)
        elif url is not None:
            self._driver = ServerDriver(url, self.bound_s)
        self._sender: SharedMemorySender | None = None
        self._planned: tuple[str, ExportManifest] | None = None
        """This export's socket address and window manifest, until the first bucket."""
        self._serving: Serving | None = None
        self.served: list[dict[str, Any]] = []
        """The driver's last export: each worker's answer (its rank, the bytes it loaded)."""
        self.version: int | None = None
        """The export the engine holds complete (None: the weights it started with)."""
        self._export_id: int | None = None
        self._loaded = False
        """The driver's workers loaded this export, held until settled."""

    def begin(self, manifest: ExportManifest) -> None:
        """Check the engine and start the workers' serving (driver); plan this rank's manifest.

        The connection to the worker is made at the first bucket: by then the exporter's
        agreement after ``begin`` told every rank whether the driver refused the export, so
        no rank waits for a worker that was never asked to serve.

        Raises:
            WeightExportError: the engine is not reachable by name, its workers are not K
                processes of their own, or a wait passed the bound; nothing was written.
            WeightLoadError: the engine cannot take weights in place, or in this dtype.
        """
        if self._sender is not None or self._planned is not None:
            raise RuntimeError("VLLMRemoteSliceReceiver.begin: the previous export is open")
        windows = [
            [engine_window(self.tp, e.name, e.shape, r) for e in manifest.tensors]
            for r in range(self.tp.degree)
        ]
        self._export_id, self._loaded = manifest.export_id, False
        addresses = [self._address(manifest.export_id, r) for r in range(self.tp.degree)]
        if self._driver is not None:
            self._start_serving(manifest, addresses, windows)
        own = windows[self.engine_rank]
        mine = ExportManifest(
            manifest.export_id,
            "full",
            tuple(
                ExportedTensor(e.name, w.local_shape, e.dtype, e.bucket)
                for e, w in zip(manifest.tensors, own, strict=True)
            ),
            manifest.bucket_count,
        )
        self._planned = (addresses[self.engine_rank], mine)

    def _connected(self) -> SharedMemorySender:
        """The sender to this rank's worker: connected, its manifest sent, at first use."""
        if self._sender is not None:
            return self._sender
        if self._planned is None:
            raise RuntimeError("VLLMRemoteSliceReceiver: no export begun (call begin first)")
        (address, manifest), self._planned = self._planned, None
        sender = SharedMemorySender(address, self.authkey, bound_s=self.bound_s)
        try:
            sender.begin(manifest)
        except BaseException:
            sender.close()
            raise
        self._sender = sender
        return sender

    def receive(self, bucket: SlicedBucket) -> None:
        """Send the bucket's windows to this engine rank's worker (it loads them)."""
        if (bucket.engine_rank, bucket.degree) != (self.engine_rank, self.tp.degree):
            raise WeightLoadError(
                f"bucket {bucket.index} holds engine rank {bucket.engine_rank}'s windows (of "
                f"{bucket.degree}); this receiver sends engine rank {self.engine_rank}'s"
            )
        tensors = tuple((w.name, data) for w, data in bucket.windows)
        self._connected().receive(WeightBucket(bucket.index, full=tensors))

    def commit(self) -> None:
        """Wait for the worker's load and end its serving; on the driver, every worker's.

        Raises:
            WeightLoadError: a worker's load failed (its text).
            WeightExportError: a worker died or did not answer within the bound.
        """
        if self._sender is None and self._planned is None:
            return  # committed already, or nothing began
        sender = self._connected()  # an export of no buckets still ends the worker's serving
        self._sender = None
        try:
            sender.finish()
        finally:
            sender.close(stop_serving=True)  # the worker's serving call returns
        if self._serving is not None:
            self._end_serving()

    def finish(self) -> None:
        """The export went through on every rank: the workers' loads kept (driver).

        Committed here first if the exporter did not.
        """
        self.commit()
        if self._driver is not None and self._loaded:
            self._loaded = False
            self._driver.rpc_all("shardkit_settle", [True], "the commit's settling")
            self._driver.after_load()
        self.version = self._export_id

    def abort(self, error: BaseException) -> None:
        """Tell the worker the export failed and end its serving (the engine may hold a mix)."""
        sender, self._sender, self._planned = self._sender, None, None
        if sender is not None:
            try:
                sender.abort(error)
            finally:
                sender.close(stop_serving=True)
        if self._driver is None:
            return
        # The serving call ends once every worker's sender stopped, or its wait for one that
        # never connected passed the bound; a call still out then, the next begin waits for.
        if self._serving is not None and self._serving.answer(self.bound_s) is not None:
            self._serving = None
        if self._serving is None:
            try:  # every worker's held load undone (and anything staged dropped)
                self._driver.rpc_all("shardkit_settle", [False], "the commit's undoing")
            except Exception as failure:  # the export's own error is the one raised
                logger.error("the vLLM engine's workers could not undo the export: %s", failure)
                self.version = None  # what they hold is not known
        self._loaded = False
        self._driver.after_failure()  # a server paused by this export resumes

    def _address(self, export_id: int, rank: int) -> str:
        return os.path.join(
            self.socket_dir, f"shardkit-slices-{self._socket_key}-{export_id}-{rank}"
        )

    def _start_serving(
        self, manifest: ExportManifest, addresses: list[str], windows: list[list[Window]]
    ) -> None:
        driver = self._driver
        assert driver is not None
        self._wait_previous()
        degree = self.tp.degree
        places = [tuple(p) for p in driver.rpc_all("shardkit_tp_place", [], "its workers' places")]
        if sorted(places) != [(r, degree) for r in range(degree)]:
            raise WeightExportError(
                f"the exporter cuts for an engine of TP degree {degree}, but the engine's "
                f"workers are (rank, degree) {places}; nothing was written"
            )
        self._check_workers(manifest, driver.rpc_all("shardkit_probe", ["auto"], "its workers"))
        tables = [window_table(w) for w in windows]
        driver.before_serving()
        try:
            self._serving = driver.start_serving(
                [addresses, self.authkey.hex(), self.bound_s, tables]
            )
        except BaseException:
            driver.after_failure()
            raise

    def _check_workers(self, manifest: ExportManifest, probes: list[Any]) -> None:
        problems = []
        for rank, (chosen, dtype, reason, pid) in enumerate(probes):
            if pid == os.getpid():
                raise WeightExportError(
                    f"engine rank {rank}'s worker runs in this process: a colocated engine "
                    "takes its windows through VLLMSliceReceiver; nothing was written"
                )
            if chosen is None:
                raise WeightLoadError(f"engine rank {rank} cannot take weights in place: {reason}")
            problems += [
                f"{e.name}: sent as {e.dtype}, engine rank {rank} computes in {dtype}"
                for e in manifest.tensors
                if e.dtype.is_floating_point and str(e.dtype).removeprefix("torch.") != dtype
            ]
        if problems:
            raise WeightLoadError(
                f"export {manifest.export_id} does not fit the vLLM engine; nothing was "
                "written: " + "; ".join(problems[:8])
            )

    def _wait_previous(self) -> None:
        """A failed export's serving call, ended (its workers' waits are bounded)."""
        previous, self._serving = self._serving, None
        if previous is not None and previous.answer(self.bound_s + 5.0) is None:
            raise WeightExportError(
                "the vLLM engine's workers still serve the last (failed) export after "
                f"{self.bound_s:g} s (SHARDKIT_EXPORT_BOUND); nothing was written"
            )

    def _end_serving(self) -> None:
        """Every worker's answer to its serving call; then the prefix cache emptied."""
        pending, self._serving = self._serving, None
        assert pending is not None and self._driver is not None
        answer = pending.answer(self.bound_s)
        if answer is None:
            raise WeightExportError(
                f"the vLLM engine's workers did not end the export within {self.bound_s:g} s "
                "(SHARDKIT_EXPORT_BOUND): a worker, or the engine core, may be dead"
            )
        ok, result = answer
        if not ok:
            raise WeightExportError(
                f"the vLLM engine's serving call failed: {type(result).__name__}: {result}"
            )
        self.served = [dict(r) for r in result]
        failed = [f"engine rank {r.get('rank')}: {r['error']}" for r in self.served if r["error"]]
        unfinished = [r.get("rank") for r in self.served if r.get("finished") != 1]
        if failed or unfinished:
            raise WeightLoadError(
                "the vLLM engine's workers did not all load the export: "
                + "; ".join(failed or [f"engine ranks {unfinished} finished none"])
            )
        self._loaded = True  # held on every worker until finish (kept) or abort (undone)


def remote_slice_receiver(
    exporter: SlicedExporter,
    *,
    authkey: bytes,
    llm: Any | None = None,
    url: str | None = None,
    socket_dir: str | None = None,
) -> VLLMRemoteSliceReceiver | None:
    """This trainer rank's receiver for ``exporter``'s engine rank (see the class).

    None on a rank that only sends (``SlicedExporter(one_engine=True)``, past the first K),
    which passes None to ``export``.

    Raises:
        ValueError: ``llm`` given on a rank that takes no windows (the driver must be one of
            the first K).
    """
    rank = exporter.engine_rank
    if rank is None:
        if llm is not None or url is not None:
            raise ValueError("the engine's handle belongs on a rank that takes windows")
        return None
    return VLLMRemoteSliceReceiver(
        exporter.engine,
        rank,
        authkey=authkey,
        llm=llm,
        url=url,
        socket_dir=socket_dir,
        bound_s=exporter.bound_s,
    )
