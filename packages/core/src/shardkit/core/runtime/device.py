"""Everything that differs between devices lives here, and nowhere else.

On CPU, collectives run in gloo's own threads and their async work handles give overlap where
cores are free. On CUDA, NCCL runs collectives on its internal streams and ``Work.wait()``
makes the current stream wait, so the same async-handle protocol overlaps compute with
communication there too; what remains device specific is pinned memory, the device choice, and
the host's wait for copies to and from pinned memory (``HostCopies``, with CUDA events). See
[Note: gpu schedule].
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = [
    "HostCopies",
    "holds_no_memory",
    "can_pin_memory",
    "device_for_mesh_type",
    "is_accelerator",
    "on_stream",
    "pin",
    "prefers_fused_packing",
    "wait_for_host_copies",
]


def holds_no_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a meta tensor, or a fake one (``FakeTensorMode``).

    torchtitan's memory estimation runs a step on fake tensors: they have no bytes, and asking
    for their address is deprecated (every one reads 0).
    """
    return tensor.device.type == "meta" or hasattr(tensor, "fake_mode")


def is_accelerator(device: torch.device) -> bool:
    """Whether ``device`` is an accelerator (anything but the CPU and meta)."""
    return device.type not in ("cpu", "meta")


def device_for_mesh_type(device_type: str) -> torch.device:
    """The device that a mesh of ``device_type`` computes on, for this rank."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type)


def prefers_fused_packing(device: torch.device) -> bool:
    """Whether gradients are packed for a reduction with one fused kernel per group.

    On an accelerator every copy is a kernel launch, so a group's packing is one
    ``_chunk_cat`` (as torch's ``fully_shard`` packs). On CPU, ``_chunk_cat``'s kernel is
    slower than a ``cat`` of views or one copy per gradient (measured: 15 against 10 ms for
    a 67 MB group, 25 against 4.4 ms with a bf16-to-fp32 cast), and a copy costs no launch.
    """
    return is_accelerator(device)


def can_pin_memory() -> bool:
    """Whether pinned host memory exists on this build (it needs an accelerator)."""
    return bool(torch.cuda.is_available())


def pin(tensor: torch.Tensor) -> torch.Tensor:
    """Pinned copy of a CPU tensor, or the tensor itself where pinning does not exist."""
    if not can_pin_memory() or tensor.is_pinned():
        return tensor
    return tensor.pin_memory()


def wait_for_host_copies() -> None:
    """Block until device-to-host copies queued with ``non_blocking=True`` have landed."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextmanager
def on_stream(stream: Any, device: torch.device) -> Iterator[None]:
    """Run the block with ``stream`` as ``device``'s current stream (None: as it is).

    ``stream`` first waits for the work queued so far on the current stream (the block reads
    its results), and the current stream waits for the block's work after it, so what comes
    next reads the block's results. On CPU, ``torch.cpu.Stream`` works alike (with no queues,
    the waits are free) and ``current_stream()`` inside the block is ``stream``.
    """
    if stream is None:
        yield
        return
    module = torch.get_device_module(device)
    current = module.current_stream()
    stream.wait_stream(current)
    with module.stream(stream):
        yield
    current.wait_stream(stream)


class HostCopies:
    """Copies between an accelerator and pinned host memory that the host has not waited for.

    A copy queued with ``non_blocking=True`` returns before the data moved: a device-to-host
    copy's result must not be read, and the pinned source of a host-to-device copy must not be
    written, until it ran. An event recorded after such copies, on the stream that runs them,
    and synchronized before the host touches that memory, is the wait; later events on one
    stream stand for earlier ones, so one per stream is kept. On the CPU nothing is queued and
    every method is free. See [Note: gpu schedule] (CPU offload).
    """

    def __init__(self) -> None:
        self._events: dict[Any, Any] = {}  # stream -> its last event recorded after copies

    def to_host(self, tensor: torch.Tensor, *, non_blocking: bool) -> torch.Tensor:
        """``tensor`` on the CPU (itself if there already).

        ``non_blocking``: into pinned memory, not waited for until ``wait``; nothing may read
        the result before then. Otherwise the copy has landed on return (and so have the
        copies not yet waited for: the host reads this one beside theirs).
        """
        if tensor.device.type == "cpu":
            return tensor
        if not non_blocking:
            self.wait()
            return tensor.to("cpu")
        host = tensor.to("cpu", non_blocking=True)
        self.record(tensor.device)
        return host

    def record(self, device: torch.device) -> None:
        """Note that copies to or from pinned memory were queued on ``device``'s current stream."""
        if not is_accelerator(device):
            return
        stream = torch.get_device_module(device).current_stream(device)
        self._events[stream] = stream.record_event()

    @property
    def pending(self) -> bool:
        """Whether copies were recorded that the host has not waited for."""
        return bool(self._events)

    def wait(self) -> None:
        """Block the host until every copy recorded so far has run."""
        events, self._events = self._events, {}
        for event in events.values():
            event.synchronize()
