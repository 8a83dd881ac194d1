"""All-or-nothing exports: a receiver serves export k complete until export k+1 is complete.

Each case exports version 0 from a W=2 fully_shard model, trains a step, and fails export 1
at one point: the receiver's load raising at the commit, its staging raising mid-update, the
bound passed, a trainer rank killed mid-export or at the ranks' last agreement. Every rank
that lives ends with one error naming the cause, and the receiver still serves version 0 (or,
killed after the commit, version 1), read back tensor by tensor against the trainer's
``full_tensor()``. A failed delta leaves both sides' kept parts out of use: the next export is
full, and correct.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.pool import RankTaskError, run_on_ranks
from tests.core.export.export_models import Decoder, full_state, sharded, train_step

BOUND_S = 2.0


class _HeldEngine:
    """A stand-in engine: ``load`` writes whole tensors into what it holds, tensor by tensor,
    and raises partway through its ``fail_at``-th call (one tensor of that bucket written)."""

    def __init__(self) -> None:
        self.held: dict[str, torch.Tensor] = {}
        self.calls = 0
        self.fail_at: int | None = None

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.calls += 1
        for written, (name, tensor) in enumerate(tensors):
            if self.calls == self.fail_at and written == 1:
                raise RuntimeError("the engine's loader ran out of memory")
            self.held[name] = tensor.clone()


def _same(held: dict[str, torch.Tensor], oracle: dict[str, torch.Tensor]) -> list[str]:
    """The names whose held tensor differs from the oracle's (or is missing)."""
    return [n for n, t in oracle.items() if n not in held or not torch.equal(held[n], t)]


def _exporter(bound_s: float = 30.0) -> Any:
    from shardkit.core.export import ExportOptions, WeightExporter

    model = sharded("shardkit")
    options = ExportOptions(dtype=torch.bfloat16, bucket_bytes=3000, bound_s=bound_s)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), WeightExporter(model, options)


def _failed_export(exporter: Any, receiver: Any, *, delta: bool) -> str | None:
    from shardkit.core.errors import WeightExportError

    try:
        exporter.export(receiver if exporter.receiving else None, delta=delta)
    except WeightExportError as error:
        return str(error)
    return None


def _load_raising_at_the_commit(rank: int, world_size: int) -> dict[str, Any]:
    from shardkit.core.export import FullTensorReceiver

    model, optimizer, exporter = _exporter()
    engine = _HeldEngine()
    receiver = FullTensorReceiver(engine.load)
    exporter.export(receiver if exporter.receiving else None)
    version0 = full_state(model, torch.bfloat16)
    train_step(model, optimizer, 0, rank)
    engine.fail_at = engine.calls + 3  # the third bucket of export 1
    message = _failed_export(exporter, receiver, delta=True)
    after_failure = [_same(engine.held, version0), receiver.version]
    train_step(model, optimizer, 1, rank)
    report = exporter.export(receiver if exporter.receiving else None, delta=True)
    version2 = full_state(model, torch.bfloat16)
    return {
        "message": message,
        "after_failure": after_failure,
        "next": [report.kind, report.version, _same(engine.held, version2), receiver.version],
    }


def test_a_load_raising_at_the_commit_leaves_the_last_version_serving() -> None:
    results = run_on_ranks(2, _load_raising_at_the_commit)
    assert results[0]["message"] == results[1]["message"]
    message = results[0]["message"]
    assert "receiver on rank 0 failed at commit" in message, message
    assert "ran out of memory" in message and "export 0 was loaded back, complete" in message
    assert results[0]["after_failure"] == [[], 0]  # every tensor is version 0's
    # The failed delta's kept parts are dropped on both sides: the next export is full.
    assert results[0]["next"] == ["full", 2, [], 2]
    assert results[1]["next"][:2] == ["full", 2]


class _StagingFails:
    """A ModuleReceiver whose staging of bucket ``fail_at`` raises (a malformed bucket)."""

    def __init__(self, module: torch.nn.Module) -> None:
        from shardkit.core.export import ModuleReceiver

        self.inner = ModuleReceiver(module)
        self.fail_at: int | None = None
        self.stall: tuple[int, float] | None = None
        self.begin, self.commit = self.inner.begin, self.inner.commit
        self.finish, self.abort = self.inner.finish, self.inner.abort

    def receive(self, bucket: Any) -> None:
        if self.stall is not None and bucket.index == self.stall[0]:
            time.sleep(self.stall[1])
        if bucket.index == self.fail_at:
            raise ValueError(f"bucket {bucket.index} is malformed")
        self.inner.receive(bucket)


def _receiver_failing_midway(rank: int, world_size: int, how: str) -> dict[str, Any]:
    model, optimizer, exporter = _exporter(bound_s=BOUND_S if how == "late" else 30.0)
    target = Decoder().to(torch.bfloat16)
    receiver = _StagingFails(target)
    exporter.export(receiver if exporter.receiving else None)
    version0 = full_state(model, torch.bfloat16)
    train_step(model, optimizer, 0, rank)
    if how == "raises":
        receiver.fail_at = 2
    else:
        receiver.stall = (2, 2 * BOUND_S)
    message = _failed_export(exporter, receiver, delta=True)
    receiver.fail_at = receiver.stall = None
    after_failure = [_same(target.state_dict(), version0), receiver.inner.version]
    report = exporter.export(receiver if exporter.receiving else None, delta=True)
    return {
        "message": message,
        "after_failure": after_failure,
        "next": [report.kind, _same(target.state_dict(), full_state(model, torch.bfloat16))],
    }


@pytest.mark.parametrize("how", ["raises", "late"])
def test_a_receiver_failing_mid_update_leaves_the_last_version_serving(how: str) -> None:
    """Its staging raises at bucket 2, or takes past the bound there."""
    results = run_on_ranks(2, _receiver_failing_midway, how=how)
    assert results[0]["message"] == results[1]["message"]
    message = results[0]["message"]
    assert "bucket 2" in message, message
    cause = "malformed" if how == "raises" else "SHARDKIT_EXPORT_BOUND"
    assert cause in message, message
    assert results[0]["after_failure"] == [[], 0]
    assert results[0]["next"] == ["full", []]


def _rank_killed(rank: int, world_size: int, out: str, where: str) -> None:
    from shardkit.core.export import exporter as exporter_module
    from shardkit.core.export import transfer

    model, optimizer, exporter = _exporter(bound_s=BOUND_S)
    target = Decoder().to(torch.bfloat16)
    from shardkit.core.export import ModuleReceiver

    receiver = ModuleReceiver(target)
    exporter.export(receiver if exporter.receiving else None)
    versions = [full_state(model, torch.bfloat16)]
    train_step(model, optimizer, 0, rank)
    versions.append(full_state(model, torch.bfloat16))
    if rank == 1:  # this worker dies: what it patches goes with it
        if where == "mid-export":
            move = transfer.BucketTransfer.move

            def dying_move(self: Any, bucket: Any) -> Any:
                if bucket.index == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                return move(self, bucket)

            transfer.BucketTransfer.move = dying_move  # type: ignore[method-assign]
        else:
            exporter_module.WeightExporter._finish = (  # type: ignore[method-assign]
                lambda self, transfer: os.kill(os.getpid(), signal.SIGKILL)
            )
    message = _failed_export(exporter, receiver, delta=False)
    held = target.state_dict()
    Path(out).write_text(
        json.dumps(
            {
                "message": message,
                "version": receiver.version,
                "differs": [_same(held, versions[0]), _same(held, versions[1])],
            }
        )
    )


@pytest.mark.parametrize("where", ["mid-export", "at-the-end"])
def test_a_trainer_rank_killed_leaves_one_version_serving_complete(
    tmp_path: Path, where: str
) -> None:
    """Rank 1 killed at bucket 2 (the receiver serves version 0), or at the ranks' last
    agreement, after rank 0's receiver committed (it serves version 1); rank 0 raises."""
    out = tmp_path / "rank0.json"
    with pytest.raises(RankTaskError):
        run_on_ranks(2, _rank_killed, out=str(out), where=where)
    found = json.loads(out.read_text())
    place = "bucket 2" if where == "mid-export" else "the export's end"
    assert found["message"] is not None and place in found["message"], found["message"]
    served = 0 if where == "mid-export" else 1
    assert found["version"] == served
    assert found["differs"][served] == []  # complete, read back tensor by tensor
    assert found["differs"][1 - served] != []  # and not the other (the step changed them)
