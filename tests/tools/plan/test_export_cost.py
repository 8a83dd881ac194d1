"""The planner's export cost: buckets and bytes in one process, and at W=4 on FSDP, HSDP and
FSDP x TP every rank's predicted counts against what a real export's ``ExportReport`` holds."""

from __future__ import annotations

import json
from typing import Any, Literal

import pytest
import torch

from harness.pool import run_on_ranks
from shardkit.tools.plan.cli import main
from shardkit.tools.plan.export.axis_gathers import export_tensors
from shardkit.tools.plan.export.cost import ExportSpec, export_cost
from shardkit.tools.plan.tp_styles import tp_dims_of
from tests.core.export.export_models import Decoder, fully_shard_of
from tests.tools.plan.decoder_tp import decoder_tp_plan


def test_full_export_bytes_are_the_padded_aligned_parts() -> None:
    with torch.device("meta"):
        tensors = export_tensors(Decoder())
    assert {"model.embed_tokens.weight", "model.position_scale"} <= {t.name for t in tensors}
    assert "lm_head.weight" not in {t.name for t in tensors}  # tied: once
    spec = ExportSpec(world_size=4, dtype=torch.bfloat16, min_buckets=1)  # one bucket
    cost = export_cost(tensors, spec)
    # Every sharded tensor: ceil(rows / 4) rows of bf16, each segment 8-byte aligned.
    expected = 0
    for t in tensors:
        if t.sharded:
            rest = 1
            for size in t.shape[1:]:
                rest *= size
            expected += -(-(-(-t.shape[0] // 4) * rest * 2) // 8) * 8
    # Over the wire on both paths: the first rank keeps its own part, the others send theirs.
    assert [r.sent_bytes for r in cost.ranks] == [0] + [expected] * 3
    assert [r.received_bytes for r in cost.ranks] == [3 * expected, 0, 0, 0]
    assert cost.wire_bytes == 3 * expected
    assert cost.buckets == 1 and cost.collectives == 3


def test_delta_is_a_small_fraction_and_hsdp_exports_one_replica() -> None:
    with torch.device("meta"):
        tensors = export_tensors(Decoder())
    full = export_cost(tensors, ExportSpec(world_size=4, replicas=2, dtype=torch.bfloat16))
    alone = export_cost(tensors, ExportSpec(world_size=2, dtype=torch.bfloat16))
    assert full.received_bytes == alone.received_bytes
    assert [r.sent_bytes for r in full.ranks[2:]] == [0, 0]  # the second replica group
    delta = export_cost(
        tensors, ExportSpec(world_size=2, dtype=torch.bfloat16, delta_fraction=0.025)
    )
    assert delta.kind == "delta" and delta.received_bytes < 0.1 * alone.received_bytes
    assert delta.collectives == alone.collectives + 1
    with pytest.raises(ValueError, match="keep_axes"):
        ExportSpec(world_size=4, tp_degree=2, delta_fraction=0.1)


def test_shardkit_plan_prints_and_writes_the_export(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["shardkit.tools.examples:llama_8b", "--world-size", "64", "--bandwidth-gbps", "100"]
    assert main([*argv, "--export-dtype", "bf16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # At the default 64 MiB every layer (436 MiB in bf16) is a bucket alone, as are the
    # embedding, the final norm and the head: 32 + 3 (at 512 MiB the norm joined layer 31).
    assert data["export"]["buckets"] == 35 and data["export"]["kind"] == "full"
    assert main([*argv, "--export-dtype", "bf16", "--export-delta", "0.025"]) == 0
    assert "Weight export (delta):" in capsys.readouterr().out


_CONFIGS: list[tuple[Literal["first", "all"], int]] = [
    ("first", 2500),
    ("all", 2500),
    ("first", 2**20),
]
"""(to, bucket_bytes) of the exports compared: buckets of a layer or so, and one bucket."""


def _reported(rank: int, world_size: int, layout: str) -> list[dict[str, Any]]:
    """Each config's full export on ``layout`` at W=4: this rank's report."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from shardkit.core.export import ExportOptions, FullTensorReceiver, WeightExporter

    model: Any = Decoder()
    if layout == "fsdp":
        dp = init_device_mesh("cpu", (4,))
    elif layout == "hsdp":
        dp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp = mesh["dp"]
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], decoder_tp_plan(""))
    fully_shard = fully_shard_of("shardkit")
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    reports = []
    for to, bucket_bytes in _CONFIGS:
        options = ExportOptions(dtype=torch.bfloat16, bucket_bytes=bucket_bytes, to=to)
        exporter = WeightExporter(model, options)
        receiver = FullTensorReceiver(lambda tensors: None) if exporter.receiving else None
        report = exporter.export(receiver)
        reports.append({
            "buckets": report.buckets,
            "collectives": report.counts.collectives,
            "sent_bytes": report.counts.sent_bytes,
            "received_bytes": report.counts.received_bytes,
        })  # fmt: skip
    return reports


@pytest.mark.parametrize("layout", ["fsdp", "hsdp", "tp"])
def test_every_ranks_predicted_counts_are_its_export_report(layout: str) -> None:
    reported = run_on_ranks(4, _reported, layout=layout)
    with torch.device("meta"):
        model = Decoder()
    tp_dims = tp_dims_of(model, decoder_tp_plan("model.layers.*.")) if layout == "tp" else None
    tensors = export_tensors(model, tp_dims)
    shape = {"fsdp": {}, "hsdp": {"replicas": 2}, "tp": {"tp_degree": 2}}[layout]
    for i, (to, bucket_bytes) in enumerate(_CONFIGS):
        spec = ExportSpec(
            world_size=4, dtype=torch.bfloat16, bucket_bytes=bucket_bytes, to=to, backend="gloo",
            **shape,
        )  # fmt: skip
        cost = export_cost(tensors, spec)
        predicted = [
            {"buckets": cost.buckets, "collectives": r.collectives, "sent_bytes": r.sent_bytes,
             "received_bytes": r.received_bytes}
            for r in cost.ranks
        ]  # fmt: skip
        assert predicted == [rank[i] for rank in reported], (layout, to, bucket_bytes)
    # The comparison sees traffic: in every export some rank sends.
    assert all(any(rank[i]["sent_bytes"] for rank in reported) for i in range(len(_CONFIGS)))
