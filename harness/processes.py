"""One worker process as the pool sees it: the process, its socket and its log.

Workers are plain subprocesses (``python -m harness.worker``) rather than multiprocessing
children: the environment is set before the interpreter starts, and a spawned multiprocessing
child would re-import pytest's ``__main__``. Each worker talks to the pool over its own
``socket.socketpair``, so there is no listener, address or authentication to manage.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
from multiprocessing.connection import Connection, wait
from pathlib import Path

from harness import protocol

__all__ = ["REPO_ROOT", "WorkerProcess", "wait_for_message"]

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The repo root, which holds ``harness``, ``tests`` and ``benchmarks``: the workers' working
directory, so they import task modules by the names the pool's process uses."""

# The environment a worker gets on top of the pool's own. OMP_NUM_THREADS must be set before
# torch is imported, hence here and not in the worker. PYTHONUNBUFFERED makes a task's prints
# reach the log before its Outcome reaches the pool, so they are read with the right task.
_FIXED_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1"}


class WorkerProcess:
    """One rank's worker process, started on construction."""

    def __init__(self, *, rank: int, world_size: int, master_port: int) -> None:
        self.rank = rank
        # The worker's stdout and stderr: an unnamed temporary file, so nothing is left behind
        # even when pytest is killed. Read with pread, which leaves the offset the worker
        # writes at (the file description is shared) where it is.
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by kill(), not a block)
        self._log_offset = 0  # bytes of the log already handed out by take_output()
        ours, theirs = socket.socketpair()
        env = {
            **os.environ,
            **_FIXED_ENV,
            "MASTER_PORT": str(master_port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            protocol.FD_ENV_VAR: str(theirs.fileno()),
            protocol.POOL_PID_ENV_VAR: str(os.getpid()),
        }
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "harness.worker"],
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                pass_fds=(theirs.fileno(),),
            )
        self.conn = Connection(ours.detach())

    def send(self, message: protocol.Message) -> None:
        """Sends one message; raises OSError when the worker has gone."""
        protocol.send(self.conn, message)

    def receive(self) -> protocol.Message:
        """Receives one message; raises EOFError when the worker has gone."""
        return protocol.receive(self.conn)

    def take_output(self) -> str:
        """Returns what the worker printed since the last call."""
        fd = self._log.fileno()
        data = os.pread(fd, os.fstat(fd).st_size - self._log_offset, self._log_offset)
        self._log_offset += len(data)
        return data.decode(errors="replace")

    def exit_code(self) -> int | None:
        """The process's exit code, or None while it runs."""
        return self.process.poll()

    def wait_exit(self, timeout_s: float) -> int | None:
        """Waits for the process to end; returns its exit code, or None if it still runs."""
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def dump_stacks(self) -> None:
        """Asks a running worker to write all its threads' Python stacks to its log."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGUSR1)

    def kill(self) -> None:
        """Ends the process at once, whatever it is doing."""
        self.process.kill()
        self.process.wait()
        self.conn.close()
        self._log.close()

    def request_stop(self) -> None:
        """Asks the worker to leave the process group and exit; see ``wait_exit``."""
        with contextlib.suppress(OSError):  # already gone: nothing to ask
            self.send(protocol.Shutdown())


def wait_for_message(workers: list[WorkerProcess], timeout_s: float) -> list[WorkerProcess]:
    """Blocks until some of ``workers`` have a message (or have exited), at most ``timeout_s``."""
    ready = wait([worker.conn for worker in workers], timeout=max(timeout_s, 0.0))
    return [worker for worker in workers if worker.conn in ready]
