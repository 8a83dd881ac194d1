"""Publishing a finished save: the marker with every file's checksum, the renames, the pruning.

A save is written into a hidden ``.step_N.partial`` directory. Once every rank has finished,
rank 0 writes the ``COMPLETE`` marker (each file's size and SHA-256, checked before a load),
renames the directory into place and repoints ``latest``, each step an atomic rename followed
by an fsync of the directory, then deletes what ``keep`` no longer holds. None of it needs DCP,
the staging buffers or a pending save: the manager calls it with its root and ``keep``.

Deleting is ordered too (``remove``): the marker first, then DCP's ``.metadata``, then the
rest, so that a process killed part-way never leaves a directory that a reader takes whole.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from shardkit.core.checkpoint.files import COMPLETE, FileSum, checksum, list_files, share
from shardkit.core.runtime.groups import global_rank, world_size
from shardkit.core.runtime.p2p.agreement import everyone, from_rank, raise_shared

__all__ = ["DCP_METADATA", "LATEST", "MARKERS", "checksums", "publish", "remove", "step_of"]

LATEST = "latest"
"""The file under the root that names the current checkpoint's directory."""
DCP_METADATA = ".metadata"
"""What makes a directory a checkpoint to torch's readers."""
MARKERS = frozenset({COMPLETE, f".{COMPLETE}.tmp"})
"""The manager's own files in a checkpoint directory, not the save's: left out of its checksums."""


def step_of(path: Path) -> int:
    """The step a ``step_N`` directory holds."""
    return int(path.name.removeprefix("step_"))


def checksums(directory: Path) -> dict[str, FileSum]:
    """Every file's size and checksum (collective): each rank hashes its share of the files."""
    names: list[str] = from_rank(0, lambda: list_files(directory, leave_out=MARKERS))
    mine = share(names, global_rank(), world_size())
    parts = raise_shared(everyone(lambda: {n: checksum(directory / n) for n in mine}))
    return {name: part[name] for part in parts for name in part}


def publish(
    root: Path, keep: int, step: int, partial: Path, target: Path, files: dict[str, FileSum]
) -> None:
    """Make ``partial`` the checkpoint of ``step`` at ``target`` and the latest (rank 0 only).

    Then keep the newest ``keep`` complete checkpoints up to ``step``.
    """
    marker = {
        "step": step,
        "world_size": world_size(),
        "saved_at": time.time(),
        "files": files,  # size and SHA-256 of each, checked before a load
    }
    write_atomic(partial / COMPLETE, json.dumps(marker) + "\n")
    if target.exists():  # the same step saved again (a resume from an earlier one)
        remove(target)
    os.replace(partial, target)
    _fsync_dir(root)
    write_atomic(root / LATEST, target.name + "\n")
    _fsync_dir(root)
    _prune(root, keep, step)


def remove(checkpoint: Path, *, ignore_errors: bool = False) -> None:
    """Delete a checkpoint directory, its marker first, then DCP's ``.metadata``.

    ``rmtree`` deletes in directory order: killed part-way, it could leave the marker beside
    missing data files, a checkpoint counted complete that no load takes; or ``.metadata``
    beside them, which torch's readers take as a whole checkpoint (the 20-kill test found one,
    a step saved again and killed while the old directory was being removed).
    """
    for name in (COMPLETE, DCP_METADATA):
        try:
            (checkpoint / name).unlink(missing_ok=True)
        except OSError:
            if not ignore_errors:
                raise
    shutil.rmtree(checkpoint, ignore_errors=ignore_errors)


def write_atomic(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: a temporary file, flushed to disk, then renamed."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _prune(root: Path, keep: int, step: int) -> None:
    saves = sorted(root.glob("step_*"), key=step_of)
    # Steps after this one belong to a run that went further and was then resumed from an
    # earlier checkpoint: that future is abandoned.
    kept = [p for p in saves if step_of(p) <= step and (p / COMPLETE).is_file()]
    doomed = [p for p in saves if p not in kept[-keep:]]
    for path in doomed:
        remove(path, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
