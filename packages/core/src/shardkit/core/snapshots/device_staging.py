"""A memory snapshot of an accelerator's state: staged on the device, moved to the host off-thread.

A GPU rank's share (its parameters and optimizer state) lies in device memory. Copied tensor
by tensor into the slot file (host memory) on the training thread, it costs a host-device
round trip per tensor and holds the step for the whole transfer: 0.19 s a step for the 217M
GPT's 2.6 GB at W=1 on an H200 (a snapshot every step: 4.1 times the step). Staged instead:

1. on the training thread, one multi-tensor copy into a buffer on the device, laid out as the
   slot's data, on the current stream: the device runs it after the step that wrote the state
   and before anything the next step writes (stream order), so the host waits for nothing and
   only launches it; the few host tensors of the state (an optimizer's step counts) are
   copied aside on the host;
2. on the snapshot's background thread, once the device has done that copy (an event): the
   buffer travels to the host in chunks, each into a page-locked bounce buffer on a stream of
   its own (the training's kernels never queue behind it), and the executor's threads copy
   each chunk from its bounce buffer into the slot as it lands, put the host tensors' bytes
   that fall in it in place, and take its checksums while it is in their cache (one pass
   over the bytes, not a second one after the copy).

Why bounce buffers: the slot is a mapped file, pageable memory. One 2.6 GB copy straight into
it took the driver's pageable path, which held up the training's own small copies to the host
(its ``loss.item()``) until it was done: 1.58 times the step on the H200. Registering the
mapped file with the driver (``cudaHostRegister``) failed there ("invalid argument", which
then surfaced at the next kernel launch), so the slot is never registered.

The cost is memory: one more copy of the rank's share on the device, held while snapshots
are taken, and ``depth`` chunks of page-locked host memory. See [Note: memory snapshots].
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import Executor, Future
from typing import Any, NamedTuple

import torch

from shardkit.core.runtime.device import can_pin_memory, is_accelerator
from shardkit.core.snapshots.checksum import BLOCK_BYTES, checksums_of
from shardkit.core.snapshots.contents import Layout, Leaves

__all__ = ["CHUNK_BYTES", "DeviceStaging", "staging_device"]

CHUNK_BYTES = 32 * 2**20  # one device-to-host copy; a whole number of checksum blocks
assert CHUNK_BYTES % BLOCK_BYTES == 0


def staging_device(layout: Layout, leaves: Leaves) -> torch.device | None:
    """The accelerator the state lives on, if it lives on one (beside host tensors) only.

    None where every tensor is on the host (copied directly) or where the state spans more
    than one accelerator (copied tensor by tensor, as before staging).
    """
    devices = {leaves.tensors[e.key].device for e in layout.entries}
    accelerators = {d for d in devices if is_accelerator(d)}
    return accelerators.pop() if len(accelerators) == 1 else None


class DeviceStaging:
    """The device-side buffer of one rank's snapshots, and its trip to a slot's data.

    Args:
        layout: the snapshot's layout (the buffer has the slot's data layout).
        device: where the state lives (the host itself only in tests: the same steps, no
            streams, nothing queued).
        depth: bounce buffers, so many chunks in flight at once (the copying threads, and
            one more for the next transfer).
        chunk_bytes: one transfer's size, a whole number of checksum blocks (default
            ``CHUNK_BYTES``).
    """

    def __init__(
        self, layout: Layout, device: torch.device, *, depth: int = 2, chunk_bytes: int = 0
    ) -> None:
        chunk_bytes = chunk_bytes or CHUNK_BYTES
        if chunk_bytes % BLOCK_BYTES or depth < 1:
            raise ValueError(f"staging needs whole checksum blocks per chunk, got {chunk_bytes}")
        self.device, self.layout = device, layout
        self._chunk_bytes = chunk_bytes
        # Zeros: the gaps between tensors are never written, and a snapshot's bytes are the
        # same whichever path made them (a replayed gradient log is checked against them).
        self._buffer = torch.zeros(layout.data_bytes, dtype=torch.uint8, device=device)
        self._views = [entry.view(self._buffer) for entry in layout.entries]
        self._module: Any = torch.get_device_module(device) if device.type != "cpu" else None
        # Streams and events of the device's module; a host "device" (tests) needs neither.
        self._copy_stream: Any = self._module.Stream(device=device) if self._module else None
        self._staged: Any = None  # the event recorded after the last staging copy
        bounce = min(chunk_bytes, layout.data_bytes)
        pin = is_accelerator(device) and can_pin_memory()
        self._bounces = [
            torch.empty(bounce, dtype=torch.uint8, pin_memory=pin) for _ in range(depth)
        ]
        self._on_device: list[int] = []  # entry indices staged on the device
        self._on_host: list[int] = []  # entry indices copied aside on the host
        self._host_copies: list[torch.Tensor] = []
        self._overlays: dict[int, list[_Overlay]] = {}  # chunk index -> host bytes in it

    def stage(self, leaves: Leaves) -> None:
        """Launch the copy of ``leaves`` into the device buffer (training thread)."""
        sources = [leaves.tensors[e.key] for e in self.layout.entries]
        if not self._on_device and not self._on_host:
            for index, source in enumerate(sources):
                (self._on_device if source.device == self.device else self._on_host).append(index)
            self._host_copies = [torch.empty_like(sources[k]) for k in self._on_host]
            self._overlays = self._overlays_by_chunk()
        with torch.no_grad():
            if self._on_device:
                torch._foreach_copy_(
                    [self._views[k] for k in self._on_device],
                    [sources[k] for k in self._on_device],
                )
            if self._on_host:
                torch._foreach_copy_(self._host_copies, [sources[k] for k in self._on_host])
        if self._module is not None:
            # On the stream that ran the copy: the device's current one, which need not be
            # the current device's (a state on cuda:1 while cuda:0 is current).
            self._staged = self._module.Event()
            self._staged.record(self._module.current_stream(self.device))

    def to_host(self, data: torch.Tensor, executor: Executor | None) -> bytes:
        """Copy the staged snapshot into ``data``, a slot's data (background thread).

        Chunk by chunk through the bounce buffers; ``executor``'s threads (or this one)
        copy each chunk into ``data`` once it has landed, put the host tensors' bytes that
        fall in it in place, and sum it while its bytes are still in the core's cache.

        Returns:
            The data's checksums (``checksums_of(data)``, computed chunk by chunk: a chunk
            is a whole number of blocks).
        """
        depth = len(self._bounces)
        sums: list[Future[bytes]] = []  # each chunk's landing, in order
        with torch.no_grad(), self._on_copy_stream():
            for index, start in enumerate(range(0, data.numel(), self._chunk_bytes)):
                if index >= depth:
                    sums[index - depth].result()  # its bounce buffer is free again
                end = min(start + self._chunk_bytes, data.numel())
                bounce = self._bounces[index % depth][: end - start]
                bounce.copy_(self._buffer[start:end], non_blocking=True)
                landed = self._record_on_copy_stream()
                overlays = self._overlays.get(index, [])
                sums.append(_run(executor, _land, landed, bounce, data[start:end], overlays))
        return b"".join(job.result() for job in sums)

    def _overlays_by_chunk(self) -> dict[int, list[_Overlay]]:
        """Where each host tensor's bytes go, chunk by chunk (a tensor may span chunks)."""
        found: dict[int, list[_Overlay]] = {}
        for entry_index, host in zip(self._on_host, self._host_copies, strict=True):
            entry = self.layout.entries[entry_index]
            source = host.reshape(-1).view(torch.uint8)
            at = entry.offset
            while at < entry.offset + entry.nbytes:
                chunk = at // self._chunk_bytes
                stop = min(entry.offset + entry.nbytes, (chunk + 1) * self._chunk_bytes)
                within = at - chunk * self._chunk_bytes
                piece = source[at - entry.offset : stop - entry.offset]
                found.setdefault(chunk, []).append(_Overlay(within, piece))
                at = stop
        return found

    @contextlib.contextmanager
    def _on_copy_stream(self) -> Iterator[None]:
        if self._module is None:
            yield
            return
        with self._module.stream(self._copy_stream):
            self._copy_stream.wait_event(self._staged)  # the staging copy has run
            yield

    def _record_on_copy_stream(self) -> Any:
        if self._module is None:
            return None
        event = self._module.Event()
        event.record(self._copy_stream)
        return event


class _Overlay(NamedTuple):
    """Bytes of a host tensor's copy, and where in their chunk they go."""

    at: int  # into the chunk
    source: torch.Tensor  # uint8 view of the host copy's bytes


def _land(
    landed: Any, bounce: torch.Tensor, target: torch.Tensor, overlays: list[_Overlay]
) -> bytes:
    """A chunk into the slot once its transfer is done, host tensors' bytes in place; its sums."""
    if landed is not None:
        landed.synchronize()
    target.copy_(bounce)
    for overlay in overlays:
        target[overlay.at : overlay.at + overlay.source.numel()].copy_(overlay.source)
    return checksums_of(target)


def _run(executor: Executor | None, job: Any, *args: Any) -> Future[bytes]:
    """``job(*args)`` on ``executor``, or here and now (a future that is done)."""
    if executor is not None:
        return executor.submit(job, *args)
    done: Future[bytes] = Future()
    done.set_result(job(*args))
    return done
