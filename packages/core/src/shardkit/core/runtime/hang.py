"""Hang reports: a rank stuck in a collective says where everyone is, then exits.

A rank whose peers never join a collective (one ran an extra micro-batch, one returned early)
waits until the process group's timeout, 30 minutes by default, and then says nothing
useful. Here a daemon thread watches the runtime's waits. Every second it posts this rank's
progress (:data:`~shardkit.core.runtime.progress.PROGRESS`) to the c10d store, and when a wait
has lasted ``SHARDKIT_HANG_TIMEOUT`` seconds (default 300) it logs a report and exits the
process with :data:`HANG_EXIT_CODE`: what this rank waits on, its step and phase, the last
collective every other rank reached (read from the store) and this process's Python stacks.
The job ends in minutes with the rank that went astray named. See [Note: desync checks].

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
from shardkit.core.runtime.progress import PROGRESS, SETTINGS, CollectiveInfo

__all__ = ["HANG_EXIT_CODE", "HangWatch", "ensure_watching"]

logger = logging.getLogger(__name__)

HANG_EXIT_CODE = 124
"""The exit status of a rank that gave up waiting (as ``timeout(1)`` exits)."""

_POLL_S = 1.0  # how often the watch posts progress and looks at the current wait


class HangWatch(threading.Thread):
    """The watching thread of this process (one, started at the first collective)."""

    def __init__(self, exit_process: Callable[[int], Any] = os._exit) -> None:
        super().__init__(name="shardkit-hang-watch", daemon=True)
        self.rank = global_rank()
        self.world = world_size()
        self._store = progress_store()
        self._posted = -1  # the progress version last posted
        self._exit = exit_process
        self._stopping = threading.Event()

    def run(self) -> None:
        """Post progress and check the current wait, once a second, until stopped."""
        while True:
            poll = min(_POLL_S, SETTINGS.hang_timeout_s / 4) if SETTINGS.hang_timeout_s else _POLL_S
            if self._stopping.wait(poll):
                return
            if not self._post():
                return  # the store is gone (the process group was destroyed): nothing to do
            waiting = PROGRESS.waiting
            waited = time.monotonic() - PROGRESS.waiting_since
            if waiting is not None and SETTINGS.hang_timeout_s and waited > SETTINGS.hang_timeout_s:
                self._post(force=True)
                logger.error(self.report(waiting, waited))
                for handler in (*logging.getLogger().handlers, *logger.handlers):
                    handler.flush()
                sys.stderr.flush()
                self._exit(HANG_EXIT_CODE)
                return

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the thread to end and wait for it (a store call in progress finishes first)."""
        self._stopping.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout_s)

    def _post(self, *, force: bool = False) -> bool:
        """Post this rank's progress if it changed; False once the store is unreachable."""
        version = PROGRESS.version
        if self._store is None or (version == self._posted and not force):
            return self._store is not None
        try:
            self._store.set(str(self.rank), json.dumps(_record()))
        except Exception:  # a destroyed process group, a store server gone at shutdown
            return False
        self._posted = version
        return True

    def report(self, waiting: CollectiveInfo, waited: float) -> str:
        """What this rank waits on, where every rank is, and this process's Python stacks."""
        lines = [
            f"shardkit: rank {self.rank} has waited {waited:.0f} s in a collective "
            f"(SHARDKIT_HANG_TIMEOUT={SETTINGS.hang_timeout_s:g}) and gives up: a rank that "
            "does not join it ran other code (an extra or a missing forward or backward?).",
            f"  this rank waits on {waiting.detail()}; "
            f"it is in step {PROGRESS.step}, {PROGRESS.phase}",
            "  where every rank is (its last progress posted to the c10d store):",
        ]
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
        if self._store is None:
            return None
        key = str(rank)
        try:
            if not self._store.check([key]):
                return None
            record: dict[str, Any] = json.loads(self._store.get(key))
        except Exception:  # a peer's record cannot be read: report what can be
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
    if not SETTINGS.hang_timeout_s or world_size() < 2:
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
