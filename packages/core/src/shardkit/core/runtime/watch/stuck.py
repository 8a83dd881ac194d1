"""Stuck waits: every rank waits in an engine collective, and not all on the same one.

A sharded module that one rank runs and another skips (not marked conditional) leaves the
first waiting in the module's all-gather and the second in its next collective, a
reduce-scatter, say: neither is ever joined. Gloo would end it after the process group's
timeout (30 minutes by default) with "Timed out waiting ... for recv", naming nothing. Here the
ranks find out in seconds and every rank raises the same
:class:`~shardkit.core.errors.StuckCollectiveError`, naming what each waits on.

Nothing happens while waits are short: the check is run by the hang watch's thread
(``runtime/watch/hang.py``), and only for a wait that has lasted ``SHARDKIT_COLLECTIVE_BOUND``
seconds (:func:`~shardkit.core.runtime.watch.progress.set_collective_bound`, default 5). From then
on, every ``_FAST_POLL_S``, the waiting rank posts what it waits on to the c10d store with a
beat that counts up. Rank 0 decides: when its own wait is that old and every other rank's
record shows a wait that is still going on (the same wait, its beat moved since rank 0's last
look), nobody can issue anything new, so a wait whose partners did not issue their side by now
never ends. If a rank waits on a collective that another rank ran as a different one at the
same turn (its sequence number on the group), or never issued (the last it issued comes
before), rank 0 writes the verdict.
Each waiting rank reads it and breaks its own wait: a wait with a timeout of a millisecond on
one of the works it waits on, which makes gloo close the group's connections (gloo cannot
abandon one wait alone, and torch does not bind a work's ``abort``). The wait in the training
thread then fails, and the wait site raises the verdict's message instead of gloo's error
(:func:`raise_if_stuck`), so the program can catch it.

Not accused: a rank that computes, saves a checkpoint or runs a collective of the program's
own (it is not waiting in an engine collective), and ranks that all wait on the same
collective (a slow transfer). Those waits go on, and the hang report stays the backstop. A
rank waiting in a gloo collective that is not a point-to-point exchange (the all-reduce of
HSDP's replicas) cannot break its own wait (its timeout leaves the connections open); it fails
once a peer's break closes their connection (not tested). On an accelerator the host
rarely waits in a collective (``wait()`` orders the stream and returns): nothing here fires,
and a collective stuck on the device is the backend's watchdog's. See [Note: desync checks].
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from shardkit.core.errors import StuckCollectiveError
from shardkit.core.runtime.groups import progress_store
from shardkit.core.runtime.watch.progress import PROGRESS, SETTINGS, CollectiveInfo
from shardkit.core.runtime.watch.store_board import StoreBoard

__all__ = ["StuckCheck", "raise_if_stuck", "ranks_label"]

_FAST_POLL_S = 0.25  # how often a rank posts and looks once its wait passed the bound
_VERDICT = "stuck/verdict"  # {"waits": {rank: wait token}, "message": ...}
# Waits of this process, told apart from an earlier process's on the same store (a restart).
_PROCESS = f"{os.getpid()}-{time.time_ns()}"
# A rank whose connections were closed by another rank's break may fail before it read the
# verdict itself; it reads the store for this long.
_VERDICT_WAIT_S = 3.0
_BREAK = timedelta(milliseconds=1)

_INTERRUPTED: dict[str, str] = {}  # wait token -> the message; set by the watch, read by the wait


def _wait_token() -> str:
    """The current wait of this process (its start time names it)."""
    return f"{_PROCESS}:{PROGRESS.waiting_since!r}"


def _past_bound() -> bool:
    bound = SETTINGS.collective_bound_s
    return bool(bound) and time.monotonic() - PROGRESS.waiting_since >= bound


class StuckCheck:
    """The hang watch's part in finding stuck waits (one per watch; run in its thread)."""

    def __init__(
        self,
        rank: int,
        world: int,
        board: StoreBoard,
    ) -> None:
        self.rank = rank
        self.world = world
        self._board = board
        self._token = ""  # the wait being posted
        self._beat = 0
        self._seen: dict[int, tuple[str, int]] = {}  # rank 0: each rank's last wait and beat

    def next_poll(self, default_s: float) -> float:
        """How long the watch may sleep: until this rank's wait reaches the bound at most."""
        if PROGRESS.waiting is None or not SETTINGS.collective_bound_s:
            return default_s
        left = PROGRESS.waiting_since + SETTINGS.collective_bound_s - time.monotonic()
        return min(default_s, max(left, _FAST_POLL_S))

    def poll(self) -> None:
        """Post this rank's wait once it passed the bound; decide (rank 0); obey a verdict."""
        waiting = PROGRESS.waiting
        if waiting is None or not _past_bound():
            return
        token = _wait_token()
        if token != self._token:
            self._token, self._beat, self._seen = token, 0, {}
        self._beat += 1
        last = PROGRESS.last
        record = {
            "wait": token,
            "beat": self._beat,
            "info": asdict(waiting),
            "last": asdict(last) if last is not None else None,
            "forward": PROGRESS.forward_modules,
        }
        self._board.post(f"blocked/{self.rank}", json.dumps(record))
        if self.rank == 0:
            self._decide(token, waiting)
        self._obey(token)

    def _decide(self, token: str, own: CollectiveInfo) -> None:
        """Write the verdict if every rank waits on and on, and some wait can never end."""
        last = PROGRESS.last
        waits, infos, lasts, live = {0: token}, [own], [last], True
        forwards = [list(PROGRESS.forward_modules)]
        for rank in range(1, self.world):
            record = _parse(self._board.read(f"blocked/{rank}"))
            if record is None:
                live = False  # it never waited that long: it computes, or waits elsewhere
                continue
            wait, beat = str(record["wait"]), int(record["beat"])
            before = self._seen.get(rank)
            self._seen[rank] = (wait, beat)
            # Seen waiting twice, the same wait with its beat moved: not a record left behind.
            live &= before is not None and before[0] == wait and beat > before[1]
            waits[rank] = wait
            infos.append(CollectiveInfo(**record["info"]))
            lasts.append(CollectiveInfo(**record["last"]) if record["last"] else None)
            forwards.append([str(m) for m in record.get("forward") or ()])
        if not live or not _unpaired(infos, lasts):
            return
        message = _message(infos, forwards)
        verdict = {"waits": {str(r): w for r, w in waits.items()}, "message": message}
        self._board.post(_VERDICT, json.dumps(verdict))

    def _obey(self, token: str) -> None:
        """If the verdict names this rank's wait, break it (the waiting thread then raises)."""
        verdict = _parse(self._board.read(_VERDICT))
        if verdict is None or verdict["waits"].get(str(self.rank)) != token:
            return
        if token != _wait_token():
            return  # the wait ended meanwhile: nothing to break
        _INTERRUPTED[token] = str(verdict["message"])
        for work in PROGRESS.waiting_works:
            if isinstance(work, dist.Work):
                # Times out (or finds the connections closed already) and closes the group's
                # connections: every wait on them fails.
                with contextlib.suppress(Exception):
                    work.wait(_BREAK)
                return


def _unpaired(waits: list[CollectiveInfo], lasts: list[CollectiveInfo | None]) -> bool:
    """Whether a rank waits on a collective that another rank ran otherwise, or never issued.

    Every rank is past the bound and issues nothing more, so either proves that the wait
    never ends; ranks waiting on collectives that each rank issued alike may only be slow
    (one collective's transfer still under way while another rank waits on its next).
    """
    for rank, wanted in enumerate(waits):
        for peer, theirs in enumerate(waits):
            if peer == rank:
                continue
            if theirs.seq == wanted.seq and theirs != wanted:
                return True  # the same turn, another collective: they never pair
            last = lasts[peer]
            if wanted.seq > 0 and (last is None or last.seq < wanted.seq):
                return True  # the peer never issued it
    return False


def raise_if_stuck(error: BaseException) -> None:
    """At a wait that failed: raise the verdict that broke it instead, if there is one.

    Called by the wait sites, in the waiting thread, before the wait is marked over. A wait
    younger than the bound failed for its own reasons: the caller re-raises ``error``.

    Raises:
        StuckCollectiveError: the message every rank raises, from ``error``.
    """
    if PROGRESS.waiting is None or not _past_bound() or not dist.is_initialized():
        return
    token = _wait_token()
    message = _INTERRUPTED.pop(token, None)
    deadline = time.monotonic() + _VERDICT_WAIT_S
    while message is None and time.monotonic() < deadline:
        verdict = _parse(StoreBoard(progress_store()).read(_VERDICT))
        if verdict is not None and verdict["waits"].get(str(dist.get_rank())) == token:
            message = str(verdict["message"])
        else:
            time.sleep(_FAST_POLL_S / 5)
    if message is not None:
        raise StuckCollectiveError(message) from error


def _parse(raw: str | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        parsed = json.loads(raw)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _message(infos: list[CollectiveInfo], forwards: list[list[str]] | None = None) -> str:
    """The error's text, from what each rank waits on (rank order): the same on every rank.

    ``forwards``: each rank's sharded modules of its latest forward, in order, which name where
    the ranks went apart (a module one rank skipped), not only where each ended up waiting.
    """
    by_info: dict[CollectiveInfo, list[int]] = {}
    for rank, info in enumerate(infos):
        by_info.setdefault(info, []).append(rank)
    sides = "; ".join(f"{ranks_label(ranks)}: {info.detail()}" for info, ranks in by_info.items())
    return (
        f"ranks {list(range(len(infos)))} wait in collectives that cannot pair: {sides}. "
        f"{_first_difference(forwards or [])}"
        f"Every rank has waited over {SETTINGS.collective_bound_s:g} s "
        "(SHARDKIT_COLLECTIVE_BOUND) and none can go on. A sharded module that some ranks skip "
        "or run in another order must be marked with set_conditional(True); ranks with "
        "different numbers of batches must train under torch's Join([model], optimizer=...). "
        "The process group's connections were closed to end the waits: it cannot be used again "
        "(make a new one, or restart the job)"
    )


def _first_difference(forwards: list[list[str]]) -> str:
    """Where the ranks' latest forwards first entered different modules ('' if nowhere).

    E.g. "Their forwards went apart at the 2nd sharded module: rank 0 ran `tower`, rank 1 did
    not." A rank whose list ended there ran no sharded module more in that forward.
    """
    for i in range(max((len(f) for f in forwards), default=0)):
        at = [f[i] if i < len(f) else None for f in forwards]
        if len(set(at)) == 1:
            continue
        by_module: dict[str | None, list[int]] = {}
        for rank, module in enumerate(at):
            by_module.setdefault(module, []).append(rank)
        sides = [
            f"{ranks_label(ranks)} did not"
            if module is None
            else f"{ranks_label(ranks)} ran `{module}`"
            for module, ranks in sorted(by_module.items(), key=lambda kv: kv[1])
        ]
        where = f"the {_ordinal(i + 1)} sharded module"
        return f"Their forwards went apart at {where}: {', '.join(sides)}. "
    return ""


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def ranks_label(members: list[int]) -> str:
    """``rank 3`` or ``ranks 0, 1``: who waits on, or issued, one collective."""
    if len(members) == 1:
        return f"rank {members[0]}"
    return "ranks " + ", ".join(str(m) for m in members)
