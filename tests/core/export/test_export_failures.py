"""Exports that must not hang nor leave a receiver half-loaded: rank 0 doing receiver work
between buckets while the others run on (trl#7103), a rank late past the bound, a receiver
that fails, and ranks that disagree on what to export."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
import torch

from harness.pool import run_on_ranks
from tests.core.export.export_models import Decoder, full_state, sharded, train_step


class _SlowReceiver:
    """A ModuleReceiver that works a while on each bucket (rank 0's receiver work)."""

    def __init__(
        self,
        model: torch.nn.Module,
        pause_s: tuple[float, float],
        stall_at: int | None,
        stall_s: float,
    ) -> None:
        from shardkit.core.export import ModuleReceiver

        self.inner = ModuleReceiver(model)
        self.pause_s = pause_s
        self.stall_at = stall_at
        self.stall_s = stall_s
        self.random = random.Random(0)
        self.aborted: list[str] = []

    def begin(self, manifest: Any) -> None:
        self.inner.begin(manifest)

    def receive(self, bucket: Any) -> None:
        time.sleep(self.random.uniform(*self.pause_s))
        if bucket.index == self.stall_at:
            time.sleep(self.stall_s)
        self.inner.receive(bucket)

    def finish(self) -> None:
        self.inner.finish()

    def abort(self, error: BaseException) -> None:
        self.aborted.append(str(error))


def _interleaved(rank: int, world_size: int, impl: str, syncs: int) -> Any:
    from shardkit.core.export.exporter import ExportOptions, WeightExporter

    model = sharded(impl)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    exporter = WeightExporter(
        model, ExportOptions(dtype=torch.bfloat16, bucket_bytes=3000, bound_s=30)
    )
    target = Decoder().to(torch.bfloat16)
    receiver = _SlowReceiver(target, (0.0, 0.004), None, 0.0)
    mismatched = 0
    for sync in range(syncs):
        train_step(model, optimizer, sync, rank)
        exporter.export(receiver if exporter.receiving else None, delta=sync % 2 == 1)
        oracle = full_state(model, torch.bfloat16)  # a collective: every rank, every sync
        if exporter.receiving:
            held = target.state_dict()
            mismatched += sum(not torch.equal(held[k], v) for k, v in oracle.items())
    return mismatched


@pytest.mark.parametrize("syncs", [10, 100])  # 100: make soak
@pytest.mark.parametrize("impl", ["shardkit", "torch"])
def test_rank0_receiver_work_between_buckets_never_hangs(impl: str, syncs: int) -> None:
    assert run_on_ranks(2, _interleaved, impl=impl, syncs=syncs) == [0, 0]


def _stalled(rank: int, world_size: int, stall_s: float) -> Any:
    from shardkit.core.errors import WeightExportError
    from shardkit.core.export.exporter import ExportOptions, WeightExporter

    model = sharded("shardkit")
    exporter = WeightExporter(
        model, ExportOptions(dtype=torch.bfloat16, bucket_bytes=3000, bound_s=1.0, to="all")
    )
    target = Decoder().to(torch.bfloat16)
    receiver = _SlowReceiver(target, (0.0, 0.0), 2 if rank == 0 else None, stall_s)
    start = time.monotonic()
    try:
        exporter.export(receiver)
        message = None
    except WeightExportError as error:
        message = str(error)
    seconds = time.monotonic() - start
    # The next export starts afresh (new groups, full) and goes through.
    receiver.stall_at = None
    report = exporter.export(receiver)
    held = target.state_dict()
    equal = all(torch.equal(held[k], v) for k, v in full_state(model, torch.bfloat16).items())
    return {
        "message": message,
        "seconds": seconds,
        "aborted": receiver.aborted,
        "next": (report.kind, equal),
    }


def test_a_rank_late_past_the_bound_fails_every_rank_with_one_message() -> None:
    results = run_on_ranks(2, _stalled, stall_s=3.0)
    messages = {r["message"] for r in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message is not None and "rank 0" in message and "bucket 2" in message, message
    assert "late" in message and "SHARDKIT_EXPORT_BOUND" in message, message
    # Rank 1 waited for the bound, not for rank 0's whole stall (nor gloo's timeout).
    assert results[1]["seconds"] < 2.9, results[1]["seconds"]
    assert results[0]["aborted"] == [message]
    assert [r["next"] for r in results] == [("full", True)] * 2


class _FailingLoader:
    def begin(self, manifest: Any) -> None:
        pass

    def receive(self, bucket: Any) -> None:
        if bucket.index == 1:
            raise KeyError("no such layer: model.layers.0")

    def finish(self) -> None:
        pass

    def abort(self, error: BaseException) -> None:
        pass


def _failing(rank: int, world_size: int) -> Any:
    from shardkit.core.errors import WeightExportError
    from shardkit.core.export.exporter import ExportOptions, WeightExporter

    model = sharded("shardkit")
    exporter = WeightExporter(model, ExportOptions(bucket_bytes=3000))
    try:
        exporter.export(_FailingLoader(), delta=True)
    except WeightExportError as error:
        return str(error)
    return None


def test_a_failing_receiver_fails_every_rank_naming_the_bucket() -> None:
    messages = run_on_ranks(2, _failing)
    assert messages[0] == messages[1]
    assert "receiver on rank 0 failed at bucket 1" in messages[0] and "no such layer" in messages[0]


def _disagreeing(rank: int, world_size: int) -> Any:
    from shardkit.core.errors import WeightExportError
    from shardkit.core.export.exporter import ExportOptions, WeightExporter

    model = sharded("shardkit")
    # The ranks cast to different dtypes: their plans differ.
    dtype = torch.float32 if rank == 0 else torch.bfloat16
    exporter = WeightExporter(model, ExportOptions(dtype=dtype, to="all"))
    target = Decoder()
    from shardkit.core.export import ModuleReceiver

    before = {k: v.clone() for k, v in target.state_dict().items()}
    try:
        exporter.export(ModuleReceiver(target))
    except WeightExportError as error:
        untouched = all(torch.equal(before[k], v) for k, v in target.state_dict().items())
        return str(error), untouched
    return None, False


def test_ranks_that_export_different_plans_all_raise_before_any_bucket() -> None:
    results = run_on_ranks(2, _disagreeing)
    assert results[0] == results[1]
    message, untouched = results[0]
    assert "do not export the same thing" in message and "rank 0: plan" in message
    assert untouched
