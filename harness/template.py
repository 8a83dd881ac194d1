"""The template worker: torch imported once, every pool's ranks forked from it.

A worker started as a fresh interpreter spends about 1.5 s of CPU importing torch,
``torch.distributed`` and shardkit before it can join a process group, and a pool of W ranks
pays that W times at every start and every restart (a task that left the groups out of step, a
crash, a timeout). Here one process pays it once for the session: the pool's first start
launches it (``python -m harness.template``), and every worker after that is a fork of it
(copy on write), which then only joins gloo's rendezvous.

The pool asks for a worker over the template's control socket: the worker's environment (its
rank, world size, the store's port) as one pickled dict of strings, and two file descriptors
passed with it (``SCM_RIGHTS``): the worker's end of its socket pair to the pool and its log
file. The template forks twice: the middle process exits at once, so the worker is handed to
the nearest "child subreaper", the pool's process (``harness.processes`` makes it one), which
can then wait for it, kill it and read its exit status as it would a child it started. The
template answers with the worker's process id.

The template imports modules and nothing else: no thread is running when it forks, and no
process group exists in it. Only Linux has subreapers; elsewhere, or with
``SHARDKIT_POOL_FORK=0``, workers start as fresh interpreters.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import pickle
import signal
import socket
import struct
import sys
import time

from harness import protocol

__all__ = ["CONTROL_FD_ENV_VAR", "PRELOADED", "main", "request_worker"]

CONTROL_FD_ENV_VAR = "SHARDKIT_TEMPLATE_FD"
"""Names the environment variable that gives the template its end of the control socket."""

PRELOADED = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "torch.testing",
    "numpy",
    "shardkit.core",
    "shardkit.tp",
    "shardkit.legacy",
    "harness.worker",
)
"""What every worker needs or nearly every test task imports: loaded once, here."""

_PID = struct.Struct("<q")
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_MAX_REQUEST = 1 << 20
# How long a new worker waits to be handed to the pool after the middle process exits.
_HANDOVER_S = 10.0


def request_worker(control: socket.socket, env: dict[str, str], fds: tuple[int, int]) -> int:
    """The process id of a new worker forked with ``env`` and ``fds`` (its socket, its log)."""
    payload = pickle.dumps(env)
    socket.send_fds(control, [struct.pack("<I", len(payload)) + payload], list(fds))
    reply = _read_exactly(control, _PID.size)
    (pid,) = _PID.unpack(reply)
    if pid <= 0:
        raise OSError(f"the template worker could not fork (errno {-pid})")
    return int(pid)


def main() -> None:
    """Import once, then fork a worker for each request until the pool closes the socket."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the pool handles Ctrl-C; see worker.main
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # die with the pool
    if os.getppid() != int(os.environ[protocol.POOL_PID_ENV_VAR]):
        os._exit(1)  # the pool died before the line above
    control = socket.socket(fileno=int(os.environ[CONTROL_FD_ENV_VAR]))
    for name in PRELOADED:
        with contextlib.suppress(ImportError):  # a package not installed in this venv
            importlib.import_module(name)
    while True:
        try:
            header, fds, _, _ = socket.recv_fds(control, 4, 2)
        except OSError:
            return
        if len(header) < 4:  # the pool closed the socket: the session is over
            return
        (size,) = struct.unpack("<I", header)
        env = pickle.loads(_read_exactly(control, min(size, _MAX_REQUEST)))  # the pool's own
        control.sendall(_PID.pack(_fork_worker(control, env, fds)))
        for fd in fds:
            os.close(fd)


def _fork_worker(control: socket.socket, env: dict[str, str], fds: list[int]) -> int:
    """Fork twice; the worker's pid, or minus an errno if a fork failed."""
    reader, writer = os.pipe()
    try:
        middle = os.fork()
    except OSError as error:
        os.close(reader)
        os.close(writer)
        return -(error.errno or 1)
    if middle == 0:  # the middle process: fork the worker, say its pid, exit
        os.close(reader)
        try:
            worker = os.fork()
        except OSError as error:
            os.write(writer, _PID.pack(-(error.errno or 1)))
            os._exit(1)
        if worker == 0:
            os.close(writer)
            _become_worker(control, env, fds)  # never returns
        os.write(writer, _PID.pack(worker))
        os._exit(0)
    os.close(writer)
    reply = _read_fd_exactly(reader, _PID.size)
    os.close(reader)
    os.waitpid(middle, 0)  # once it is gone, the worker is the pool's
    (pid,) = _PID.unpack(reply)
    return int(pid)


def _become_worker(control: socket.socket, env: dict[str, str], fds: list[int]) -> None:
    """In the forked worker: its environment and output, then the worker's own main."""
    try:
        control.close()
        conn_fd, log_fd = fds
        os.environ.update(env)
        os.environ[protocol.FD_ENV_VAR] = str(conn_fd)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        deadline = time.monotonic() + _HANDOVER_S
        pool = int(os.environ[protocol.POOL_PID_ENV_VAR])
        while os.getppid() != pool:  # the middle process has not exited yet
            if time.monotonic() > deadline:
                os._exit(1)
            time.sleep(0.001)
        from harness import worker

        worker.main()
    finally:
        os._exit(1)  # main() exits itself; anything else is a failure


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError("the template worker's socket closed")
        data += chunk
    return data


def _read_fd_exactly(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            raise EOFError("the middle process exited without a pid")
        data += chunk
    return data


if __name__ == "__main__":
    main()
