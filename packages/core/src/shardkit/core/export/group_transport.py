"""Exports to receiver processes over a process group of their own (the server mode).

The trainer's receiving rank and K receiver processes (inference servers, on this host or
others) form a group of 1 + K ranks through a ``TCPStore`` the trainer's rank hosts
(:mod:`shardkit.core.runtime.export.receiver_group`: gloo on CPU, NCCL on CUDA; never the trainer's
world). :class:`GroupSender`, a :class:`~shardkit.core.export.receivers.WeightReceiver` on the
trainer's side, broadcasts each manifest and bucket in the wire format
(:mod:`shardkit.core.export.wire`), so every receiver gets the same bytes; each receiver's
:func:`serve_receiver_group` decodes them and calls its local receiver.

The store carries what is not bytes of weights, under the group's generation: which export
comes next (or stop), a receiver's first failure (the sender stops sending buckets at once),
and at the end each receiver's status. The sender's ``finish`` raises
:class:`~shardkit.core.errors.WeightLoadError` with every failed receiver's text; the serving
loops stay up for the next export. A receiver that dies or stalls past ``bound_s`` makes the
sender raise :class:`~shardkit.core.errors.WeightExportError` naming the bucket; the group is
then dropped, and the next export forms a new one with the receivers still there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable

import torch

from shardkit.core.errors import WeightExportError, WeightLoadError
from shardkit.core.export.messages import ExportManifest, WeightBucket
from shardkit.core.export.receivers import WeightReceiver
from shardkit.core.export.wire import decode_bucket, decode_manifest, encode_bucket, encode_manifest
from shardkit.core.runtime.export.receiver_group import ReceiverGroup, ReceiverGroupSpec

__all__ = ["GroupSender", "ReceiverGroupSpec", "serve_receiver_group"]

logger = logging.getLogger(__name__)

_MANIFEST, _BUCKET, _FINISH, _ABORT = 1, 2, 3, 4
_POLL_S = 0.02
_OK = json.dumps({"ok": True, "error": None})  # a receiver's status after a good export


class GroupSender:
    """Broadcasts exports to the receiver processes of ``spec``.

    The group is formed at the first ``begin``, and again after a failure.

    Args:
        spec: the store's host and port (this rank hosts it; port 0 picks a free one, see
            :attr:`port`), the number of receivers, the device (``"cpu"``: gloo;
            ``"cuda:N"``: NCCL) and the bounds.
    """

    def __init__(self, spec: ReceiverGroupSpec) -> None:
        self.spec = spec
        self.group = ReceiverGroup(spec, 0)
        self._manifest: ExportManifest | None = None
        self._seq = 0  # exports sent on this generation's group

    @property
    def port(self) -> int:
        """The store's port: the receivers' ``ReceiverGroupSpec.port``."""
        return self.group.port

    def begin(self, manifest: ExportManifest) -> None:
        """Form the group if needed, then announce the export and broadcast its manifest.

        Raises:
            WeightExportError: a receiver did not join within ``join_s``, or the group failed.
        """
        if self._manifest is not None:
            raise RuntimeError("GroupSender.begin: the previous export is still open")
        if not self.group.formed:
            self._form()
        self._manifest = manifest
        try:
            self.group.post(f"next/{self._seq}", "export")
            self._send(_MANIFEST, encode_manifest(manifest).header, None, "the manifest")
        except BaseException:
            self._end()  # no export is open: the caller need not abort it
            raise

    def receive(self, bucket: WeightBucket) -> None:
        """Broadcast ``bucket`` (unless a receiver has already failed).

        Raises:
            WeightLoadError: a receiver's local receiver failed (its text).
            WeightExportError: the group failed or a receiver stalled past ``bound_s``.
        """
        manifest = self._open()
        failed = self.group.read(f"failed/{self._seq}")
        if failed is not None:
            raise WeightLoadError(f"export {manifest.export_id}: {failed}")
        encoded = encode_bucket(bucket, manifest)
        names = manifest.names_in(bucket.index)
        label = f"bucket {bucket.index} ({names[0] if names else 'empty'}, ...)"
        payload = encoded.payload(self.group.device) if encoded.payload_bytes else None
        self._send(_BUCKET, encoded.header, payload, label)

    def finish(self) -> None:
        """End the export and collect every receiver's status.

        Raises:
            WeightLoadError: one or more receivers failed (each one's rank and text).
            WeightExportError: the group failed, or a receiver did not report within the bound.
        """
        manifest = self._open()
        try:
            self._send(_FINISH, b"", None, "the end of the export")
            problems, deadline = [], time.monotonic() + self.spec.bound_s
            for rank in range(1, self.spec.receivers + 1):
                left = max(deadline - time.monotonic(), 0.0)  # one bound for all of them
                try:
                    status = self.group.wait_for(f"status/{self._seq}/{rank}", left)
                except TimeoutError as error:
                    raise self._broken(f"receiver rank {rank}'s status", error) from error
                if status != _OK:  # anything else is a failure
                    problems.append(f"receiver rank {rank}: {_failure_text(status)}")
            if problems:
                raise WeightLoadError(f"export {manifest.export_id}: " + "; ".join(problems))
        finally:
            self._end()

    def abort(self, error: BaseException) -> None:
        """Tell the receivers the export failed (their receivers' ``abort`` is called)."""
        if self._manifest is None:
            return
        try:
            if self.group.formed:
                text = f"{type(error).__name__}: {error}".encode()
                self._send(_ABORT, text, None, "the abort")
        except WeightExportError as lost:
            logger.warning("the receivers did not take the abort: %s", lost)
        finally:
            self._end()

    def close(self, *, stop_serving: bool = False) -> None:
        """Drop the group and stop hosting the store.

        Args:
            stop_serving: first tell the receivers' serving loops to return; otherwise they
                return once the store is gone.
        """
        if stop_serving:
            self.group.post(f"next/{self._seq}" if self.group.formed else "form", "stop")
            time.sleep(4 * _POLL_S)  # the store goes with this rank: let them read it first
        self.group.close()

    def __enter__(self) -> GroupSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _form(self) -> None:
        try:
            for rank in range(1, self.spec.receivers + 1):
                self.group.wait_for(f"joined/{rank}", self.spec.join_s)
            self.group.post("form", "form")
            self.group.form()
        except (TimeoutError, RuntimeError) as error:
            self.group.drop()
            raise WeightExportError(
                f"the receiver group at {self.spec.host}:{self.port} did not form: {error}"
            ) from error
        self._seq = 0

    def _open(self) -> ExportManifest:
        if self._manifest is None:
            raise RuntimeError("GroupSender: no export begun (call begin first)")
        return self._manifest

    def _end(self) -> None:
        self._manifest = None
        self._seq += 1

    def _send(self, kind: int, header: bytes, payload: torch.Tensor | None, label: str) -> None:
        try:
            self.group.broadcast_message(kind, header, payload)
        except (TimeoutError, RuntimeError) as error:
            raise self._broken(label, error) from error

    def _broken(self, label: str, error: BaseException) -> WeightExportError:
        """Drop the group (the receivers waiting on the store are told to regroup)."""
        export = "" if self._manifest is None else f"export {self._manifest.export_id}: "
        with contextlib.suppress(RuntimeError):
            self.group.post("regroup", "regroup")
        self.group.drop()
        return WeightExportError(
            f"{export}the receiver group failed at {label}: {type(error).__name__}: {error}"
        )


def serve_receiver_group(
    spec: ReceiverGroupSpec,
    rank: int,
    receiver: WeightReceiver,
    *,
    ready: Callable[[], None] | None = None,
) -> int:
    """Serve exports broadcast by :class:`GroupSender` until told to stop; returns how many.

    Runs in a receiver process (blocking). It joins the group (waiting for the trainer for as
    long as it takes), and joins again after a failure. It returns when the sender says stop
    or its store is gone.

    Args:
        spec: the trainer's store address, the number of receivers and the bounds (the same
            on every rank), and this process's device (``"cuda:N"``: its own GPU).
        rank: this receiver's rank, 1 to ``spec.receivers``.
        receiver: takes each export. The bucket tensors it is given view the received bytes.
        ready: called once this process has reached the store.
    """
    if not 1 <= rank <= spec.receivers:
        raise ValueError(f"serve_receiver_group: rank {rank} outside 1..{spec.receivers}")
    group = ReceiverGroup(spec, rank)
    if ready is not None:
        ready()
    served = 0
    try:
        while True:
            group.post(f"joined/{rank}", "1")
            if group.wait_for("form", None) == "stop":
                return served
            try:
                group.form()
            except RuntimeError as error:
                logger.warning("the receiver group did not form: %s", error)
                group.drop()
                continue
            seq = 0
            while (what := _next(group, seq)) == "export":
                if not _serve_export(group, seq, receiver):
                    break
                served, seq = served + 1, seq + 1
            if what == "stop":
                return served
            group.drop()
    except (RuntimeError, OSError) as error:  # the trainer's store is gone
        logger.info("the trainer's store is gone; serving ends: %s", error)
        return served


def _failure_text(status: str) -> str:
    """A receiver's error text out of its status (a JSON object; checked, it is untrusted)."""
    try:
        error = json.loads(status).get("error")
    except (ValueError, AttributeError):
        error = None
    return error if isinstance(error, str) else f"a malformed status {status[:200]!r}"


def _next(group: ReceiverGroup, seq: int) -> str:
    """What comes next on this generation: ``export``, ``stop`` or ``regroup`` (waits)."""
    while True:
        for name in (f"next/{seq}", "regroup"):
            value = group.read(name)
            if value is not None:
                return value
        time.sleep(_POLL_S)


def _serve_export(group: ReceiverGroup, seq: int, receiver: WeightReceiver) -> bool:
    """One export into ``receiver``; False if the group failed on the way."""
    manifest: ExportManifest | None = None
    failure: str | None = None
    while True:
        try:
            message = group.receive()
        except (TimeoutError, RuntimeError, ValueError) as error:
            logger.warning("the receiver group failed: %s", error)
            if manifest is not None:
                receiver.abort(WeightExportError(f"the receiver group failed: {error}"))
            return False
        try:
            if message.kind == _MANIFEST:
                manifest = decode_manifest(message.header)
                receiver.begin(manifest)
            elif message.kind == _BUCKET and failure is None:
                if manifest is None:
                    raise WeightLoadError("a bucket came before its manifest")
                receiver.receive(decode_bucket(message.header, message.payload, manifest))
            elif message.kind == _FINISH:
                if failure is None and manifest is not None:
                    receiver.finish()
            elif message.kind == _ABORT:
                failure = failure or message.header.decode(errors="replace")
                if manifest is not None:
                    receiver.abort(WeightExportError(failure))
            elif message.kind != _BUCKET:
                raise WeightLoadError(f"unknown message kind {message.kind}")
        except Exception as error:
            if failure is None:
                failure = f"{type(error).__name__}: {error}"
                group.post(f"failed/{seq}", f"receiver rank {group.rank}: {failure}")
                logger.warning("export failed in this process: %s", failure)
        if message.kind in (_FINISH, _ABORT):
            if message.kind == _FINISH and failure is not None and manifest is not None:
                receiver.abort(WeightLoadError(failure))
            status = _OK if failure is None else json.dumps({"ok": False, "error": failure})
            group.post(f"status/{seq}/{group.rank}", status)
            return True
