"""One worker process as the pool sees it: the process, its socket and its log.

Workers are forks of the template worker (``harness.template``: torch and shardkit imported
once for the session), handed to this process, which is made their "child subreaper", so that
it waits for and kills them as its own children. Where that cannot be (not Linux, or
``SHARDKIT_POOL_FORK=0``) they are plain subprocesses (``python -m harness.worker``), never
multiprocessing children: the environment is set before the interpreter starts, and a spawned
multiprocessing child would re-import pytest's ``__main__``. Each worker talks to the pool over
its own ``socket.socketpair``, so there is no listener, address or authentication to manage.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path

from harness import protocol, template

__all__ = [
    "REPO_ROOT",
    "WorkerProcess",
    "close_template",
    "template_process_id",
    "wait_for_message",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The repo root, which holds ``harness``, ``tests`` and ``benchmarks``: the workers' working
directory, so they import task modules by the names the pool's process uses."""

# The environment a worker gets on top of the pool's own. OMP_NUM_THREADS must be set before
# torch is imported, hence here and not in the worker. PYTHONUNBUFFERED makes a task's prints
# reach the log before its Outcome reaches the pool, so they are read with the right task.
_FIXED_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1"}
# Variables of the pool's environment that no worker reads: pytest's, which changes from one
# test to the next, and the pool's own switches (see _base_env).
_NOT_FOR_WORKERS = ("PYTEST_CURRENT_TEST", "SHARDKIT_POOL_FORK", "SHARDKIT_POOL_RETRY_CRASH")


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
            "MASTER_PORT": str(master_port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            protocol.POOL_PID_ENV_VAR: str(os.getpid()),
        }
        with theirs:
            self.process: subprocess.Popen[bytes] | ForkedProcess
            forks = _TEMPLATE.get()
            if forks is not None:
                pid = template.request_worker(forks, env, (theirs.fileno(), self._log.fileno()))
                self.process = ForkedProcess(pid)
            else:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "harness.worker"],
                    cwd=REPO_ROOT,
                    env={**_base_env(), **env, protocol.FD_ENV_VAR: str(theirs.fileno())},
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


class ForkedProcess:
    """A worker forked by the template and handed to this process: ``Popen``'s calls on it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code (minus the signal that killed it), or None while it runs."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped already: it is not running
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            time.sleep(0.005)
        return code

    def send_signal(self, number: int) -> None:
        """Signal the worker, unless it has exited (its pid may be another's by now)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, number)

    def kill(self) -> None:
        """SIGKILL, as ``Popen.kill``."""
        self.send_signal(signal.SIGKILL)


class _Template:
    """The session's template worker, started on the first request (None: fresh workers)."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None
        self._env: dict[str, str] = {}  # what it started with (and imported shardkit under)

    def get(self) -> socket.socket | None:
        if os.environ.get("SHARDKIT_POOL_FORK") == "0" or sys.platform != "linux":
            return None
        env = _base_env()
        # Modules read settings from the environment at import (SHARDKIT_DEBUG_LIFETIMES): a
        # template started under another environment would hand its workers stale ones.
        if self._process is not None and self._process.poll() is None and env == self._env:
            return self._control
        self.close()
        # Orphans of this process's children come to it, not to init: forked workers, once
        # their middle process exits, are this process's to wait for and to kill.
        _PR_SET_CHILD_SUBREAPER = 36  # from <linux/prctl.h>
        if ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1) != 0:
            return None
        ours, theirs = socket.socketpair()
        # Its output (import warnings, a crash) goes where the pool's own goes.
        self._process = subprocess.Popen(
            [sys.executable, "-m", "harness.template"],
            cwd=REPO_ROOT,
            env={
                **env,
                template.CONTROL_FD_ENV_VAR: str(theirs.fileno()),
                protocol.POOL_PID_ENV_VAR: str(os.getpid()),
            },
            stdin=subprocess.DEVNULL,
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        self._control, self._env = ours, env
        return ours

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        return self._process

    def close(self) -> None:
        """End the template (closing its socket ends its loop; then it is killed)."""
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(2.0)
            self._process.kill()
            self._process.wait()
            self._process = None


_TEMPLATE = _Template()


def template_process_id() -> int | None:
    """The process id of the session's template worker (None: none is running)."""
    process = _TEMPLATE.process
    return process.pid if process is not None and process.poll() is None else None


def close_template() -> None:
    """Ends the session's template worker (the pool's workers are not affected)."""
    _TEMPLATE.close()


def _base_env() -> dict[str, str]:
    """A worker's environment before its rank: the pool's, with the fixed settings.

    Less what no worker reads: what pytest sets anew for each test's phase
    (``PYTEST_CURRENT_TEST``; a worker runs the tasks of many tests) and the pool's own
    switches. The template compares environments to know whether it is stale, so with
    pytest's variable in, every pool start after the first started a new template (torch
    imported again, about 3 s) instead of forking the one there.
    """
    env = {**os.environ, **_FIXED_ENV}
    for name in _NOT_FOR_WORKERS:
        env.pop(name, None)
    return env
