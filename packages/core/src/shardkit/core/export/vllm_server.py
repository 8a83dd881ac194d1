"""vLLM's OpenAI-compatible server (``vllm serve``) as an export's receiver.

The server's engine core runs in a process of its own, behind HTTP. Its worker takes an export
through shardkit's worker extension (``--worker-extension-cls``, ``vllm_worker.EXTENSION``),
reached by method name through the server's ``POST /collective_rpc`` (present where the server
was started with ``VLLM_SERVER_DEV_MODE=1``); no pickled function travels. The weights go
through the shared-memory transport (``shared_memory.py``), as they would to any process on
this host: JSON carries no bytes.

One export, on the trainer's receiving rank (:class:`VLLMServerReceiver`):

1. ``begin`` probes the worker (``shardkit_probe``), bounded: a server that is down, lacks the
   dev mode or the extension, or cannot take weights in place is refused by name before the
   first bucket; so is one without vLLM's ``/pause`` and ``/resume``, or paused already;
2. it pauses the server's scheduling (``POST /pause?mode=wait``): the requests in flight
   finish on the old weights, new ones wait in the queue, and no step runs until the resume;
3. it asks the worker, on a helper thread, to serve one export (``shardkit_serve_export``, a
   socket path and a key) and connects a ``SharedMemorySender`` to it; the worker listens, for
   at most the bound, and loads each bucket as it arrives (``serve_export_on_worker``, in
   ``vllm_server_worker.py``);
4. ``commit`` (before the trainer ranks' last agreement, so its failure fails every rank)
   ends the sender's export, on which the worker loads it all or, failing, keeps the last
   (its ``FullTensorReceiver`` stages it); then it tells the worker to stop serving (its call
   returns), empties the server's prefix cache, whose keys and values the old weights
   computed, and only then resumes the scheduling.

Why the pause: the export loads inside one ``collective_rpc``, so the engine core takes no
step meanwhile, but it steps again as soon as that call returns. Emptying the prefix cache by
a later call (as before) left a window in which a waiting request could be scheduled on a
prefix cached under version k and computed on with version k+1's weights (and vLLM refuses a
reset while a request holds cached blocks). Paused, nothing steps from before the load until
after the reset, and every completion is computed on one version.

A delta export is rebuilt on the worker's mirror of the last one (kept between calls). A
server that dies, or stops answering past the bound, ends the export on the receiving rank
with a :class:`~shardkit.core.errors.WeightExportError`, which the exporter makes every rank
raise; a failed export resumes the scheduling it paused (the weights are the last version's).

The requests themselves (each bounded, a refusal naming the setting the server lacks) are
``vllm_server_calls.py``'s, shared with the TP-sliced export into a tensor-parallel server.
This module imports no vLLM (the worker's part, ``vllm_server_worker.py``, is called inside
vLLM's worker).

See docs/guide/export.md ("A vLLM server").
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import tempfile
from dataclasses import dataclass
from typing import Any

from shardkit.core.errors import WeightExportError, WeightLoadError
from shardkit.core.export.messages import ExportManifest, WeightBucket
from shardkit.core.export.shared_memory import SharedMemorySender
from shardkit.core.export.vllm_server_calls import ServerCall, ServerCalls
from shardkit.core.export.vllm_server_worker import serve_export_on_worker
from shardkit.core.runtime.export.export_groups import export_bound_s

__all__ = ["VLLMServerReceiver", "serve_export_on_worker", "vllm_server_receiver"]

logger = logging.getLogger(__name__)

SERVE_METHOD = "shardkit_serve_export"
"""The extension's method that serves one export (see :func:`serve_export_on_worker`)."""


@dataclass(slots=True)
class _OpenExport:
    sender: SharedMemorySender
    serving: ServerCall


class VLLMServerReceiver:
    """Exports into a running ``vllm serve`` (see the module's docstring).

    Use it on the trainer's receiving rank as any receiver::

        receiver = vllm_server_receiver("http://127.0.0.1:8000") if exporter.receiving else None
        exporter.export(receiver, delta=True)

    The server must run on this host (the buckets go through shared memory), started with
    ``VLLM_SERVER_DEV_MODE=1`` and ``--worker-extension-cls`` set to
    :data:`~shardkit.core.export.vllm_worker.EXTENSION`.

    Args:
        url: the server's base URL (``http://host:port``).
        bound_s: the longest wait for the server's answer to one step (the probe, a bucket,
            the end of the export; default ``SHARDKIT_EXPORT_BOUND``).
        socket_dir: where the per-export Unix socket is made (default: the temporary folder).
    """

    def __init__(
        self, url: str, *, bound_s: float | None = None, socket_dir: str | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self.bound_s = export_bound_s(bound_s)
        self.socket_dir = socket_dir or tempfile.gettempdir()
        self.calls = ServerCalls(self.url, self.bound_s)
        """The server's endpoints, each request bounded (pause, resume, the workers' RPC)."""
        self._open: _OpenExport | None = None
        self.version: int | None = None
        """The export the server's worker holds complete, as it reported (None: none yet)."""

    def begin(self, manifest: ExportManifest) -> None:
        """Probe the server, pause it, ask its worker to serve this export, send the manifest.

        Raises:
            WeightExportError: the server is unreachable, lacks ``VLLM_SERVER_DEV_MODE=1``,
                the worker extension or ``/pause``, is paused already, or did not answer
                (its requests in flight did not finish) within the bound; nothing was written.
            WeightLoadError: the server's engine cannot take weights in place.
        """
        if self._open is not None:
            raise RuntimeError("VLLMServerReceiver.begin: the previous export is still open")
        chosen, _dtype, reason, _pid = self._rpc("shardkit_probe", ["auto"], "the probe")
        if chosen is None:
            raise WeightLoadError(f"the vLLM server at {self.url} cannot take weights: {reason}")
        self.calls.pause()
        address = os.path.join(self.socket_dir, f"shardkit-{os.getpid()}-{secrets.token_hex(6)}")
        authkey = secrets.token_bytes(32)
        self.calls.loading = True
        serving = self.calls.start_rpc(SERVE_METHOD, [address, authkey.hex(), self.bound_s])
        opened = _OpenExport(SharedMemorySender(address, authkey, bound_s=self.bound_s), serving)
        try:
            opened.sender.begin(manifest)
        except WeightExportError as error:
            opened.sender.close()
            raise self.calls.explained(error, serving) from error
        self._open = opened

    def receive(self, bucket: WeightBucket) -> None:
        """Write ``bucket`` into shared memory; the worker loads it."""
        self._current().sender.receive(bucket)

    def commit(self) -> None:
        """Wait for the worker's load, end its serving, empty the prefix cache, then resume.

        The exporter calls it after the last bucket, before the ranks' last agreement, so a
        failure here fails every rank.

        Raises:
            WeightLoadError: the worker's load failed (its text); it serves the last export.
            WeightExportError: the server died or did not answer within the bound.
        """
        opened = self._open
        if opened is None:
            return  # committed already, or nothing began
        try:
            opened.sender.finish()
        except WeightExportError as error:
            raise self.calls.explained(error, opened.serving) from error
        finally:
            self._end(opened)
        answer = opened.serving.answer(self.bound_s)
        if answer is None or not answer[0]:
            raise self.calls.explained(
                WeightExportError(f"the vLLM server at {self.url} did not end the export"),
                opened.serving,
            )
        served = json.loads(answer[1])["results"][0]
        self.calls.resume()
        self.version = served.get("version") if isinstance(served, dict) else None

    def weight_digests(self) -> dict[str, list[Any]]:
        """``{name: [dtype, shape, sha256]}`` of every weight the server computes with.

        Read back on its worker (``shardkit_weight_digests``; see
        :mod:`~shardkit.core.export.vllm_read_back`, whose ``tensor_digest`` gives the
        trainer's side), bounded as an export's calls are.
        """
        found: dict[str, list[Any]] = self._rpc("shardkit_weight_digests", [], "the read-back")
        return found

    def finish(self) -> None:
        """The export went through (committed here if the exporter did not)."""
        self.commit()

    def abort(self, error: BaseException) -> None:
        """Tell the worker the export failed, end its serving, resume the scheduling."""
        opened = self._open
        try:
            if opened is not None:
                try:
                    opened.sender.abort(error)
                finally:
                    self._end(opened)
        finally:
            try:
                self.calls.resume()
            except WeightExportError as failed:  # the export's own error is the one raised
                logger.warning("after a failed export: %s", failed)

    def _current(self) -> _OpenExport:
        if self._open is None:
            raise RuntimeError("VLLMServerReceiver: no export begun (call begin first)")
        return self._open

    def _end(self, opened: _OpenExport) -> None:
        self._open = None
        opened.sender.close(stop_serving=True)  # the worker's call returns; still paused

    def _rpc(self, method: str, args: list[Any], what: str) -> Any:
        """The first worker's result of ``method(*args)`` through ``/collective_rpc``."""
        return self.calls.rpc_all(method, args, what)[0]


def vllm_server_receiver(
    url: str, *, bound_s: float | None = None, socket_dir: str | None = None
) -> VLLMServerReceiver:
    """The receiver for a ``vllm serve`` at ``url`` (see :class:`VLLMServerReceiver`)."""
    return VLLMServerReceiver(url, bound_s=bound_s, socket_dir=socket_dir)
