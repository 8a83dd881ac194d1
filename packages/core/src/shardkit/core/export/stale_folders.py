"""Folders a killed process left: each marked with its owner, removed by the next one made.

A receiver's mirror in files (``mirror_files.py``) removes its folder when it is closed or
collected, which a process that exits runs. A process killed (SIGKILL, the kernel's OOM killer,
the end of a job's allocation), or one that ends with ``os._exit`` (vLLM's threads can hold a
normal exit, so scripts around it often do), runs nothing, and its folder (the model in the
export dtype, once or twice) would stay on the disk for good, one more for every such run. So each
folder holds an ``owner.json`` (this host's name, the process's id and its start time), and
a new folder made beside it first removes those whose owner is on this host and no longer
running: no process with that id, or one that started at another time (the id was reused).
A folder of another host's (a shared disk), of another user's, or without the file (being
made, or not ours) is left alone.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import stat
from pathlib import Path

__all__ = ["OWNER_FILE", "mark_owner", "process_start", "remove_stale"]

logger = logging.getLogger(__name__)

OWNER_FILE = "owner.json"
_PREFIX = "shardkit-"
_MAX_OWNER_BYTES = 4096


def process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, from /proc); None: not found.

    None as well where there is no /proc (then only whether the id runs can be told).
    """
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The second field (the command) may hold spaces and parentheses: read after its last ")".
    fields = text[text.rindex(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None  # the 22nd field: the start time


def mark_owner(folder: Path) -> None:
    """Write ``folder``'s owner: this host, this process and when it started."""
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "start": process_start(os.getpid())}
    (folder / OWNER_FILE).write_text(json.dumps(owner))


def _running(pid: int, start: str | None) -> bool:
    now = process_start(pid)
    if now is not None:
        return start is None or now == start
    if Path("/proc").is_dir():
        return False  # no such process: /proc would list it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale(folder: Path) -> bool:
    """Whether ``folder`` is ours and its owner, on this host, no longer runs."""
    try:
        info = os.lstat(folder)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return False
        with open(folder / OWNER_FILE, "rb") as file:
            owner = json.loads(file.read(_MAX_OWNER_BYTES))
    except (OSError, ValueError):
        return False
    if not isinstance(owner, dict) or owner.get("host") != socket.gethostname():
        return False
    pid, start = owner.get("pid"), owner.get("start")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or pid == os.getpid():
        return False
    return not _running(pid, start if isinstance(start, str) else None)


def remove_stale(parent: Path) -> list[Path]:
    """Remove the folders under ``parent`` whose owners on this host no longer run; them."""
    removed = []
    try:
        children = list(parent.iterdir())
    except OSError:
        return []
    for child in children:
        if child.name.startswith(_PREFIX) and _stale(child):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    if removed:
        logger.warning(
            "removed %d folder(s) under %s left by receivers whose processes were killed: %s",
            len(removed),
            parent,
            ", ".join(p.name for p in removed),
        )
    return removed
