"""Outcomes shared between ranks, so that every rank raises the same error, at once.

Work that one rank does for all (the coordinator reading a file) or that each rank does for
itself (verifying its share of a checkpoint) can fail on some ranks only. A rank that raises
while the others go on to a collective leaves them waiting for the process group's timeout
(30 minutes by default). Here the outcome, a JSON value or an error, is shared first, and
every rank raises the same exception type with the same message.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from torch.distributed.device_mesh import DeviceMesh

from shardkit.core.errors import StateDictFileError
from shardkit.core.runtime.device import device_for_mesh_type
from shardkit.core.runtime.groups import global_rank, is_distributed, world_size
from shardkit.core.runtime.p2p.object_collectives import (
    all_gather_bytes,
    all_reduce_max,
    broadcast_bytes,
)

__all__ = ["Outcome", "agreed", "everyone", "from_rank", "problems_agreed", "raise_shared"]

_T = TypeVar("_T")

# Exception types rebuilt as themselves on the other ranks; any other becomes a RuntimeError
# that names its type. Their constructors take one message.
_SHAREABLE: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        StateDictFileError,
        FileNotFoundError,
        FileExistsError,
        IsADirectoryError,
        NotADirectoryError,
        PermissionError,
        OSError,
        ValueError,
        TypeError,
        RuntimeError,
    )
}


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one rank's work gave: a JSON value, or an error (its type name and message)."""

    value: Any = None
    error_type: str = ""
    message: str = ""

    @property
    def failed(self) -> bool:
        """Whether the work raised."""
        return bool(self.error_type)

    def to_json(self) -> bytes:
        """The outcome as JSON bytes."""
        return json.dumps([self.value, self.error_type, self.message]).encode()

    @staticmethod
    def from_json(data: bytes) -> Outcome:
        """The outcome that ``to_json`` wrote."""
        value, error_type, message = json.loads(data)
        return Outcome(value, error_type, message)

    def exception(self) -> Exception:
        """The error, rebuilt: the same type where it is shareable, else a RuntimeError."""
        cls = _SHAREABLE.get(self.error_type)
        if cls is None:
            return RuntimeError(f"{self.error_type}: {self.message}")
        return cls(self.message)


def _attempt(work: Callable[[], Any]) -> tuple[Outcome, Exception | None]:
    try:
        return Outcome(value=work()), None
    except Exception as error:
        return Outcome(error_type=type(error).__name__, message=str(error)), error


def from_rank(src: int, work: Callable[[], Any], *, doing: str = "") -> Any:
    """Run ``work`` on global rank ``src`` only; every rank returns its value or raises its error.

    Collective: every rank calls it (the others' ``work`` is not run). With ``doing`` (say
    ``"write model.pt"``) the error's message names the rank and what it did: "rank 0 could
    not write model.pt: [Errno 28] No space left on device".
    """
    original: Exception | None = None
    payload: bytes | None = None
    if global_rank() == src:
        outcome, original = _attempt(work)
        if outcome.failed and doing:
            message = f"rank {src} could not {doing}: {outcome.message}"
            outcome = Outcome(None, outcome.error_type, message)
        # A success without a value is sent as nothing: one broadcast of its size (8 bytes).
        payload = outcome.to_json() if outcome.failed or outcome.value is not None else b""
    data = broadcast_bytes(payload, src)
    shared = Outcome.from_json(data) if data else Outcome()
    if shared.failed:
        raise shared.exception() from original
    return shared.value


def everyone(work: Callable[[], Any]) -> list[Outcome]:
    """Run ``work`` on every rank; every rank gets every rank's outcome, in rank order."""
    outcome, _ = _attempt(work)
    return [Outcome.from_json(data) for data in all_gather_bytes(outcome.to_json())]


def problems_agreed(key: str, work: Callable[[], list[str]]) -> list[Outcome] | None:
    """Run ``work`` (what is wrong: [] if nothing) on every rank; the verdict, the same on all.

    ``key`` names what the ranks check (a checkpoint's name, say), so that ranks that look at
    different things are caught rather than agreeing by accident.

    Returns:
        [] where every rank's ``work`` returned [] for the same ``key``; every rank's outcome
        (``everyone``'s, in rank order) where any rank found a problem or raised; None where
        the ranks' keys differ (then nothing else was exchanged: the caller decides).

    Costs one all-reduce of 24 bytes when every rank passes, whatever the world: no rank's
    message travels unless one has something to say (then one ``everyone`` follows).
    """
    outcome, _ = _attempt(work)
    found = outcome.failed or bool(outcome.value)
    if not is_distributed() or world_size() == 1:
        return [outcome] if found else []
    digest = int.from_bytes(hashlib.sha256(key.encode()).digest()[:7], "big")
    most = all_reduce_max([int(found), digest, -digest])
    if most[1] != -most[2]:  # the largest key and the smallest differ
        return None
    if not most[0]:
        return []
    return [Outcome.from_json(data) for data in all_gather_bytes(outcome.to_json())]


def raise_shared(outcomes: list[Outcome]) -> list[Any]:
    """The values of ``everyone``'s outcomes, or the first failure's error, naming its rank."""
    for rank, outcome in enumerate(outcomes):
        if outcome.failed:
            failed = Outcome(None, outcome.error_type, f"rank {rank}: {outcome.message}")
            raise failed.exception()
    return [o.value for o in outcomes]


def agreed(work: Callable[[], _T], mesh: DeviceMesh | None) -> _T:
    """Run ``work`` on each rank of ``mesh``: its value on this rank, or one error on all of them.

    Collective over ``mesh`` (this rank among its ranks; None: this rank alone): every rank of
    it must call it, and no other rank. Each runs its own ``work``; if any raised, every rank
    raises the first failed rank's error (the same type and message), so that ranks whose own
    work passed do not go on alone. The message names the failed rank(s), unless every rank
    failed alike (then it is that error, unchanged). Costs one all-gather of 8 bytes per rank
    and mesh axis when every rank succeeds (more carry the errors otherwise); none without a
    process group or with one rank.

    The outcomes travel on the mesh's own groups, one all-gather along each axis in turn
    (after the last, every rank has every failure of the mesh), on tensors of the mesh's
    device (NCCL takes no CPU tensor). No group is made for the agreement: made by the
    mesh's ranks alone (a model on some ranks of the world, as a pipeline stage is), it would
    advance torch's group counter on them alone (torch 2.14 on), and the world's next group
    would be named differently on the two sides and hang. See [Note: agreed loads].
    """
    ranks = [] if mesh is None else [int(r) for r in mesh.mesh.flatten().tolist()]
    if not is_distributed() or world_size() == 1 or mesh is None or len(ranks) < 2:
        return work()
    value: list[_T] = []
    outcome, original = _attempt(lambda: value.append(work()))
    failures = _failures_on(mesh, outcome)
    if not failures:
        return value[0]
    failed = sorted(failures.items())
    first_rank, first = failed[0]
    if len(failed) < len(ranks) or any(o != first for _, o in failed):
        others = [rank for rank, _ in failed[1:]]
        also = f" (rank(s) {others} failed too)" if others else ""
        first = Outcome(None, first.error_type, f"rank {first_rank}{also}: {first.message}")
    raise first.exception() from original


def _failures_on(mesh: DeviceMesh, outcome: Outcome) -> dict[int, Outcome]:
    """The failed outcomes of every rank of ``mesh``, by global rank, on every rank of it."""
    device = device_for_mesh_type(mesh.device_type)
    # Only failures travel (by global rank, as JSON): when every rank succeeds, each
    # all-gather carries nothing but the sizes, 8 bytes per rank.
    known: dict[str, str] = {}
    if outcome.failed:
        known[str(global_rank())] = outcome.to_json().decode()
    for axis in range(mesh.ndim):
        group = mesh.get_group(axis)
        if group.size() == 1:
            continue
        payload = json.dumps(known).encode() if known else b""
        for data in all_gather_bytes(payload, group, device=device):
            if data:
                known.update(json.loads(data))
    return {int(rank): Outcome.from_json(data.encode()) for rank, data in known.items()}
