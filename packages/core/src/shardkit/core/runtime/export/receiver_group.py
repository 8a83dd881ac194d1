"""A process group of the trainer's receiving rank and its receiver processes, on its own.

The server mode of the weight export (``shardkit.core.export.group_transport``) broadcasts
each message from the trainer's receiving rank to K receiver processes (inference servers).
They are no part of the trainer's world, so the group is made here from its own ``TCPStore``
(hosted by the trainer's rank at the user's host and port) and a backend constructed directly:
gloo for CPU tensors, NCCL for CUDA ones. Nothing of ``torch.distributed``'s global state is
touched, so the trainer's default group and this one never meet.

A message is three broadcasts from rank 0: its kind and sizes (3 int64s), the header bytes,
the payload bytes. Every wait is bounded (``bound_s``): a peer that died or stalls makes the
waiting side raise :class:`TimeoutError` (or the backend's error) instead of hanging; the
group is then dropped, and a new one is formed under the next generation of store keys.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shardkit.core.runtime.watch.store_board import StoreBoard

__all__ = ["GroupMessage", "ReceiverGroup", "ReceiverGroupSpec"]

_POLL_S = 0.02
_MAX_HEADER = 256 * 2**20


@dataclass(frozen=True, kw_only=True, slots=True)
class ReceiverGroupSpec:
    """Where and how the trainer's receiving rank meets its receiver processes."""

    host: str
    """The trainer's host: its receiving rank hosts the group's ``TCPStore`` there."""
    port: int
    """The store's port (0 on the trainer: any free one; see ``ReceiverGroup.port``)."""
    receivers: int
    """K, the receiver processes: ranks 1 to K of the group (the trainer's rank is 0)."""
    device: str = "cpu"
    """Where the bytes travel in this process: ``"cpu"`` (gloo on every rank) or this process's
    CUDA device such as ``"cuda:0"`` (NCCL on every rank)."""
    bound_s: float = 60.0
    """How long any one wait may take once the group is formed: a receiver's wait for the next
    bucket includes the trainer's gather of it, and the backend's own timeout is this too."""
    join_s: float = 300.0
    """How long the trainer waits for every receiver to join (they may still be starting)."""

    def __post_init__(self) -> None:
        if self.receivers < 1:
            raise ValueError(f"ReceiverGroupSpec: receivers={self.receivers}, needs 1 or more")
        if self.bound_s <= 0 or self.join_s <= 0:
            raise ValueError("ReceiverGroupSpec: bound_s and join_s must be positive")
        if torch.device(self.device).type not in ("cpu", "cuda"):
            raise ValueError(f"ReceiverGroupSpec: device {self.device!r} is neither CPU nor CUDA")


@dataclass(frozen=True, slots=True)
class GroupMessage:
    """One message as a receiver gets it."""

    kind: int
    """The sender's code for what it is."""
    header: bytes
    payload: torch.Tensor
    """1-D uint8 on the group's device (empty when there is none)."""


class ReceiverGroup:
    """This process's side of the group: rank 0 (the trainer's receiving rank) or a receiver.

    The store is connected at construction (rank 0 hosts it); the process group itself is made
    by :meth:`form`, by every rank, once all have joined; :meth:`drop` forgets it.
    """

    def __init__(self, spec: ReceiverGroupSpec, rank: int) -> None:
        if not 0 <= rank <= spec.receivers:
            raise ValueError(f"ReceiverGroup: rank {rank} outside 0..{spec.receivers}")
        self.spec, self.rank = spec, rank
        self.device = torch.device(spec.device)
        store = dist.TCPStore(  # type: ignore[attr-defined]
            spec.host,
            spec.port,
            is_master=rank == 0,
            wait_for_workers=False,
            timeout=timedelta(seconds=spec.join_s),
        )
        self._tcp: Any = store
        self.store: Any = dist.PrefixStore("shardkit/receiver_group/", store)  # type: ignore[attr-defined]
        self.generation = 0
        self._group: Any = None

    @property
    def port(self) -> int:
        """The store's port (the one picked, where the spec said 0)."""
        return int(self._tcp.port)

    @property
    def formed(self) -> bool:
        """Whether this generation's process group exists."""
        return self._group is not None

    def key(self, name: str) -> str:
        """``name`` under this generation's keys."""
        return f"g{self.generation}/{name}"

    def post(self, name: str, value: str) -> None:
        """Set this generation's key ``name``."""
        StoreBoard(self.store, tolerant=False).post(self.key(name), value)

    def read(self, name: str) -> str | None:
        """This generation's key ``name``, if set."""
        return StoreBoard(self.store, tolerant=False).read(self.key(name))

    def wait_for(self, name: str, bound_s: float | None) -> str:
        """Wait for key ``name`` (for ever where ``bound_s`` is None); its value.

        Raises:
            TimeoutError: not set within ``bound_s``.
        """
        deadline = None if bound_s is None else time.monotonic() + bound_s
        while (value := self.read(name)) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{self.key(name)} not set within {bound_s:g} s")
            time.sleep(_POLL_S)
        return value

    def form(self) -> None:
        """Make this generation's process group (every rank calls this; it waits for all)."""
        store = dist.PrefixStore(f"g{self.generation}/pg/", self.store)  # type: ignore[attr-defined]
        size, timeout = self.spec.receivers + 1, timedelta(seconds=self.spec.bound_s)
        if self.device.type == "cpu":
            self._group = dist.ProcessGroupGloo(store, self.rank, size, timeout)
            return
        nccl: Any = getattr(dist, "ProcessGroupNCCL", None)
        if nccl is None:
            raise RuntimeError(f"device {self.device}: this torch has no NCCL")
        options = nccl.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        self._group = nccl(store, self.rank, size, options)

    def drop(self) -> None:
        """Forget this generation's group (after a failure); the next one uses new keys."""
        self._group = None
        self.generation += 1

    def broadcast_message(self, kind: int, header: bytes, payload: torch.Tensor | None) -> None:
        """Broadcast a message from rank 0: kind and sizes, header, then payload."""
        assert self.rank == 0, "only the trainer's rank sends"
        size = 0 if payload is None else payload.numel()
        self._broadcast(torch.tensor([kind, len(header), size], device=self.device))
        if header:
            self._broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device))
        if payload is not None and size:
            self._broadcast(payload)

    def receive(self) -> GroupMessage:
        """Take the next message broadcast from rank 0 (a receiver's side of :meth:`send`)."""
        sizes = torch.zeros(3, dtype=torch.int64, device=self.device)
        self._broadcast(sizes)
        kind, header_bytes, payload_bytes = (int(v) for v in sizes.tolist())
        if not (0 <= header_bytes <= _MAX_HEADER and payload_bytes >= 0):
            raise ValueError(f"a message of {header_bytes} + {payload_bytes} bytes")
        header = torch.empty(header_bytes, dtype=torch.uint8, device=self.device)
        if header_bytes:
            self._broadcast(header)
        payload = torch.empty(payload_bytes, dtype=torch.uint8, device=self.device)
        if payload_bytes:
            self._broadcast(payload)
        return GroupMessage(kind, bytes(header.cpu().numpy()), payload)

    def close(self) -> None:
        """Drop the group and the store connection (rank 0's store stops serving)."""
        self._group = None
        self.store = self._tcp = None

    def _broadcast(self, tensor: torch.Tensor) -> None:
        if self._group is None:
            raise RuntimeError("the receiver group is not formed (or was dropped)")
        options = dist.BroadcastOptions()
        options.rootRank = 0
        work = self._group.broadcast([tensor], options)
        deadline = time.monotonic() + self.spec.bound_s
        pause = 0.0002
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"a broadcast of {tensor.numel() * tensor.element_size()} bytes did not "
                    f"complete within {self.spec.bound_s:g} s"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
        work.wait()
