"""What an export sends and how it groups it, in one process (no process group): names,
renames, tied weights, buffers, and buckets of whole layers."""

from __future__ import annotations

import pytest
import torch

from shardkit.core.export import ExportOptions, ModuleReceiver, WeightExporter
from tests.core.export.export_models import Decoder


def test_names_are_the_state_dicts_tied_once_and_persistent_buffers_only() -> None:
    exporter = WeightExporter(Decoder(), ExportOptions(bucket_bytes=1))
    names = [t.name for t in exporter.manifest("full", 0).tensors]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert "model.position_scale" in names and "model.rotary" not in names
    tied = WeightExporter(Decoder(), ExportOptions(include_tied=True)).manifest("full", 0)
    assert "lm_head.weight" in [t.name for t in tied.tensors]


def test_a_layer_is_never_split_across_buckets() -> None:
    exporter = WeightExporter(Decoder(), ExportOptions(bucket_bytes=1))  # every layer alone
    manifest = exporter.manifest("full", 0)
    bucket_of = {t.name: t.bucket for t in manifest.tensors}
    layer0 = [n for n in bucket_of if n.startswith("model.layers.0.")]
    assert len({bucket_of[n] for n in layer0}) == 1 and len(layer0) == 12
    roomy = ExportOptions(bucket_bytes=2**30, min_buckets=1)
    assert WeightExporter(Decoder(), roomy).manifest("full", 0).bucket_count == 1
    # By default a model smaller than min_buckets (4) buckets of bucket_bytes is still cut
    # into about that many, each of whole layers and at most a quarter of the export.
    exporter = WeightExporter(Decoder(), ExportOptions(bucket_bytes=2**30))
    quarter = -(-sum(b.nbytes for b in exporter.buckets) // 4)
    sizes = [b.nbytes for b in exporter.buckets]
    largest_layer = max(
        sum(s.nbytes for s in b.sources if s.name.startswith("model.layers.0."))
        for b in exporter.buckets
    )
    assert len(sizes) >= 4 and all(n <= max(quarter, largest_layer) for n in sizes), sizes
    with pytest.raises(ValueError, match="min_buckets must be positive"):
        ExportOptions(min_buckets=0)


def test_rename_maps_and_drops_and_refuses_collisions() -> None:
    def rename(name: str) -> str | None:
        if name.endswith(".bias"):
            return None
        return name.replace("model.layers.", "layers.")

    exporter = WeightExporter(Decoder(), ExportOptions(rename=rename, dtype=torch.bfloat16))
    names = [t.name for t in exporter.manifest("full", 0).tensors]
    assert "layers.1.mlp.up_proj.weight" in names and not any(n.endswith(".bias") for n in names)
    with pytest.raises(ValueError, match="export names collide"):
        WeightExporter(Decoder(), ExportOptions(rename=lambda name: "same"))


def test_an_unsharded_model_exports_in_its_own_process() -> None:
    source, target = Decoder(), Decoder(vocab=61).to(torch.bfloat16)
    torch.nn.init.normal_(source.model.norm.weight)
    report = WeightExporter(source, ExportOptions(dtype=torch.bfloat16)).export(
        ModuleReceiver(target)
    )
    assert report.counts.collectives == 0 and report.receiving
    for name, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], value.to(torch.bfloat16)), name


def test_a_receiver_that_does_not_fit_refuses_before_writing() -> None:
    from shardkit.core.errors import WeightLoadError

    target = Decoder(dim=24).to(torch.bfloat16)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    exporter = WeightExporter(Decoder(dim=32), ExportOptions(dtype=torch.bfloat16))
    with pytest.raises(WeightLoadError, match="nothing was written"):
        exporter.export(ModuleReceiver(target))
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
