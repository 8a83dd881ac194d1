"""Hang reports: a rank stuck in a collective says where everyone is, and every rank says why.

A rank whose peers never join a collective (one ran an extra micro-batch, one returned early)
waits until the process group's timeout, 30 minutes by default, and then says nothing
useful. Here a daemon thread watches the runtime's waits. Every second it posts this rank's
progress (:data:`~shardkit.core.runtime.watch.progress.PROGRESS`) to the c10d store, and when a wait
has lasted ``SHARDKIT_HANG_TIMEOUT`` seconds (default 300) it gives up: it raises an alarm in
the store, logs a report and exits the process with :data:`HANG_EXIT_CODE`. The report says
what this rank waits on, its step and phase, the last collective every other rank reached
(read from the store) and this process's Python stacks.

The other ranks' watches see the alarm at their next poll and log their own report (what
they were doing instead: often a collective of the program's own, where no shardkit wait is
watched, which only their stacks show) before exiting with the same status. Every rank waits
a bounded time for every other rank's report before it exits: the first exit tears the job
down (torchrun stops the other workers; a rank's exit closes its gloo connections and may take
the store with it), and a rank killed before it reported leaves no explanation. The job ends
in minutes with the rank that went astray named, in every rank's log. See [Note: desync
checks].

The same thread runs the stuck check (``runtime/watch/stuck.py``): waits past
``SHARDKIT_COLLECTIVE_BOUND`` (5 s) in collectives that cannot pair raise an error in the
training thread of every rank, long before this report.

The thread is stopped and joined at interpreter exit (``atexit``), before the interpreter
tears down: a daemon thread caught inside a store call (C++, the GIL released) while the
process destroys its C++ globals could crash a job that had finished.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from shardkit.core.runtime.groups import global_rank, progress_store, world_size
from shardkit.core.runtime.watch.progress import PROGRESS, SETTINGS, CollectiveInfo
from shardkit.core.runtime.watch.store_board import StoreBoard
from shardkit.core.runtime.watch.stuck import StuckCheck

__all__ = ["HANG_EXIT_CODE", "HangWatch", "ensure_watching"]

logger = logging.getLogger(__name__)

HANG_EXIT_CODE = 124
"""The exit status of a rank that gave up waiting, or that stopped because another gave up
(as ``timeout(1)`` exits)."""

_POLL_S = 1.0  # how often the watch posts progress and looks at the current wait
# How long a reporting rank waits for every other rank's report before it exits. A watch
# sees an alarm within one poll; more is for a rank whose main thread holds the GIL.
_REPORTS_WAIT_S = 10.0
_ALARM = "alarm"  # the store key a rank that gives up sets: {"rank", "token", "detail"}


class HangWatch(threading.Thread):
    """The watching thread of this process (one, started at the first collective)."""

    def __init__(self, exit_process: Callable[[int], Any] = os._exit) -> None:
        super().__init__(name="shardkit-hang-watch", daemon=True)
        self.rank = global_rank()
        self.world = world_size()
        self._board = StoreBoard(progress_store())
        self._posted = -1  # the progress version last posted
        self._exit = exit_process
        self._stopping = threading.Event()
        # An alarm already in the store belongs to an earlier process group on the same store.
        self._stale_alarm = self._board.read(_ALARM)
        self._stuck = StuckCheck(self.rank, self.world, self._board)

    def run(self) -> None:
        """Post progress, check the current wait and look for alarms, until stopped."""
        while True:
            poll = min(_POLL_S, SETTINGS.hang_timeout_s / 4) if SETTINGS.hang_timeout_s else _POLL_S
            if self._stopping.wait(self._stuck.next_poll(poll)):
                return
            if not self._post():
                return  # the store is gone (the process group was destroyed): nothing to do
            self._stuck.poll()  # a wait past SHARDKIT_COLLECTIVE_BOUND: see runtime/watch/stuck.py
            if self.check():
                return

    def check(self) -> bool:
        """Give up if this rank waited too long or another rank gave up; whether it did."""
        waiting = PROGRESS.waiting
        waited = time.monotonic() - PROGRESS.waiting_since
        raised = self._board.read(_ALARM)
        fresh = raised is not None and raised != self._stale_alarm
        alarm = json.loads(raised) if raised is not None and fresh else None
        if waiting is not None and SETTINGS.hang_timeout_s and waited > SETTINGS.hang_timeout_s:
            if alarm is None:  # the first to give up: the others report under its token
                token = f"{self.rank}/{os.getpid()}/{time.time()}"
                alarm = {"rank": self.rank, "token": token, "detail": waiting.detail()}
                self._board.post(_ALARM, json.dumps(alarm))  # first: the others start reporting
            self._give_up(self.report(waiting, waited), str(alarm["token"]))
            return True
        if alarm is not None:
            self._give_up(self.peer_report(alarm), str(alarm["token"]))
            return True
        return False

    def _give_up(self, report: str, token: str) -> None:
        """Log ``report``, say so in the store, wait for every other rank's, and exit."""
        self._post(force=True)
        logger.error(report)
        for handler in (*logging.getLogger().handlers, *logger.handlers):
            handler.flush()
        sys.stderr.flush()
        self._board.post(f"reported/{token}/{self.rank}", "1")
        others = [f"reported/{token}/{r}" for r in range(self.world) if r != self.rank]
        deadline = time.monotonic() + _REPORTS_WAIT_S
        while others and time.monotonic() < deadline:
            others = [key for key in others if self._board.read(key) is None]
            if others:
                time.sleep(0.05)
        if others:
            logger.error("shardkit: rank %d exits without the reports of %s", self.rank, others)
        self._exit(HANG_EXIT_CODE)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the thread to end and wait for it (a store call in progress finishes first)."""
        self._stopping.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout_s)

    def _post(self, *, force: bool = False) -> bool:
        """Post this rank's progress if it changed; False once the store is unreachable."""
        version = PROGRESS.version
        if self._board.store is None or (version == self._posted and not force):
            return self._board.store is not None
        if not self._board.post(str(self.rank), json.dumps(_record())):
            return False
        self._posted = version
        return True

    def report(self, waiting: CollectiveInfo, waited: float) -> str:
        """What this rank waits on, where every rank is, and this process's Python stacks."""
        head = [
            f"shardkit: rank {self.rank} has waited {waited:.0f} s in a collective "
            f"(SHARDKIT_HANG_TIMEOUT={SETTINGS.hang_timeout_s:g}) and gives up: a rank that "
            "does not join it ran other code (an extra or a missing forward or backward?).",
            f"  this rank waits on {waiting.detail()}; "
            f"it is in step {PROGRESS.step}, {PROGRESS.phase}",
        ]
        return self._with_peers_and_stacks(head)

    def peer_report(self, alarm: dict[str, Any]) -> str:
        """This rank's report after rank ``alarm['rank']`` gave up: what this one was doing."""
        waiting = PROGRESS.waiting
        if waiting is not None:
            waited = time.monotonic() - PROGRESS.waiting_since
            doing = f"waiting on {waiting.detail()} (for {waited:.0f} s)"
        else:
            last = PROGRESS.last
            reached = last.detail() if last is not None else "no collective yet"
            doing = (
                f"not in a shardkit collective (the last it reached: {reached}): its Python "
                "stack below shows where it is instead"
            )
        head = [
            f"shardkit: rank {self.rank} stops: rank {alarm['rank']} gave up waiting "
            f"(SHARDKIT_HANG_TIMEOUT={SETTINGS.hang_timeout_s:g}) on {alarm['detail']}, which "
            "this rank did not join.",
            f"  this rank is in step {PROGRESS.step}, {PROGRESS.phase}, {doing}",
        ]
        return self._with_peers_and_stacks(head)

    def _with_peers_and_stacks(self, head: list[str]) -> str:
        lines = [*head, "  where every rank is (its last progress posted to the c10d store):"]
        lines += [f"    {line}" for line in self._peers()]
        lines.append(f"  exiting with status {HANG_EXIT_CODE}; Python stacks of rank {self.rank}:")
        lines += [f"    {line}" for line in _stacks().splitlines()]
        return "\n".join(lines)

    def _peers(self) -> list[str]:
        """One line per rank, from the store; ranks that are not in a collective are marked."""
        out: list[str] = []
        for rank in range(self.world):
            record = self._read(rank)
            if record is None:
                out.append(f"rank {rank}: posted nothing (no shardkit collective yet?)")
                continue
            now = "waiting in a collective" if record["waiting"] else "not in a shardkit collective"
            mark = "" if record["waiting"] else "  <- went elsewhere: look here"
            out.append(
                f"rank {rank}: in step {record['step']}, {record['phase']}, {now}; last reached "
                f"{record['last'] or 'no collective yet'} (posted "
                f"{time.time() - record['time']:.0f} s ago){mark}"
            )
        return out

    def _read(self, rank: int) -> dict[str, Any] | None:
        raw = self._board.read(str(rank))
        if raw is None:
            return None
        try:
            record: dict[str, Any] = json.loads(raw)
        except ValueError:
            return None
        return record


def _record() -> dict[str, Any]:
    """This rank's progress as posted to the store."""
    last = PROGRESS.last
    return {
        "last": last.detail() if last is not None else "",
        "waiting": PROGRESS.waiting is not None,
        "step": PROGRESS.step,
        "phase": PROGRESS.phase,
        "time": time.time(),
    }


def _stacks() -> str:
    """Every thread's Python stack (the main thread's shows where training stopped)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue  # the watch itself
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"thread {names.get(ident, ident)}:\n{stack}")
    return "\n".join(parts)


_WATCH: list[HangWatch] = []  # the running watch, once started


def ensure_watching() -> None:
    """Start this process's hang watch if it should run and does not yet (cheap when it does).

    A watch that ended (its process group was destroyed, so its store went away) is replaced
    when collectives start again on a new one.
    """
    if _WATCH and _WATCH[0].is_alive():
        return
    if not (SETTINGS.hang_timeout_s or SETTINGS.collective_bound_s) or world_size() < 2:
        return
    if not _WATCH:
        atexit.register(_stop_watching)
    watch = HangWatch()
    _WATCH[:] = [watch]
    watch.start()


def _stop_watching() -> None:
    """At exit: end the watch before the interpreter and the C++ runtime tear down."""
    for watch in _WATCH:
        watch.stop()
