"""Outcomes shared between ranks, so that every rank raises the same error, at once.

Work that one rank does for all (the coordinator reading a file) or that each rank does for
itself (verifying its share of a checkpoint) can fail on some ranks only. A rank that raises
while the others go on to a collective leaves them waiting for the process group's timeout
(30 minutes by default). Here the outcome, a JSON value or an error, is shared first, and
every rank raises the same exception type with the same message.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from shardkit.core.errors import StateDictFileError
from shardkit.core.runtime.groups import cpu_group, global_rank, is_distributed, world_size
from shardkit.core.runtime.object_collectives import all_gather_bytes, broadcast_bytes

__all__ = ["Outcome", "agreed", "everyone", "from_rank", "raise_shared"]

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


def raise_shared(outcomes: list[Outcome]) -> list[Any]:
    """The values of ``everyone``'s outcomes, or the first failure's error, naming its rank."""
    for rank, outcome in enumerate(outcomes):
        if outcome.failed:
            failed = Outcome(None, outcome.error_type, f"rank {rank}: {outcome.message}")
            raise failed.exception()
    return [o.value for o in outcomes]


def agreed(work: Callable[[], _T], ranks: Iterable[int] | None = None) -> _T:
    """Run ``work`` on each of ``ranks``: its value on this rank, or one error on all of them.

    Collective over ``ranks`` (global ranks, this one among them; default: the world): every
    one of them must call it, and no other rank. Each runs its own ``work``; if any raised,
    every rank raises the first failed rank's error (the same type and message), so that ranks
    whose own work passed do not go on alone. The message names the failed rank(s), unless
    every rank failed alike (then it is that error, unchanged). Costs one all-gather of 8
    bytes per rank when every rank succeeds (a second carries the errors otherwise); none
    without a process group or with one rank.
    """
    members = tuple(sorted(set(ranks))) if ranks is not None else None
    if not is_distributed() or world_size() == 1 or (members is not None and len(members) < 2):
        return work()
    value: list[_T] = []
    outcome, original = _attempt(lambda: value.append(work()))
    group = cpu_group(members) if members is not None else None
    # A success is sent as nothing: when every rank succeeds, only the sizes travel (one
    # all-gather of 8 bytes per rank).
    payload = outcome.to_json() if outcome.failed else b""
    gathered = all_gather_bytes(payload, group)
    shared = [Outcome.from_json(data) if data else Outcome() for data in gathered]
    names = members if members is not None else range(len(shared))
    failed = [(rank, o) for rank, o in zip(names, shared, strict=True) if o.failed]
    if not failed:
        return value[0]
    first_rank, first = failed[0]
    if len(failed) < len(shared) or any(o != first for _, o in failed):
        others = [rank for rank, _ in failed[1:]]
        also = f" (rank(s) {others} failed too)" if others else ""
        first = Outcome(None, first.error_type, f"rank {first_rank}{also}: {first.message}")
    raise first.exception() from original
