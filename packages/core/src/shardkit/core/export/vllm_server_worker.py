"""The server's worker serving one export: a socket opened, the buckets loaded as they come.

Called inside a ``vllm serve``'s worker by vLLM's ``collective_rpc`` (the worker extension's
``shardkit_serve_export``; see ``vllm_server.py`` for the trainer's side). It listens at a
Unix socket for at most the bound, then loads what the sender's shared-memory transport sends
until it says stop or is gone. One receiver per worker is kept from export to export: its
mirror is what a delta export is rebuilt on, and it stages a version whole before loading it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from shardkit.core.errors import WeightLoadError
from shardkit.core.export.messages import ExportManifest
from shardkit.core.export.receivers import FullTensorReceiver
from shardkit.core.export.shared_memory import serve_connection
from shardkit.core.export.vllm_checks import check_manifest, checkpoint_shapes
from shardkit.core.export.vllm_worker_load import choose_path, load_on_worker

__all__ = ["accept_within", "serve_export_on_worker"]

logger = logging.getLogger(__name__)


class _WorkerReceiver(FullTensorReceiver):
    """On the worker: exports checked against the engine, rebuilt whole, loaded in place."""

    def __init__(self, worker: Any) -> None:
        path, dtype, reason = choose_path(worker, "auto")
        if path is None:
            raise WeightLoadError(f"this vLLM engine cannot take weights in place: {reason}")
        chosen: str = path

        def load(tensors: list[tuple[str, Any]]) -> None:
            load_on_worker(worker, chosen, tensors)

        super().__init__(load)
        self.dtype = dtype
        self.checkpoint = checkpoint_shapes(worker.model_runner.model_config.model)

    def begin(self, manifest: ExportManifest) -> None:
        check_manifest(manifest, self.dtype, self.checkpoint)
        super().begin(manifest)


# One receiver per worker, kept from export to export (its mirror is what a delta rebuilds on).
_RECEIVERS: weakref.WeakKeyDictionary[Any, _WorkerReceiver] = weakref.WeakKeyDictionary()


def serve_export_on_worker(
    worker: Any, address: str, authkey_hex: str, bound_s: float
) -> dict[str, Any]:
    """On the server's worker: serve one sender's export at ``address``, then return.

    Called by vLLM's ``collective_rpc`` (the extension's ``shardkit_serve_export``). Listens
    at the Unix socket ``address`` for at most ``bound_s``, then loads what the sender sends
    until it says stop or is gone.

    Returns:
        ``{"finished": exports finished, "version": the export the worker holds complete,
        "error": why none was served, or None}``.
    """
    authkey = bytes.fromhex(authkey_hex)
    receiver = _RECEIVERS.get(worker)
    if receiver is None:
        receiver = _RECEIVERS[worker] = _WorkerReceiver(worker)
    conn = accept_within(address, authkey, float(bound_s))
    if conn is None:
        why = f"no sender connected to {address} within {bound_s} s"
        return {"finished": 0, "version": receiver.version, "error": why}
    finished = serve_connection(conn, receiver)
    return {"finished": finished, "version": receiver.version, "error": None}


def accept_within(address: str, authkey: bytes, bound_s: float) -> Connection | None:
    """The sender's connection at ``address``, or None where none came within ``bound_s``.

    ``Listener.accept`` takes no timeout: it runs on a helper thread, and where the bound
    passes this thread connects itself to end the wait (that connection is dropped).
    """
    with Listener(address, authkey=authkey) as listener:
        accepted: list[Connection | BaseException] = []

        def accept() -> None:
            try:
                accepted.append(listener.accept())
            except (OSError, EOFError) as error:  # a failed handshake: not our sender
                accepted.append(error)

        helper = threading.Thread(target=accept, name="shardkit-server-accept", daemon=True)
        helper.start()
        helper.join(bound_s)
        if helper.is_alive():
            with contextlib.suppress(OSError, EOFError):
                Client(address, authkey=authkey).close()
            helper.join()
            for late in accepted:
                if isinstance(late, Connection):
                    late.close()
            return None
    found = accepted[0] if accepted else None
    if isinstance(found, Connection):
        return found
    logger.warning("no sender connected to %s: %s", address, found)
    return None
