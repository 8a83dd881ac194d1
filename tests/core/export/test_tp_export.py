"""The TP-sliced export on gloo: every engine rank's windows equal the trainer's
``full_tensor()`` cut there, bit for bit, from FSDP (W=2, 4; uneven rows) and FSDP x TP
shards, with exactly its windows' bytes arriving, into W / K engines or into one engine fed by
W ranks; a failing receiver ends it on every rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harness.pool import run_on_ranks
from tests.core.export.export_models import (
    Decoder,
    fully_shard_of,
    parallelize_decoder,
    perturb,
)

_LEAVES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


class _Collecting:
    """A slice receiver that keeps every window it is handed (and can fail on demand)."""

    def __init__(self, fail_at: int | str | None = None) -> None:
        self.fail_at = fail_at
        self.buckets = 0
        self.windows: dict[str, Any] = {}
        self.aborted: str | None = None
        self.finished = 0

    def begin(self, manifest: Any) -> None:
        if self.fail_at == "begin":
            raise RuntimeError("the engine refused it")
        self.windows = {}

    def receive(self, bucket: Any) -> None:
        self.buckets += 1
        if bucket.index == self.fail_at:
            raise RuntimeError("the engine's load raised")
        for window, data in bucket.windows:
            self.windows[window.name] = (window, data.clone())

    def finish(self) -> None:
        self.finished += 1

    def abort(self, error: BaseException) -> None:
        self.aborted = str(error)


def _model(layout: str, impl: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard = fully_shard_of(impl)
    torch.manual_seed(0)
    # 61 vocabulary rows and 40 hidden: uneven FSDP rows at W=4 (16, 16, 16, 13).
    model: Any = Decoder()
    world = torch.distributed.get_world_size()
    if layout == "fsdp":
        dp = init_device_mesh("cpu", (world,))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp = mesh["dp"]
        parallelize_decoder(model, mesh["tp"])
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def _sliced(
    rank: int, world_size: int, layout: str, impl: str, degree: int, one_engine: bool = False
) -> Any:
    from shardkit.core.export.tp_export import SlicedExporter
    from shardkit.core.export.tp_slices import EngineTP, SliceKind

    model = _model(layout, impl)
    # The Decoder's attention: 24 rows = 4 heads of 6, as many kv heads; its buffer is whole.
    engine = EngineTP(
        degree=degree,
        num_heads=4,
        num_kv_heads=4,
        head_dim=6,
        vocab_size=61,
        kinds={"model.position_scale": SliceKind.WHOLE},
    )
    exporter = SlicedExporter(
        model, engine, dtype=torch.bfloat16, bucket_bytes=3000, one_engine=one_engine
    )
    receiver = _Collecting() if exporter.engine_rank is not None else None
    wrong: list[str] = []
    reports = []
    for sync in range(2):
        perturb(model, sync)
        report = exporter.export(receiver)
        reports.append(report)
        full = {  # a collective: every rank, the ones that only send too
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).to(torch.bfloat16)
            for k, v in model.state_dict().items()
        }
        if receiver is None:
            continue  # this rank only sends
        for name, (window, data) in receiver.windows.items():
            expected = full[name][tuple(slice(a, b) for a, b in window.box)]
            if not torch.equal(data, expected):
                wrong.append(f"sync {sync}: {name}")
        if set(receiver.windows) != {s.name for b in exporter.buckets for s in b.sources}:
            wrong.append(f"sync {sync}: tensors missing")
    report = reports[-1]
    windows = receiver.windows if receiver is not None else {}
    expected_bytes = sum(d.numel() * d.element_size() for _, d in windows.values())
    return {
        "wrong": wrong,
        "engine_rank": exporter.engine_rank,
        "window_bytes": report.window_bytes,
        "expected_bytes": expected_bytes,
        "received": report.received_bytes,
        "copied": report.copied_bytes,
        "sent": report.sent_bytes,
        "finished": receiver.finished if receiver is not None else None,
        "cut": sorted(n for n, (w, _) in windows.items() if w.dim is not None),
    }


@pytest.mark.parametrize(
    ("world", "layout", "impl", "degree"),
    [
        (2, "fsdp", "shardkit", 2),
        (2, "fsdp", "torch", 2),
        (4, "fsdp", "shardkit", 2),  # two engines of TP 2
        (4, "fsdp", "shardkit", 4),
        (4, "fsdp_tp", "shardkit", 2),  # FSDP x TP 2x2, strided FSDP over TP's rows
        (4, "fsdp_tp", "torch", 4),
    ],
)
def test_each_engine_rank_receives_its_windows_bit_for_bit(
    world: int, layout: str, impl: str, degree: int
) -> None:
    results = run_on_ranks(world, _sliced, layout=layout, impl=impl, degree=degree)
    assert [r["engine_rank"] for r in results] == [g % degree for g in range(world)]
    for r in results:
        assert r["wrong"] == [], r["wrong"]
        assert r["finished"] == 2
        # Exactly its windows arrive: some copied from its own shards, the rest received.
        assert r["window_bytes"] == r["expected_bytes"] == r["received"] + r["copied"]
        assert any(leaf in name for name in r["cut"] for leaf in _LEAVES)
    assert sum(r["sent"] for r in results) == sum(r["received"] for r in results)


def _failing(rank: int, world_size: int, fail_at: int | str = 1) -> Any:
    from shardkit.core.errors import WeightExportError
    from shardkit.core.export.tp_export import SlicedExporter
    from shardkit.core.export.tp_slices import EngineTP, SliceKind

    model = _model("fsdp", "shardkit")
    engine = EngineTP(
        degree=2,
        num_heads=4,
        num_kv_heads=4,
        head_dim=6,
        vocab_size=61,
        kinds={"model.position_scale": SliceKind.WHOLE},
    )
    exporter = SlicedExporter(model, engine, dtype=torch.bfloat16, bucket_bytes=3000, bound_s=30)
    receiver = _Collecting(fail_at=fail_at if rank == 1 else None)
    try:
        exporter.export(receiver)
    except WeightExportError as error:
        message = str(error)
    else:
        message = "no error"
    buckets = receiver.buckets
    receiver.fail_at = None
    after = exporter.export(receiver)  # the next export goes through, on new groups
    return {
        "message": message,
        "aborted": receiver.aborted,
        "after": after.window_bytes,
        "buckets": buckets,
    }


def test_one_engine_of_the_first_k_ranks_takes_every_window_once() -> None:
    """``one_engine``: W=4 feeds one engine of TP 2 elsewhere; ranks 2 and 3 only send."""
    results = run_on_ranks(4, _sliced, layout="fsdp", impl="shardkit", degree=2, one_engine=True)
    assert [r["engine_rank"] for r in results] == [0, 1, None, None]
    for r in results[:2]:
        assert r["wrong"] == [], r["wrong"]
        assert r["finished"] == 2
        assert r["window_bytes"] == r["expected_bytes"] == r["received"] + r["copied"]
    for r in results[2:]:
        assert r["window_bytes"] == r["received"] == r["copied"] == 0 and r["sent"] > 0
    assert sum(r["sent"] for r in results) == sum(r["received"] for r in results)


def test_a_failing_receiver_ends_the_export_on_every_rank_with_one_error() -> None:
    results = run_on_ranks(2, _failing)
    messages = {r["message"] for r in results}
    assert len(messages) == 1, messages
    (message,) = messages
    assert "receiver of engine rank 1 on rank 1 failed at bucket 1" in message
    assert "the engine's load raised" in message
    assert all(r["aborted"] == message for r in results)
    assert all(r["after"] > 0 for r in results)


def test_a_receiver_refusing_at_begin_stops_every_rank_before_any_bucket() -> None:
    """Rank 1's receiver refuses in ``begin`` (a driver that found the engine amiss): rank 0,
    whose receiver began, raises the same error at the agreement after ``begin``, before any
    bucket moves; the next export goes through."""
    results = run_on_ranks(2, _failing, fail_at="begin")
    messages = {r["message"] for r in results}
    assert len(messages) == 1, messages
    assert "receiver of engine rank 1 on rank 1 failed at begin: RuntimeError" in messages.pop()
    assert [r["buckets"] for r in results] == [0, 0]
    assert all(r["after"] > 0 for r in results)
