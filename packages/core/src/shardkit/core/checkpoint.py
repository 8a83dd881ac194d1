"""Checkpoint directories that an interrupted save can never break.

Each save is a torch.distributed.checkpoint (DCP) save into a fresh hidden directory. Only
when every rank has finished does rank 0 mark it complete, rename it into place and repoint
``latest`` (each an atomic rename). A save killed part-way leaves a ``.step_N.partial``
directory that nothing loads, and the previous checkpoint stays current. The newest
``keep`` checkpoints are kept.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from shardkit.core.runtime.groups import barrier, global_rank, world_size

__all__ = ["CheckpointManager", "IncompleteCheckpointError"]

logger = logging.getLogger(__name__)

_COMPLETE = "COMPLETE"
_LATEST = "latest"


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint directory whose save never finished."""


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class CheckpointManager:
    """Numbered DCP checkpoints under ``root``: save, keep the newest, load the newest complete.

    Every method that touches the checkpoint is collective: call it on every rank.

    Args:
        root: the directory that holds ``step_00000010/``, ``step_00000020/``, ``latest``.
        keep: how many complete checkpoints to keep (older ones are deleted after a save).
    """

    def __init__(self, root: str | os.PathLike[str], *, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"CheckpointManager keeps at least 1 checkpoint, got keep={keep}")
        self.root = Path(root)
        self.keep = keep

    def path_for(self, step: int) -> Path:
        """Where the checkpoint of ``step`` lives once complete."""
        return self.root / f"step_{step:08d}"

    def complete(self) -> list[Path]:
        """Every complete checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob("step_*") if (p / _COMPLETE).is_file()]
        return sorted(found, key=_step_of)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        pointer = self.root / _LATEST
        if pointer.is_file():
            named = self.root / pointer.read_text().strip()
            if (named / _COMPLETE).is_file():
                return named
            logger.warning("%s names %s, which is not complete; scanning", pointer, named)
        done = self.complete()
        return done[-1] if done else None

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Save ``state`` (DCP state: tensors, DTensors, ``Stateful`` objects) as ``step``."""
        target = self.path_for(step)
        partial = self.root / f".{target.name}.partial"
        rank0 = global_rank() == 0
        started = time.perf_counter()
        if rank0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # remains of an interrupted save
        barrier()
        dcp_save(state, checkpoint_id=partial)
        barrier()  # every rank's shards are written
        if rank0:
            self._publish(step, partial, target)
        barrier()  # nobody goes on before the checkpoint is current
        logger.info("saved %s in %.1f s", target, time.perf_counter() - started)
        return target

    def _publish(self, step: int, partial: Path, target: Path) -> None:
        marker = {"step": step, "world_size": world_size(), "saved_at": time.time()}
        _write_atomic(partial / _COMPLETE, json.dumps(marker) + "\n")
        if target.exists():
            shutil.rmtree(target)  # the same step saved again
        os.replace(partial, target)
        _fsync_dir(self.root)
        _write_atomic(self.root / _LATEST, target.name + "\n")
        _fsync_dir(self.root)
        self._prune(step)

    def _prune(self, step: int) -> None:
        saves = sorted(self.root.glob("step_*"), key=_step_of)
        # Steps after this one belong to a run that went further and was then resumed from an
        # earlier checkpoint: that future is abandoned.
        kept = [p for p in saves if _step_of(p) <= step and (p / _COMPLETE).is_file()]
        doomed = [p for p in saves if p not in kept[-self.keep :]]
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)

    def load(
        self, state: dict[str, Any], path: str | os.PathLike[str] | None = None
    ) -> Path | None:
        """Load the newest complete checkpoint (or ``path``) into ``state``, in place.

        Returns the path loaded, or None if there is no complete checkpoint (a fresh start).

        Raises:
            IncompleteCheckpointError: ``path`` names a save that never finished.
        """
        chosen = Path(path) if path is not None else self.latest()
        if chosen is None:
            return None
        if not (chosen / _COMPLETE).is_file():
            alternatives = ", ".join(p.name for p in self.complete()) or "none"
            raise IncompleteCheckpointError(
                f"checkpoint {chosen} is incomplete: its save was interrupted before every rank "
                f"finished (no {_COMPLETE} marker). Complete checkpoints here: {alternatives}"
            )
        dcp_load(state, checkpoint_id=chosen)
        return chosen
