"""demo/train_fsdp1.py, an FSDP1 script, runs on shardkit.legacy as on torch's FSDP1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from harness.pool import run_on_ranks


def _train(rank: int, world_size: int, **fields: Any) -> list[float]:
    from demo.train_fsdp1 import Config, train

    return train(Config(**fields))


def test_the_fsdp1_script_trains_checkpoints_and_resumes_like_torchs(tmp_path: Path) -> None:
    def run(**fields: Any) -> list[float]:
        return list(run_on_ranks(2, _train, **fields)[0])

    ours = run(fsdp="shardkit", steps=6, ckpt=tmp_path / "a.pt", ckpt_every=3)
    theirs = run(fsdp="torch", steps=6)
    # bf16 parameters: the same computation, up to summation order in low precision.
    torch.testing.assert_close(ours, theirs, rtol=1e-2, atol=1e-2)
    # Stop at step 3, resume to 6: exactly the losses of the run that never stopped.
    run(fsdp="shardkit", steps=3, ckpt=tmp_path / "b.pt", ckpt_every=3)
    resumed = run(fsdp="shardkit", steps=6, ckpt=tmp_path / "b.pt", ckpt_every=3, resume=True)
    assert resumed == ours[3:]
    # A checkpoint written by torch's FSDP1 resumes on shardkit.legacy.
    run(fsdp="torch", steps=3, ckpt=tmp_path / "c.pt", ckpt_every=3)
    crossed = run(fsdp="shardkit", steps=6, ckpt=tmp_path / "c.pt", ckpt_every=3, resume=True)
    torch.testing.assert_close(crossed, theirs[3:], rtol=1e-2, atol=1e-2)


def _train_outcome(rank: int, world_size: int, **fields: Any) -> tuple[str, str]:
    try:
        _train(rank, world_size, **fields)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "", "no error"


def test_a_checkpoint_that_rank0_cannot_write_fails_on_every_rank(tmp_path: Path) -> None:
    taken = tmp_path / "taken"
    taken.write_text("a file where the checkpoint's folder should be")
    ckpt = taken / "a.pt"
    results = run_on_ranks(
        2, _train_outcome, fsdp="shardkit", steps=3, ckpt=ckpt, ckpt_every=3, timeout_s=120
    )
    assert results[0][0] == "OSError", results
    assert results[0][1].startswith(f"rank 0 could not write {ckpt}: "), results
    assert results[1] == results[0]
