"""The weight exporter at W=2 and W=4 on gloo: bit-identical to ``full_tensor().to(dtype)``,
full and delta, on shardkit's and torch's ``fully_shard``, HSDP and FSDP x TP."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harness.pool import run_on_ranks
from tests.core.export.export_models import (
    Decoder,
    bf16_oracle,
    full_state,
    fully_shard_of,
    parallelize_decoder,
    perturb,
    sharded,
    train_step,
)


def _exports(rank: int, world_size: int, impl: str, syncs: int, delta: bool, to: str) -> Any:
    from shardkit.core.export import ModuleReceiver
    from shardkit.core.export.exporter import ExportOptions, WeightExporter

    model = sharded(impl)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    exporter = WeightExporter(
        model,
        ExportOptions(dtype=torch.bfloat16, bucket_bytes=3000, to=to),  # type: ignore[arg-type]
    )
    receiver_model = Decoder().to(torch.bfloat16)
    receiver = ModuleReceiver(receiver_model)
    mismatches: list[str] = []
    reports = []
    for sync in range(syncs):
        train_step(model, optimizer, sync, rank)
        report = exporter.export(receiver if exporter.receiving else None, delta=delta)
        reports.append((report.kind, report.counts.collectives, report.counts.sent_bytes))
        oracle = full_state(model, torch.bfloat16)
        if exporter.receiving:
            held = receiver_model.state_dict()
            for name, tensor in oracle.items():
                if not torch.equal(held[name], tensor):
                    mismatches.append(f"sync {sync}: {name}")
    return {
        "receiving": exporter.receiving,
        "mismatches": mismatches,
        "reports": reports,
        "buckets": len(exporter.buckets),
    }


@pytest.mark.parametrize("impl", ["shardkit", "torch"])
@pytest.mark.parametrize("delta", [False, True])
def test_every_sync_equals_full_tensor_in_the_export_dtype(impl: str, delta: bool) -> None:
    results = run_on_ranks(2, _exports, impl=impl, syncs=10, delta=delta, to="first")
    assert [r["receiving"] for r in results] == [True, False]
    assert results[0]["mismatches"] == []
    kinds = [k for k, _, _ in results[0]["reports"]]
    assert kinds == (["full"] + ["delta"] * 9 if delta else ["full"] * 10)
    buckets = results[0]["buckets"]
    assert buckets > 2
    full_collectives = results[0]["reports"][0][1]
    assert full_collectives == buckets + 2  # one per bucket, the agreement and the end


def _mesh_exports(
    rank: int, world_size: int, layout: str, impl: str, keep_tp: bool, delta: bool, to: str
) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    from shardkit.core.export import FullTensorReceiver
    from shardkit.core.export.exporter import ExportOptions, WeightExporter

    fully_shard = fully_shard_of(impl)
    torch.manual_seed(0)
    model: Any = Decoder()
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        dp = mesh
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp = mesh["dp"]
        parallelize_decoder(model, mesh["tp"])
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    options = ExportOptions(
        dtype=torch.bfloat16,
        bucket_bytes=2500,
        to="all" if to == "all" else "first",
        keep_axes=("tp",) if keep_tp else (),
    )
    exporter = WeightExporter(model, options)
    mirror = FullTensorReceiver(lambda tensors: None)
    mismatches: list[str] = []
    for sync in range(3):
        perturb(model, sync)
        report = exporter.export(mirror if exporter.receiving else None, delta=delta)
        oracle = bf16_oracle(model, keep_tp)
        if exporter.receiving:
            for name, tensor in oracle.items():
                held = mirror.mirror.get(name)
                if held is None or not torch.equal(held, tensor):
                    mismatches.append(f"sync {sync}: {name}")
    return {
        "receiving": exporter.receiving,
        "mismatches": mismatches,
        "collectives": report.counts.collectives,
        "buckets": len(exporter.buckets),
        "sent": report.counts.sent_bytes,
    }


@pytest.mark.parametrize(
    ("layout", "impl", "keep_tp", "delta", "to", "receivers"),
    [
        ("hsdp", "shardkit", False, True, "first", [0]),
        ("hsdp", "torch", False, False, "all", [0, 1, 2, 3]),
        ("tp", "shardkit", True, True, "first", [0, 1]),
        ("tp", "torch", True, False, "first", [0, 1]),
        ("tp", "shardkit", False, False, "first", [0]),
        ("tp", "torch", False, False, "all", [0, 1, 2, 3]),
    ],
)
def test_meshes_export_full_tensors_or_tp_parts(
    layout: str, impl: str, keep_tp: bool, delta: bool, to: str, receivers: list[int]
) -> None:
    results = run_on_ranks(
        4, _mesh_exports, layout=layout, impl=impl, keep_tp=keep_tp, delta=delta, to=to
    )
    assert [r for r in range(4) if results[r]["receiving"]] == receivers
    assert [r["mismatches"] for r in results] == [[]] * 4


def _both_engines(rank: int, world_size: int) -> Any:
    from shardkit.core.export import ExportOptions, ModuleReceiver, WeightExporter, export_weights

    held = {}
    for impl in ("torch", "shardkit"):
        model = sharded(impl)
        perturb(model, 0)
        exporter = WeightExporter(model, ExportOptions(dtype=torch.bfloat16, bucket_bytes=3000))
        target = Decoder().to(torch.bfloat16)
        exporter.export(ModuleReceiver(target) if exporter.receiving else None)
        perturb(model, 1)
        exporter.export(ModuleReceiver(target) if exporter.receiving else None, delta=True)
        held[impl] = target.state_dict()
        # The one-shot form gives the same.
        again = Decoder().to(torch.bfloat16)
        export_weights(model, ModuleReceiver(again) if rank == 0 else None, dtype=torch.bfloat16)
        if rank == 0:
            assert all(torch.equal(again.state_dict()[k], v) for k, v in held[impl].items())
    if rank != 0:
        return None
    return [k for k, v in held["torch"].items() if not torch.equal(v, held["shardkit"][k])]


def test_torch_and_shardkit_sharded_programs_export_the_same_bits() -> None:
    """The same program sharded by torch's ``fully_shard`` and by shardkit's: the receivers
    end up holding the same bits."""
    assert run_on_ranks(2, _both_engines)[0] == []
