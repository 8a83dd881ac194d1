"""A weight export under the trackers: its memory peak in one process, and at W=2 on gloo its
gathers counted as the export counts them, byte for byte as the planner predicts per rank."""

from __future__ import annotations

from typing import Any, Literal

import pytest
import torch

from harness.pool import run_on_ranks
from shardkit.core.export import ExportOptions, FullTensorReceiver, WeightExporter
from shardkit.tools.plan.export.axis_gathers import export_tensors
from shardkit.tools.plan.export.cost import ExportSpec, export_cost
from shardkit.tools.track.export_window import ExportWindow
from shardkit.tools.track.memory import MemoryTracker
from tests.core.export.export_models import Decoder, sharded


def test_a_window_measures_the_exports_own_memory_peak() -> None:
    model = Decoder()
    exporter = WeightExporter(model, ExportOptions(dtype=torch.bfloat16, min_buckets=1))
    with pytest.raises(RuntimeError, match="enter and leave"):
        ExportWindow().measure()
    with MemoryTracker(model) as memory, ExportWindow(memory=memory) as window:
        exporter.export(FullTensorReceiver(lambda tensors: None))
    measured = window.measure()
    assert measured.collectives == 0 and measured.sent_bytes == 0  # no CommTracker
    # One bucket: the tensors cast to bf16 are live at once, on top of the model.
    (bucket,) = exporter.buckets
    assert measured.peak_above_start_bytes is not None and measured.peak_bytes is not None
    assert measured.peak_above_start_bytes >= bucket.nbytes
    assert measured.peak_bytes >= measured.peak_above_start_bytes + 4 * sum(
        p.numel() for p in model.parameters()
    )


_CONFIGS: list[tuple[Literal["first", "all"], int]] = [
    ("first", 3000),
    ("first", 2**20),
    ("all", 3000),
]
"""(to, bucket_bytes): buckets of a layer or so, one bucket, and every rank receiving."""


def _tracked_exports(rank: int, world_size: int) -> list[dict[str, Any]]:
    from shardkit.tools.track.comm import CommTracker

    model = sharded("shardkit")
    out = []
    for to, bucket_bytes in _CONFIGS:
        options = ExportOptions(dtype=torch.bfloat16, bucket_bytes=bucket_bytes, to=to)
        exporter = WeightExporter(model, options)
        receiver = FullTensorReceiver(lambda tensors: None) if exporter.receiving else None
        with (
            CommTracker() as comm,
            MemoryTracker(model) as memory,
            ExportWindow(comm=comm, memory=memory) as window,
        ):
            report = exporter.export(receiver)
        out.append({
            "measured": window.measure().to_dict(),
            "kinds": sorted({r.kind for r in window.records()}),
            "report": {
                "buckets": report.buckets,
                "collectives": report.counts.collectives,
                "sent_bytes": report.counts.sent_bytes,
                "received_bytes": report.counts.received_bytes,
            },
        })  # fmt: skip
    return out


def test_an_export_is_tracked_and_predicted_byte_for_byte() -> None:
    ranks = run_on_ranks(2, _tracked_exports)
    with torch.device("meta"):
        tensors = export_tensors(Decoder())
    for i, (to, bucket_bytes) in enumerate(_CONFIGS):
        receiving, other = ranks[0][i], ranks[1][i]
        spec = ExportSpec(world_size=2, dtype=torch.bfloat16, bucket_bytes=bucket_bytes, to=to,
                          backend="gloo")  # fmt: skip
        predicted = export_cost(tensors, spec)
        # Every rank's counts, as its ExportReport holds them.
        assert [
            {"buckets": predicted.buckets, "collectives": r.collectives,
             "sent_bytes": r.sent_bytes, "received_bytes": r.received_bytes}
            for r in predicted.ranks
        ] == [receiving["report"], other["report"]], (to, bucket_bytes)  # fmt: skip
        assert other["report"]["sent_bytes"] > 0
        # The tracker sees each message (at least one a collective); on gloo a bucket's dim-0
        # pieces travel as each rank's own rows, unpadded: the bytes the export counts.
        for rank in (receiving, other):
            assert rank["measured"]["collectives"] >= rank["report"]["collectives"]
            assert rank["measured"]["gather_bytes"] == rank["report"]["sent_bytes"]
            assert rank["measured"]["control_bytes"] == predicted.control_bytes
        if to == "first":
            assert receiving["kinds"] == ["all_gather", "recv"]
            assert other["kinds"] == ["all_gather", "send"]
        assert (
            predicted.wire_bytes
            == receiving["report"]["sent_bytes"] + other["report"]["sent_bytes"]
        )
        # The export's own memory peak: the receiving rank's holds a whole bucket.
        assert receiving["measured"]["peak_above_start_bytes"] >= predicted.largest_bucket_bytes
        assert other["measured"]["peak_above_start_bytes"] > 0
