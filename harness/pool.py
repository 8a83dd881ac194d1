"""Run a function on W gloo ranks from a test or a benchmark, on workers kept for the session.

Starting torch costs about 1.5 s a process and a 2-rank launch about 5 s, so multi-rank tests
share one pool of workers per world size. A pool starts on its first task, survives failing
tasks, and is killed and started afresh only when its ranks can no longer be trusted (a hang,
a dead worker, collectives left out of step). ``tests/conftest.py`` shuts the pools down at
the end of the session, and an ``atexit`` hook does wherever no conftest does (benchmarks).

A worker killed by a crash signal (SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL) in a task, or in
the barrier after it, has its task run once more on a fresh pool, except under
:func:`crashes_fail_at_once` or with ``SHARDKIT_POOL_RETRY_CRASH=0``. A second crash fails
the test. Every crash retried is kept (:func:`crashes_retried`): a warning on the test, and
``tests/conftest.py`` prints them, with the rank's last output, at the end of the run. Such a
crash is a defect to find, not an accepted result: the retry keeps a rare one in torch's gloo
paths from hiding the rest of a run (see docs/development.md, "Tests").

Usage::

    def _body(rank: int, world_size: int, lr: float) -> float:  # module level
        ...  # the default gloo process group is initialised

    def test_something() -> None:
        losses = run_on_ranks(2, _body, lr=0.1)  # one value per rank, in rank order

Task functions run in other processes, hence:

- They are defined at module level: workers import them as ``module.qualname``.
- Arguments and return values are pickled. Return plain tensors and numbers, not DTensors
  (``.full_tensor()`` or ``.to_local()`` them first), modules or optimizers.
- pytest does not rewrite ``assert`` in workers: return values and assert in the test, or give
  the assert a message.
- Leave the default process group as it is (creating new groups is fine); the next task
  reuses it. Each task starts with seed 0, float32 as default dtype and grad mode on.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import os
import pickle
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar, cast

from harness import protocol
from harness.processes import WorkerProcess, close_template, wait_for_message
from harness.report import CrashRetried, RankTaskError, RankTaskTimeout, TaskFailure, output_tail

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "CrashRetried",
    "RankPool",
    "RankTaskError",
    "RankTaskTimeout",
    "crashes_fail_at_once",
    "crashes_recorded_apart",
    "MAX_GROUPS_HELD",
    "PoolStart",
    "crashes_retried",
    "crowded_restarts",
    "get_pool",
    "group_restarts",
    "pool_starts",
    "run_on_ranks",
    "shutdown_pools",
]

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 120.0
"""How long a task may run on all ranks before the test fails and its pool is killed."""

# Four ranks importing torch on two busy cores take seconds each; generous, as it is paid once.
_START_TIMEOUT_S = 300.0
# From the last rank's Outcome to every rank's Ready is one barrier: milliseconds when healthy.
_RESET_TIMEOUT_S = 10.0
# Once one rank has failed, how long to wait for the others. They are usually blocked in a
# collective with the failed rank and would only return when gloo's 30-minute timeout fires.
_GRACE_S = 5.0
# How long a rank stuck in the barrier after a task is given to show it died of a crash signal.
_BARRIER_CRASH_WAIT_S = 1.0
# How long shutting a pool down waits for its workers to exit before killing them.
_EXIT_TIMEOUT_S = 10.0
# faulthandler writes from a signal handler; this is ample for it to reach the log.
_STACK_DUMP_WAIT_S = 0.5
# The signals of a native crash: a task whose worker died of one is run once more.
_CRASH_SIGNALS = frozenset(
    {signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGFPE, signal.SIGILL}
)
# The crashes retried: the run's list first, then any that crashes_recorded_apart() pushed.
_CRASH_LOGS: list[list[CrashRetried]] = [[]]
_RETRY_CRASHES = [True]  # a stack: crashes_fail_at_once() pushes False
# The tasks after which a pool started afresh because they left process groups out of step.
_GROUP_RESTARTS: list[str] = []
# Workers holding more process groups than this start afresh before the next task. Tests make
# groups with every mesh and none is destroyed (DTensor's caches hold meshes, so destroying
# them is unsafe); each group's gloo thread wakes while idle, so after a few hundred the idle
# workers took a tenth of a core each from whatever ran beside them (torchrun jobs, the demo).
# A restart costs about 4 s at W=4; about one in 60 tasks reaches the cap.
MAX_GROUPS_HELD = 96
# The tasks after which a pool started afresh for that.
_CROWDED_RESTARTS: list[str] = []


@dataclass(frozen=True, slots=True)
class PoolStart:
    """One start of a pool: its ranks forked (or launched) and through the first barrier."""

    world_size: int
    seconds: float


_STARTS: list[PoolStart] = []
# The world size of every task of the session, in order (what tests/world_sizes.txt records).
_TASK_WORLD_SIZES: list[int] = []
# The world sizes of the pools shut because the next test did not use them.
_SHUT_BETWEEN_WORLD_SIZES: list[int] = []

Replies = dict[int, protocol.Message | None]
"""One message per rank that answered, by rank; None for a rank whose worker exited."""


class RankPool:
    """The worker processes of one world size, started on the first task."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._workers: list[WorkerProcess] = []  # (W,) in rank order; empty when not started
        # The rendezvous TCPStore, hosted here as torchrun's agent hosts it; held only to keep
        # its server alive as long as the workers.
        self._store: object | None = None
        self._groups_in_step = True  # as the last task left the ranks (see protocol.Ready)
        self._groups_held = 1  # the most any rank held after the last task

    @property
    def pids(self) -> list[int]:
        """The workers' process ids in rank order (empty when not started)."""
        return [worker.process.pid for worker in self._workers]

    def run(
        self, task: protocol.Task, *, timeout_s: float, retry_on_crash: bool = True
    ) -> list[object]:
        """Runs ``task`` on every rank and returns the values in rank order.

        ``retry_on_crash``: run the task once more, on a fresh pool, if a worker died of a
        crash signal during it (see the module's docstring).

        Raises:
            RankTaskError: the task raised on some rank, a worker died, or the ranks could not
                be brought back to a clean state after it.
            RankTaskTimeout: some rank was still running after ``timeout_s``.
        """
        __tracebackhide__ = True  # pytest: show the test's frame, not the harness's
        if any(worker.exit_code() is not None for worker in self._workers):
            self.kill()  # a worker died between tasks (the OOM killer, say): start afresh
        try:
            if not self._workers:
                self._start()
            replies = self._dispatch(task, timeout_s)
        except BaseException:
            # Ctrl-C while starting or mid-task: the ranks are busy, and waiting for them to
            # finish would only delay the exit.
            self.kill()
            raise
        running = [rank for rank in range(self.world_size) if rank not in replies]
        # Hung or dead ranks cannot run another task; otherwise the barrier after it decides.
        healthy = not running and None not in replies.values()
        stuck = self._settle() if healthy else []
        outputs = self._print_output()
        failure = TaskFailure(
            name=f"{task.module}.{task.qualname}",
            world_size=self.world_size,
            timeout_s=timeout_s,
            errors=self._errors(replies, outputs),
            running=running,
            stuck=stuck,
            outputs=outputs,
        )
        crashed = self._crash_signals(replies, stuck) if failure.failed else {}
        if not healthy or stuck:  # a crashed worker is one: the retry below starts afresh
            self.kill()
        elif not self._groups_in_step:
            # The task's result stands; the next task gets workers whose groups agree.
            _GROUP_RESTARTS.append(f"{task.module}.{task.qualname}")
            self.kill()
        elif self._groups_held > MAX_GROUPS_HELD:
            _CROWDED_RESTARTS.append(f"{task.module}.{task.qualname}")
            self.kill()  # the next task gets workers without the idle groups
        if crashed and retry_on_crash and os.environ.get("SHARDKIT_POOL_RETRY_CRASH") != "0":
            record = CrashRetried(failure=failure, signals=crashed)
            _CRASH_LOGS[-1].append(record)
            warnings.warn(record.headline(), RuntimeWarning, stacklevel=2)
            return self.run(task, timeout_s=timeout_s, retry_on_crash=False)
        if failure.failed:
            raise failure.exception()
        return [_value_of(rank, replies[rank]) for rank in range(self.world_size)]

    def _crash_signals(self, replies: Replies, stuck: list[int]) -> dict[int, str]:
        """Rank → signal name, for the ranks a crash signal killed in the task or the barrier.

        A crash in the barrier leaves the task's values, but not whether the ranks' collectives
        stayed in step: the task runs again as for a crash in it (the default run met one, a
        segfault in gloo's all-gather of the barrier, after a task that returned on every rank).
        """
        crashed: dict[int, str] = {}
        for rank, reply in replies.items():
            worker = self._workers[rank]
            if reply is None:
                code = worker.exit_code()
            elif rank in stuck:  # it may still be dying; a live one waits in the barrier
                code = worker.wait_exit(_BARRIER_CRASH_WAIT_S)
            else:
                code = None
            if code is not None and code < 0 and -code in _CRASH_SIGNALS:
                crashed[rank] = signal.Signals(-code).name
        return crashed

    def kill(self) -> None:
        """Kills the workers at once; the next task starts a fresh pool."""
        for worker in self._workers:
            worker.kill()
        self._forget()

    def close(self) -> None:
        """Shuts the workers down cleanly, killing those that do not exit in time."""
        # All at once: a worker's exit does not wait for the others, so neither should we.
        for worker in self._workers:
            worker.request_stop()
        deadline = time.monotonic() + _EXIT_TIMEOUT_S
        for worker in self._workers:
            worker.wait_exit(max(deadline - time.monotonic(), 0.0))
        self.kill()  # reaps them all, and kills any still busy with a task

    def _start(self) -> None:
        started = time.monotonic()
        try:
            self._start_workers()
        finally:
            _STARTS.append(PoolStart(self.world_size, time.monotonic() - started))

    def _start_workers(self) -> None:
        # Deferred: importing torch here would make every pytest run pay for it at conftest time.
        import torch.distributed as dist

        # Port 0: the OS picks a free port, with no window in which another process can take it.
        store = dist.TCPStore(  # type: ignore[attr-defined]  # public, but re-exported without "as"
            "127.0.0.1", 0, is_master=True, wait_for_workers=False
        )
        self._store = store
        self._workers = [
            WorkerProcess(
                rank=rank,
                world_size=self.world_size,
                master_port=store.port,
            )
            for rank in range(self.world_size)
        ]
        replies = self._gather(_START_TIMEOUT_S, grace_s=_GRACE_S)
        ready = [rank for rank, reply in replies.items() if isinstance(reply, protocol.Ready)]
        if len(ready) < self.world_size:
            outputs = self._print_output()
            self.kill()
            tails = [f"--- rank {rank} ---\n{output_tail(text)}" for rank, text in outputs.items()]
            raise RankTaskError(
                f"the pool for world_size={self.world_size} did not start; only rank(s) {ready} "
                "got through init_process_group and the first barrier.\n\n" + "\n\n".join(tails)
            )

    def _dispatch(self, task: protocol.Task, timeout_s: float) -> Replies:
        """Sends ``task`` to every rank and gathers the Outcomes; dumps the stacks of the rest."""
        for worker in self._workers:
            with contextlib.suppress(OSError):  # a dead worker: _gather reports it
                worker.send(task)
        replies = self._gather(timeout_s, grace_s=min(_GRACE_S, timeout_s))
        running = [worker for worker in self._workers if worker.rank not in replies]
        for worker in running:
            worker.dump_stacks()
        if running:
            time.sleep(_STACK_DUMP_WAIT_S)
        return replies

    def _gather(self, timeout_s: float, *, grace_s: float) -> Replies:
        """Receives one message from each rank, until ``timeout_s`` has passed.

        After the first failure (an error Outcome or a dead worker) it waits at most ``grace_s``
        more: the other ranks are then usually blocked in a collective with the failed one.
        """
        deadline = time.monotonic() + timeout_s
        replies: Replies = {}
        pending = list(self._workers)
        while pending and (left := deadline - time.monotonic()) > 0:
            for worker in wait_for_message(pending, left):
                pending.remove(worker)
                try:
                    reply: protocol.Message | None = worker.receive()
                except (EOFError, OSError):
                    reply = None
                replies[worker.rank] = reply
                if _is_failure(reply):
                    deadline = min(deadline, time.monotonic() + grace_s)
        return replies

    def _settle(self) -> list[int]:
        """Waits for every rank's Ready after a task; returns the ranks that did not send it.

        Notes in ``_groups_in_step`` whether the ranks' process-group registries agree.
        """
        replies = self._gather(_RESET_TIMEOUT_S, grace_s=0.0)
        ready = {r: m for r, m in replies.items() if isinstance(m, protocol.Ready)}
        self._groups_in_step = all(message.groups_in_step for message in ready.values())
        self._groups_held = max((message.groups_held for message in ready.values()), default=1)
        return sorted(set(range(self.world_size)) - set(ready))

    def _errors(self, replies: Replies, outputs: dict[int, str]) -> dict[int, str]:
        """Rank → what went wrong there, for the ranks whose reply is not a returned value."""
        errors: dict[int, str] = {}
        for rank, reply in replies.items():
            if reply is None:
                code = self._workers[rank].wait_exit(_GRACE_S)
                errors[rank] = (
                    f"the worker process exited (code {code}) during the task; the end of its "
                    f"output:\n{output_tail(outputs[rank])}"
                )
            elif not isinstance(reply, protocol.Outcome):
                errors[rank] = f"harness protocol error: expected an Outcome, got {reply!r}"
            elif reply.error is not None:
                errors[rank] = reply.error
        return errors

    def _print_output(self) -> dict[int, str]:
        """Prints each rank's new output, prefixed by rank, so pytest shows it with the test."""
        outputs = {worker.rank: worker.take_output() for worker in self._workers}
        for rank, text in outputs.items():
            for line in text.splitlines():
                print(f"[rank {rank}] {line}")
        return outputs

    def _forget(self) -> None:
        self._workers = []
        self._store = None  # dropping the last reference stops the store's server


class _Pools:
    """The session's pools, one per world size, each created on first use."""

    def __init__(self) -> None:
        self._by_world_size: dict[int, RankPool] = {}

    def get(self, world_size: int) -> RankPool:
        if world_size not in self._by_world_size:
            self._by_world_size[world_size] = RankPool(world_size)
        return self._by_world_size[world_size]

    def close(self) -> None:
        for pool in self._by_world_size.values():
            pool.close()
        self._by_world_size.clear()

    def close_except(self, kept: set[int]) -> list[int]:
        """Shuts the started pools of world sizes not in ``kept``; the world sizes shut."""
        shut = [w for w, pool in self._by_world_size.items() if pool.pids and w not in kept]
        for world_size in shut:
            self._by_world_size[world_size].close()
        return shut


_POOLS = _Pools()


def get_pool(world_size: int) -> RankPool:
    """Returns the session's pool for ``world_size`` (not started until its first task)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return _POOLS.get(world_size)


def run_on_ranks(
    world_size: int,
    fn: Callable[..., T],
    /,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    **kwargs: object,
) -> list[T]:
    """Calls ``fn(rank, world_size, **kwargs)`` on every rank of the session's pool.

    Args:
        world_size: How many ranks; each world size has its own pool of processes.
        fn: A module-level function, imported by name in the workers, where the default gloo
            process group is initialised and ``init_device_mesh("cpu", ...)`` works.
        timeout_s: How long the task may take on all ranks; then the test fails and the pool
            is killed (the next task starts a fresh one).
        **kwargs: Passed to ``fn``; pickled, as its return value is.

    Returns:
        ``fn``'s return values, in rank order.

    Raises:
        RankTaskError: ``fn`` raised on some rank (the message holds the remote tracebacks).
        RankTaskTimeout: some rank did not finish in time (the message holds its stacks).
        TypeError: ``fn`` cannot be imported by name or called with these arguments.
    """
    __tracebackhide__ = True
    task = _make_task(fn, world_size, kwargs)
    _TASK_WORLD_SIZES.append(world_size)
    retry = _RETRY_CRASHES[-1]
    values = get_pool(world_size).run(task, timeout_s=timeout_s, retry_on_crash=retry)
    return cast("list[T]", values)  # the workers ran fn, so each value is a T


@contextlib.contextmanager
def crashes_fail_at_once() -> Iterator[None]:
    """Within: a worker's crash fails the task at once (for tests that hunt crashes)."""
    _RETRY_CRASHES.append(False)
    try:
        yield
    finally:
        _RETRY_CRASHES.pop()


def group_restarts() -> tuple[str, ...]:
    """The tasks after which a pool started afresh: they made process groups on some ranks."""
    return tuple(_GROUP_RESTARTS)


def crowded_restarts() -> tuple[str, ...]:
    """The tasks after which a pool started afresh: its workers held too many process groups."""
    return tuple(_CROWDED_RESTARTS)


def crashes_retried() -> tuple[CrashRetried, ...]:
    """The tasks this process ran again because a worker crashed, in the order they crashed."""
    return tuple(_CRASH_LOGS[0])


@contextlib.contextmanager
def crashes_recorded_apart() -> Iterator[list[CrashRetried]]:
    """Within: crashes retried go to the list yielded, not the run's (the harness's tests)."""
    log: list[CrashRetried] = []
    _CRASH_LOGS.append(log)
    try:
        yield log
    finally:
        _CRASH_LOGS.remove(log)


def pool_starts() -> tuple[PoolStart, ...]:
    """Every pool start of the session so far (first starts and restarts), in order."""
    return tuple(_STARTS)


def task_world_sizes() -> tuple[int, ...]:
    """The world size of every task run so far in this session, in order."""
    return tuple(_TASK_WORLD_SIZES)


def keep_only_pools(world_sizes: set[int]) -> list[int]:
    """Shuts the idle pools of every other world size; the world sizes it shut.

    An idle pool is not free: each process group its workers hold wakes a gloo thread now and
    then (about 4% of a core per worker holding 90 groups, measured on the 2-core machine), so
    pools left warm for later steal time from the pool at work. The test run orders its tests
    by world size (tests/world_sizes.py), which makes shutting the others nearly free.
    """
    shut = _POOLS.close_except(world_sizes)
    _SHUT_BETWEEN_WORLD_SIZES.extend(shut)
    return shut


def pools_shut_between_world_sizes() -> tuple[int, ...]:
    """The world sizes of the pools ``keep_only_pools`` shut so far, in order."""
    return tuple(_SHUT_BETWEEN_WORLD_SIZES)


def shutdown_pools() -> None:
    """Shuts down every pool of the session; the next task would start new ones."""
    _POOLS.close()
    close_template()


# Outside pytest (a script using the pools) nothing else would stop the workers.
atexit.register(shutdown_pools)


def _make_task(
    fn: Callable[..., object], world_size: int, kwargs: dict[str, object]
) -> protocol.Task:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not (isinstance(module, str) and isinstance(qualname, str)) or (
        _lookup(module, qualname) is not fn
    ):
        raise TypeError(
            f"run_on_ranks needs a module-level function that the workers can import by name, "
            f"got {fn!r}"
        )
    try:
        inspect.signature(fn).bind(0, world_size, **kwargs)
    except TypeError as exc:
        call = f"fn(rank, world_size, **{sorted(kwargs)})"
        raise TypeError(f"{module}.{qualname} cannot be called as {call}: {exc}") from None
    try:
        payload = pickle.dumps(kwargs)
    except Exception as exc:
        raise TypeError(f"the arguments for {module}.{qualname} cannot be pickled: {exc}") from exc
    return protocol.Task(module=module, qualname=qualname, kwargs=payload, sys_path=tuple(sys.path))


def _lookup(module: str, qualname: str) -> object:
    """What a worker would import as ``module.qualname``, or None if there is no such thing."""
    target: object = sys.modules.get(module)
    for name in qualname.split("."):  # a closure's "<locals>" part fails here, as it should
        target = getattr(target, name, None)
    return target


def _is_failure(reply: protocol.Message | None) -> bool:
    """Whether a reply means the other ranks may never answer: a raise or a dead worker."""
    return reply is None or (isinstance(reply, protocol.Outcome) and reply.error is not None)


def _value_of(rank: int, reply: protocol.Message | None) -> object:
    # run() has raised unless every reply is an Outcome holding a value.
    assert isinstance(reply, protocol.Outcome) and reply.value is not None
    try:
        return pickle.loads(reply.value)
    except Exception as exc:
        raise RankTaskError(
            f"rank {rank}'s return value cannot be unpickled here: {exc!r}"
        ) from exc
