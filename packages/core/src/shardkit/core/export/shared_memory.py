"""Exports to another process on this host through two shared-memory segments, in turn.

For receivers that cannot share device memory (no CUDA IPC: CPU builds, other devices), the
buckets travel through ``multiprocessing.shared_memory`` segments; a socket carries the control
messages (JSON through ``send_bytes``/``recv_bytes``, never pickle) and the wire headers.

Trainer side: :class:`SharedMemorySender` is a :class:`~shardkit.core.export.receivers.
WeightReceiver`. Bucket ``k`` goes into segment ``k % 2`` while the receiving process still
loads bucket ``k - 1`` from the other one; before it overwrites a segment, the sender waits for
the receiver's answer for bucket ``k - 2``, the last one written there. So a trainer rank holds
at most two buckets in shared memory, and the copy-in of one bucket overlaps the load of the
previous one. The segments are kept from export to export; one too small for a bucket is made
anew (the control message names the new one).

Receiver side: :func:`serve_shared_memory` runs in the other process, answers each message,
and hands manifests and buckets to a local receiver (a ``ModuleReceiver`` on a transformers
model, a vLLM loader). Its errors travel back as text: the sender's ``receive`` or ``finish``
raises :class:`~shardkit.core.errors.WeightLoadError` with it, and the serving loop stays ready
for the next export. A receiving process that dies, or does not answer within ``bound_s``,
makes the sender raise :class:`~shardkit.core.errors.WeightExportError` naming the bucket.

Next to split off: the serving side (``serve_shared_memory``, ``serve_connection`` and their
session) into ``shared_memory_serve.py``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import torch

from shardkit.core.errors import WeightExportError, WeightLoadError
from shardkit.core.export import wire
from shardkit.core.export.messages import ExportManifest, WeightBucket
from shardkit.core.export.receivers import WeightReceiver
from shardkit.core.export.shared_segments import MappedSegment, attach, release

__all__ = ["SharedMemorySender", "serve_connection", "serve_shared_memory"]

logger = logging.getLogger(__name__)

_MAX_FRAME = 256 * 2**20  # a control message or a wire header; anything longer is refused

Address = str | tuple[str, int]


class SharedMemorySender:
    """Sends exports to :func:`serve_shared_memory` in another process of this host.

    Use it as the exporter's receiver, as a context manager (``close`` unlinks the segments)::

        with SharedMemorySender("/tmp/engine.sock", authkey) as sender:
            exporter.export(sender)

    Args:
        address: the serving process's listening address (a Unix socket path, or host, port).
        authkey: the key both sides share (``multiprocessing.connection``'s handshake).
        bound_s: how long to wait for the receiving process to connect or answer (default 60 s)
            before the export fails with :class:`WeightExportError`.
    """

    def __init__(self, address: Address, authkey: bytes, *, bound_s: float = 60.0) -> None:
        self.address = address
        self.authkey = authkey
        self.bound_s = bound_s
        self._conn: Connection | None = None
        self._segments: list[SharedMemory | None] = [None, None]
        self._manifest: ExportManifest | None = None
        # This export's buckets sent, answers read (the begin's included), first failure.
        self._sent, self._answered, self._size_hint = 0, 0, 0
        self._failure: str | None = None

    def begin(self, manifest: ExportManifest) -> None:
        """Send the manifest (connecting first if needed); its answer is read later."""
        if self._manifest is not None:
            raise RuntimeError("SharedMemorySender.begin: the previous export is still open")
        if self._conn is None:
            self._conn = _connect(self.address, self.authkey, self.bound_s)
        self._sent, self._answered, self._failure = 0, 0, None
        self._size_hint = wire.largest_full_payload(manifest) if manifest.kind == "full" else 0
        self._send({"op": "begin"}, wire.encode_manifest(manifest).header, "the manifest")
        self._manifest = manifest  # only now: a begin that raised leaves no export to abort

    def receive(self, bucket: WeightBucket) -> None:
        """Write ``bucket`` into the next segment and tell the receiving process.

        Raises:
            WeightLoadError: the receiving process's receiver failed (its text).
            WeightExportError: the process died or did not answer within ``bound_s``.
        """
        manifest = self._open_export()
        encoded = wire.encode_bucket(bucket, manifest)
        slot = self._sent % 2
        # Segment ``slot`` last held bucket ``sent - 2``: its answer (answer ``sent - 1``, after
        # the begin's) says the receiving process no longer reads it.
        label = f"bucket {bucket.index} ({(manifest.names_in(bucket.index) or ['empty'])[0]}, ...)"
        self._read_answers(until=self._sent if self._sent >= 2 else 0, label=label)
        name = None
        if encoded.payload_bytes:
            segment = self._segment(slot, encoded.payload_bytes)
            view = torch.frombuffer(segment.buf, dtype=torch.uint8, count=encoded.payload_bytes)
            encoded.write_payload(view)
            del view  # the segment can be closed only once no tensor views it
            name = segment.name
        control = {"op": "bucket", "index": bucket.index, "slot": slot, "segment": name}
        control["payload_bytes"] = encoded.payload_bytes
        self._send(control, encoded.header, label)
        self._sent += 1

    def finish(self) -> None:
        """Wait until every bucket is loaded and the receiving process has finished too.

        Raises:
            WeightLoadError: the receiving process's receiver failed (its text).
            WeightExportError: the process died or did not answer within ``bound_s``.
        """
        self._open_export()
        try:
            self._send({"op": "finish"}, None, "the end of the export")
            self._read_answers(until=self._sent + 2, label="the end of the export")
        finally:
            self._manifest = None

    def abort(self, error: BaseException) -> None:
        """Tell the receiving process the export failed (its receiver's ``abort`` is called)."""
        manifest, self._manifest = self._manifest, None
        if manifest is None or self._conn is None:
            return
        try:
            self._send({"op": "abort", "error": f"{type(error).__name__}: {error}"}, None, "abort")
            self._read_answers(until=self._sent + 2, label="the abort", failures=False)
        except WeightExportError as lost:
            logger.warning("the receiving process did not take the abort: %s", lost)

    def close(self, *, stop_serving: bool = False) -> None:
        """Close the connection and unlink the segments.

        Args:
            stop_serving: also end the serving loop (:func:`serve_shared_memory` returns);
                otherwise it waits for the next sender.
        """
        if self._conn is not None:
            if stop_serving:
                with contextlib.suppress(OSError):  # it is gone already
                    self._conn.send_bytes(json.dumps({"op": "stop"}).encode())
            self._drop_connection()
        segments, self._segments = self._segments, [None, None]
        for segment in filter(None, segments):
            release(segment, unlink=True)

    def __enter__(self) -> SharedMemorySender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open_export(self) -> ExportManifest:
        if self._manifest is None:
            raise RuntimeError("SharedMemorySender: no export begun (call begin first)")
        if self._conn is None:
            raise WeightExportError(f"the receiving process at {self.address} is gone")
        return self._manifest

    def _segment(self, slot: int, nbytes: int) -> SharedMemory:
        segment = self._segments[slot]
        if segment is None or segment.size < nbytes:
            if segment is not None:
                release(segment, unlink=True)  # the receiving process maps the new one
            segment = SharedMemory(create=True, size=max(nbytes, self._size_hint))
            self._segments[slot] = segment
        return segment

    def _send(self, control: dict[str, Any], header: bytes | None, label: str) -> None:
        assert self._conn is not None, "sent on a closed connection"
        try:
            self._conn.send_bytes(json.dumps(control).encode())
            if header is not None:
                self._conn.send_bytes(header)
        except OSError as error:
            raise self._lost(f"sending {label}", error) from error

    def _read_answers(self, *, until: int, label: str, failures: bool = True) -> None:
        """Read answers until ``until`` are in (those already waiting, for ``until`` <= 0)."""
        conn = self._conn
        assert conn is not None, "read on a closed connection"
        while self._answered < until or (self._answered < self._sent + 2 and conn.poll(0)):
            try:
                came = conn.poll(self.bound_s)
                answer = json.loads(conn.recv_bytes(_MAX_FRAME)) if came else None
            except (EOFError, OSError, ValueError) as error:
                raise self._lost(f"waiting for {label}", error) from error
            if not isinstance(answer, dict) or not isinstance(answer.get("ok"), bool):
                why = f"a malformed answer {answer!r}" if came else f"none in {self.bound_s:g} s"
                raise self._lost(f"waiting for {label}: {why}", None)
            self._answered += 1
            if not answer["ok"] and self._failure is None:
                self._failure = str(answer.get("error", "no reason given"))
            if answer.get("op") == "abort":
                return
        if failures and self._failure is not None:
            raise WeightLoadError(f"the receiving process at {self.address}: {self._failure}")

    def _lost(self, what: str, error: BaseException | None) -> WeightExportError:
        self._drop_connection()
        cause = "" if error is None else f" ({type(error).__name__}: {error})"
        return WeightExportError(
            f"the receiving process at {self.address} died or stopped answering: {what}{cause}"
        )

    def _drop_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def serve_shared_memory(
    address: Address,
    authkey: bytes,
    receiver: WeightReceiver,
    *,
    ready: Callable[[], None] | None = None,
) -> int:
    """Serve exports from :class:`SharedMemorySender` until one says stop; returns how many.

    Runs in the receiving process (blocking). A sender that disconnects without stopping may be
    followed by another: the loop accepts the next connection.

    Args:
        address: where to listen (a Unix socket path, or host, port).
        authkey: the key both sides share.
        receiver: takes each export (``begin``, ``receive`` per bucket, ``finish``/``abort``).
            The bucket tensors it is given view the shared segment: valid during ``receive``.
        ready: called once the address listens.
    """
    served = 0
    with Listener(address, authkey=authkey) as listener:
        if ready is not None:
            ready()
        while True:
            try:
                conn = listener.accept()
            except (OSError, EOFError) as error:  # a failed handshake: not our sender
                logger.warning("refused a connection to %s: %s", address, error)
                continue
            with conn:
                session = _ServingSession(conn, receiver)
                stopped = session.run()
                served += session.finished
            if stopped:
                return served


def serve_connection(conn: Connection, receiver: WeightReceiver) -> int:
    """Serve one sender's connection, accepted by the caller, until stop or until it is gone.

    For a receiving process that must not wait for a sender without a bound (``vllm_server``'s
    worker accepts its sender itself). Closes ``conn``; returns the exports finished.
    """
    with conn:
        session = _ServingSession(conn, receiver)
        session.run()
        return session.finished


class _ServingSession:
    """One sender's connection: its messages answered in order, one answer each."""

    def __init__(self, conn: Connection, receiver: WeightReceiver) -> None:
        self.conn, self.receiver = conn, receiver
        self.manifest: ExportManifest | None = None
        self.failure: str | None = None
        self.segments: dict[int, MappedSegment] = {}
        self.finished = 0

    def run(self) -> bool:
        """Serve until stop (True) or until the sender is gone (False)."""
        try:
            while True:
                control = json.loads(self.conn.recv_bytes(_MAX_FRAME))
                op = control.get("op") if isinstance(control, dict) else None
                if op == "stop":
                    return True
                header = self.conn.recv_bytes(_MAX_FRAME) if op in ("begin", "bucket") else b""
                error = self._handle(op, control, header)
                answer = {"op": op, "ok": error is None, "error": error}
                self.conn.send_bytes(json.dumps(answer).encode())
        except (EOFError, OSError, ValueError) as error:
            logger.info("the sender's connection ended: %s", error)
            if self.manifest is not None:
                self.receiver.abort(WeightExportError(f"the sender's connection ended: {error}"))
            return False
        finally:
            for segment in self.segments.values():
                release(segment, unlink=False)

    def _handle(self, op: object, control: dict[str, Any], header: bytes) -> str | None:
        """Do what ``op`` asks; the error text, or None."""
        try:
            if op == "begin":
                self.failure, self.manifest = None, None
                self.manifest = wire.decode_manifest(header)
                self.receiver.begin(self.manifest)
            elif op == "bucket" and self.failure is None:
                self._load(control, header)
            elif op in ("finish", "abort"):
                self._end(op, control)
            elif op != "bucket":
                raise WeightLoadError(f"unknown message {op!r}")
        except Exception as error:
            if self.failure is None:
                self.failure = f"{type(error).__name__}: {error}"
                logger.warning("export failed in this process: %s", self.failure)
        return self.failure

    def _load(self, control: dict[str, Any], header: bytes) -> None:
        size, slot, name = control.get("payload_bytes"), control.get("slot"), control.get("segment")
        if self.manifest is None:
            raise WeightLoadError("a bucket came before its manifest")
        if not isinstance(size, int) or size < 0 or slot not in (0, 1) or (size and not name):
            raise WeightLoadError(f"a malformed bucket message: {control!r}")
        payload = torch.empty(0, dtype=torch.uint8)
        if size:
            segment = self._map(slot, str(name))
            if segment.size < size:
                raise WeightLoadError(f"segment {name} holds {segment.size} bytes, not {size}")
            payload = torch.frombuffer(segment.buf, dtype=torch.uint8, count=size)
        bucket = wire.decode_bucket(header, payload, self.manifest)
        del payload  # the bucket's tensors view the segment while it is loaded
        self.receiver.receive(bucket)

    def _end(self, op: str, control: dict[str, Any]) -> None:
        manifest, self.manifest = self.manifest, None
        if manifest is None:
            return
        if op == "abort":
            self.receiver.abort(WeightExportError(str(control.get("error"))))
        elif self.failure is not None:
            self.receiver.abort(WeightLoadError(self.failure))
        else:
            self.receiver.finish()
            self.finished += 1

    def _map(self, slot: int, name: str) -> MappedSegment:
        held = self.segments.get(slot)
        if held is not None and held.name == name:
            return held
        if held is not None:
            release(held, unlink=False)
        segment = attach(name)
        self.segments[slot] = segment
        return segment


def _connect(address: Address, authkey: bytes, bound_s: float) -> Connection:
    """A connection to the serving process: retried while it starts, at most ``bound_s``.

    The handshake runs in a helper thread: a peer that accepts and then says nothing cannot
    hold this rank past the bound.
    """
    result: list[Connection | BaseException] = []
    gave_up = threading.Event()

    def attempt() -> None:
        while True:
            try:
                result.append(Client(address, authkey=authkey))
            except (FileNotFoundError, ConnectionRefusedError) as error:
                if not gave_up.wait(0.05):  # not listening yet: again, until the bound
                    continue
                result.append(error)
            except Exception as error:
                result.append(error)
            return

    thread = threading.Thread(target=attempt, name="shardkit-export-connect", daemon=True)
    thread.start()
    thread.join(bound_s)
    gave_up.set()
    thread.join(1.0)
    if result and isinstance(result[0], Connection):
        return result[0]
    reason = f"{type(result[0]).__name__}: {result[0]}" if result else "no handshake"
    raise WeightExportError(
        f"could not reach the receiving process at {address} within {bound_s:g} s ({reason})"
    )
