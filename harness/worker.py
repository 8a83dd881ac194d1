"""One rank of a pool: joins the gloo process group once, then runs tasks until told to stop.

Started by ``harness.processes`` as ``python -m harness.worker`` with the repo root as
working directory. The pool sets the environment before the interpreter starts (so that
``OMP_NUM_THREADS`` is in place before torch is imported): ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` as torchrun sets them,
``protocol.FD_ENV_VAR``, the worker's end of its socket pair to the pool, and
``protocol.POOL_PID_ENV_VAR``.

Stdout and stderr go to a log file that the pool reads after each task, so a task's prints and
faulthandler's stack dumps reach the test report.
"""

from __future__ import annotations

import ctypes
import faulthandler
import importlib
import os
import pickle
import random
import signal
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from harness import protocol

__all__ = ["main"]

# How long store operations wait. In init_process_group each rank waits for the slowest one
# to import torch, which takes seconds with four ranks on two busy cores.
_STORE_TIMEOUT = timedelta(seconds=120)
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def main() -> None:
    """Runs the worker until the pool sends Shutdown or goes away."""
    # Ctrl-C in a terminal signals the whole process group. The pool (the pytest process)
    # handles it by killing its workers; here it would only turn into a spurious task failure.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Stack dumps into the log: on a crash, and on SIGUSR1, which the pool sends to ranks that
    # are still running when a task times out, to show where they hang.
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    _exit_with_parent()

    conn = Connection(int(os.environ[protocol.FD_ENV_VAR]))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    store = dist.TCPStore(  # type: ignore[attr-defined]  # public, but re-exported without "as"
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=_STORE_TIMEOUT,
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    _reset()
    protocol.send(conn, protocol.Ready())
    while True:
        try:
            message = protocol.receive(conn)
        except EOFError:  # The pool has gone without saying goodbye: nothing left to do.
            break
        if isinstance(message, protocol.Shutdown):
            break
        if not isinstance(message, protocol.Task):
            raise TypeError(f"rank {rank}: expected a Task, got {message!r}")
        protocol.send(conn, _run(message, rank, world_size))
        # A reset that raises (say the task destroyed the process group) ends the worker; the
        # pool sees the pipe close instead of Ready and restarts the pool.
        in_step = _reset()
        held = len(dist.distributed_c10d._world.pg_names)
        protocol.send(conn, protocol.Ready(groups_in_step=in_step, groups_held=held))
    dist.destroy_process_group()
    # Skip the interpreter's teardown: with torch loaded it costs about 0.5 s of CPU a worker,
    # paid by every test run, and a worker has nothing left to clean up.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_with_parent() -> None:
    """Has the kernel kill this worker when the pool's process dies (Linux only).

    So a killed pytest leaves no orphans: an idle worker would see its socket close anyway, but
    one stuck in a task would not. A kernel setting rather than a watchdog thread, which would
    show up in every stack dump.
    """
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    # The pool may have died before the line above (importing torch takes seconds): then this
    # process has been handed to another parent already, and the kernel will not signal it.
    if os.getppid() != int(os.environ[protocol.POOL_PID_ENV_VAR]):
        os._exit(1)


def _reset() -> bool:
    """Undoes the global state a task may leave behind, then waits for the other ranks.

    The wait doubles as a health check: if a task left the ranks' collectives out of step, it
    hangs or raises, and the pool restarts rather than run the next task on a broken group.
    Returns whether every rank holds as many process groups as this one (see
    :func:`_group_registry`).
    """
    torch.manual_seed(0)
    random.seed(0)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.set_num_threads(1)
    checks = sys.modules.get("shardkit.core.runtime.watch.step_check")
    if checks is not None:
        checks.forget()  # a task that raised mid-step leaves each rank's collectives apart
    mine = torch.tensor(_group_registry())
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)  # the barrier
    return all(torch.equal(theirs, mine) for theirs in every)


def _group_registry() -> list[int]:
    """What torch names this rank's next process group by: how many it holds, its counter.

    torch names a group made by its members alone (``use_local_synchronization=True``, as
    ``set_separate_reduce_scatter_group`` makes one) by its ranks and the number of groups this
    process holds (2.13), or by a counter the members advance (2.14 on). A task that made
    groups on some ranks only (a model on a subset of ranks) leaves those numbers unequal, and
    such a group made by a later task in the same workers would wait forever for its peers
    under another name. Private torch state: the test harness only.
    """
    world = dist.distributed_c10d._world
    return [len(world.pg_names), int(getattr(world, "group_count", 0))]


def _run(task: protocol.Task, rank: int, world_size: int) -> protocol.Outcome:
    """Calls the task's function; every exception becomes an Outcome, none escapes."""
    # Prepend what the pool has and we lack: the folders pytest inserted for test modules.
    sys.path[:0] = [path for path in task.sys_path if path not in sys.path]
    try:
        fn = _resolve(task.module, task.qualname)
        kwargs = pickle.loads(task.kwargs)
        value = fn(rank, world_size, **kwargs)
    # BaseException: pytest.fail() and pytest.skip() raise BaseException subclasses, and a
    # SystemExit from a task must not end the worker either.
    except BaseException as exc:
        return protocol.Outcome(error=_format_error(exc))
    try:
        return protocol.Outcome(value=pickle.dumps(value))
    except Exception as exc:
        message = f"rank {rank} returned a {type(value).__name__} that cannot be pickled:\n"
        return protocol.Outcome(error=message + _format_error(exc))


def _resolve(module: str, qualname: str) -> Callable[..., object]:
    """Imports ``module`` and walks ``qualname`` (``fn`` or ``Class.fn``) inside it."""
    target: object = importlib.import_module(module)
    for name in qualname.split("."):
        target = getattr(target, name)
    if not callable(target):
        raise TypeError(f"{module}.{qualname} is not callable")
    return target


def _format_error(exc: BaseException) -> str:
    """Formats a traceback without its first frame, which is only this module calling the task."""
    if exc.__traceback__ is not None:
        exc = exc.with_traceback(exc.__traceback__.tb_next)
    return "".join(traceback.format_exception(exc))


if __name__ == "__main__":
    main()
