"""Messages between the pool (the pytest process) and its workers, one pickle per frame.

Each worker has its own socket pair to the pool, so every message is implicitly from or to
one rank. A worker's messages always come in the order Ready, then for each task Outcome,
Ready: the pool relies on that order and never has to match replies to requests.

Frames are plain ``pickle`` over ``Connection.send_bytes``, not ``Connection.send``: the
latter uses multiprocessing's ForkingPickler, for which ``torch.multiprocessing`` registers
reductions that move tensors through shared-memory file descriptors this socket cannot pass.
Plain pickle copies tensors by value. Everything pickled here is our own data between our
own processes, so unpickling it is safe.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from multiprocessing.connection import Connection

__all__ = [
    "FD_ENV_VAR",
    "POOL_PID_ENV_VAR",
    "Message",
    "Outcome",
    "Ready",
    "Shutdown",
    "Task",
    "receive",
    "send",
]

FD_ENV_VAR = "SHARDKIT_POOL_FD"
"""Names the environment variable that gives a worker the file descriptor of its socket."""
POOL_PID_ENV_VAR = "SHARDKIT_POOL_PID"
"""Names the environment variable that gives a worker the process id of its pool."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Task:
    """Pool → worker: call ``module.qualname(rank, world_size, **kwargs)``."""

    module: str
    """Module that defines the function, as in ``fn.__module__``."""
    qualname: str
    """Dotted path to the function inside the module, as in ``fn.__qualname__``."""
    kwargs: bytes
    """The pickled keyword arguments. Kept as bytes so the worker unpickles them only after
    it has imported ``module``, which may define the classes they are instances of."""
    sys_path: tuple[str, ...]
    """The pool's ``sys.path``: pytest may have added folders (for test folders that are not
    packages) that the worker needs to import ``module`` by the same name."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """Worker → pool: how a task ended on one rank. Exactly one field is set."""

    value: bytes | None = None
    """The pickled return value, when the task returned."""
    error: str | None = None
    """The formatted traceback, when the task raised or its value could not be pickled."""


@dataclass(frozen=True, slots=True)
class Ready:
    """Worker → pool: reset done and barrier passed; the worker waits for the next task."""

    groups_in_step: bool = True
    """False: the ranks' registries of process groups differ (a task made groups on some
    ranks only), so a group made later by its members alone would get different names on
    them and hang; the pool starts afresh before the next task."""
    groups_held: int = 1
    """Process groups this worker holds (each ``init_device_mesh`` makes some; none is ever
    destroyed): each keeps a gloo thread that wakes while idle."""


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Pool → worker: destroy the process group and exit."""


Message = Task | Outcome | Ready | Shutdown


def send(conn: Connection, message: Message) -> None:
    """Sends one message as one frame."""
    conn.send_bytes(pickle.dumps(message))


def receive(conn: Connection) -> Message:
    """Receives one message; raises EOFError when the other side has gone."""
    message = pickle.loads(conn.recv_bytes())
    # Not an assert: a foreign frame means a broken worker, which the pool must report.
    if not isinstance(message, Task | Outcome | Ready | Shutdown):
        raise TypeError(f"unexpected message on the pool connection: {message!r}")
    return message
