"""A file that fails on the rank that writes or reads it fails on every rank, at once.

Rank 0 alone writes a full state dict file and reads one. A disk that fills up mid-file, or
a read that fails after the file was checked, used to raise on rank 0 only, while rank 1
waited in the next gather or scatter until rank 0's process exited, or for the process
group's timeout if rank 0's program caught the error and went on. Here every rank must raise
the same error, the ranks must still be in step afterwards (a second save works), and the
``.partial`` file must be gone.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.pool import run_on_ranks
from tests.core import models
from tests.core.parity import Run, apply, full_params, make_mesh

# Only stops a broken test: without agreement rank 1 waits for rank 0 forever.
TIMEOUT_S = 60.0
WRITERS = {"model.safetensors": "SafetensorsWriter", "model.pt": "TorchSaveWriter"}


def _sharded(world_size: int) -> torch.nn.Module:
    model: torch.nn.Module = models.build("gpt", seed=4)
    apply("shardkit", model, make_mesh(Run(model="gpt"), world_size), Run(model="gpt"))
    return model


def _outcome(work: Any) -> tuple[str, str]:
    try:
        work()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "", ""


def _outcome_with_failures(
    rank: int, cls: Any, method: str, error: OSError, after: int, work: Any
) -> tuple[str, str]:
    """``work``'s outcome while ``cls.method`` raises ``error`` on rank 0 after ``after`` calls."""
    original = getattr(cls, method)
    calls = [0]

    def failing(self: Any, *args: Any) -> Any:
        if calls[0] >= after:
            raise error
        calls[0] += 1
        return original(self, *args)

    if rank == 0:
        setattr(cls, method, failing)
    try:
        return _outcome(work)
    finally:
        setattr(cls, method, original)


def _full_disk_body(
    rank: int, world_size: int, path: str, writes_before: int, again: str
) -> dict[str, Any]:
    """Rank 0's disk fills up after ``writes_before`` tensors; then every rank saves again."""
    from shardkit.core import save_full_state_dict
    from shardkit.core.formats import file_writers

    model = _sharded(world_size)
    cls = getattr(file_writers, WRITERS[Path(path).name])
    full_disk = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    error, message = _outcome_with_failures(
        rank,
        cls,
        "write_chunks",
        full_disk,
        writes_before,
        lambda: save_full_state_dict(model, path),
    )
    leftovers = sorted(p.name for p in Path(path).parent.iterdir())
    # The program caught the error and goes on: the ranks must still be in step.
    save_full_state_dict(model, again)
    return {
        "error": error,
        "message": message,
        "leftovers": leftovers,
        "params": full_params(model),
    }


@pytest.mark.parametrize("name", list(WRITERS))
@pytest.mark.parametrize("writes_before", [0, 5])
def test_a_full_disk_on_rank0_raises_on_every_rank(
    name: str, writes_before: int, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    path = out / name
    again = tmp_path / ("again" + Path(name).suffix)
    results = run_on_ranks(
        2,
        _full_disk_body,
        path=str(path),
        writes_before=writes_before,
        again=str(again),
        timeout_s=TIMEOUT_S,
    )
    first = results[0]
    assert first["error"] == "OSError", first
    assert str(path) in first["message"] and "rank 0" in first["message"], first["message"]
    assert os.strerror(errno.ENOSPC) in first["message"], first["message"]
    for result in results:
        assert (result["error"], result["message"]) == (first["error"], first["message"])
        assert result["leftovers"] == [], result["leftovers"]  # no .partial, no file
    if name.endswith(".safetensors"):
        from safetensors.torch import load_file

        saved = load_file(again)
    else:
        saved = torch.load(again, weights_only=True)
    for key, value in first["params"].items():
        assert saved[key].float().equal(value), key


def _failing_read_body(rank: int, world_size: int, path: str, reads_before: int) -> dict[str, Any]:
    """Rank 0's reads fail (an I/O error) after ``reads_before`` tensors; then a save."""
    from shardkit.core import load_full_state_dict, save_full_state_dict
    from shardkit.core.formats import file_readers

    model = _sharded(world_size)
    io_error = OSError(errno.EIO, f"{os.strerror(errno.EIO)}: {path}")
    error, message = _outcome_with_failures(
        rank,
        file_readers.SafetensorsReader,
        "read",
        io_error,
        reads_before,
        lambda: load_full_state_dict(model, path),
    )
    save_full_state_dict(model, path + ".again.safetensors")  # still in step
    return {"error": error, "message": message}


@pytest.mark.parametrize("reads_before", [0, 3])
def test_a_failing_read_on_rank0_raises_on_every_rank(reads_before: int, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file(models.build("gpt", seed=3).state_dict(), path)
    results = run_on_ranks(
        2, _failing_read_body, path=str(path), reads_before=reads_before, timeout_s=TIMEOUT_S
    )
    assert results[0]["error"] == "OSError", results[0]
    assert str(path) in results[0]["message"], results[0]["message"]
    assert results[1] == results[0]
