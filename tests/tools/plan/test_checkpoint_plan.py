"""The planner's checkpoint prediction against real saves: at W=2 (FSDP) and W=4 (HSDP 2x2)
on gloo, shardkit's ``fully_shard`` model and AdamW after a step saved by the core's local
plan, then every rank's predicted data bytes, file bytes and items compared with what the
written ``.metadata`` and files hold; the time model's structure and the command's output."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from harness.pool import run_on_ranks
from shardkit.core import read_dcp_metadata
from shardkit.core.checkpoint.local_plan.chunk_writers import SaveLayout
from shardkit.tools.plan.checkpoint.cli import format_checkpoint_cost
from shardkit.tools.plan.checkpoint.cost import CheckpointCost, checkpoint_cost
from shardkit.tools.plan.checkpoint.meta_state import (
    CheckpointMesh,
    checkpoint_state,
    dcp_fallback_reason,
)
from shardkit.tools.plan.checkpoint.timing import SaveCosts
from shardkit.tools.plan.cli import main
from shardkit.tools.plan.tp_styles import tp_dims_of
from tests.tools.plan.decoder_tp import decoder_tp_plan

_COSTS = SaveCosts(
    per_value_s=1e-5, per_item_s=2e-5, per_position_s=1e-6, per_entry_s=1e-5, source="fixed"
)


def _model() -> nn.Sequential:
    # Uneven rows (13 over 2 shards: 7 and 6) and a 3-row norm (over 2: 2 and 1).
    return nn.Sequential(nn.Linear(8, 13), nn.ReLU(), nn.Linear(13, 3), nn.LayerNorm(3))


def _save(rank: int, world_size: int, root: str, mesh_shape: list[int]) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from shardkit.core import fully_shard
    from shardkit.core.checkpoint.local_plan.save import LayoutCache, save_planned_locally
    from shardkit.core.runtime.groups import checkpoint_group

    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=names)
    torch.manual_seed(0)
    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    save_planned_locally(state, Path(root), LayoutCache(), checkpoint_group())


def _save_tp(rank: int, world_size: int, root: str) -> str:
    """A decoder under FSDP x TP on a 2 x 2 mesh, saved: why it went through DCP's planning."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from shardkit.core import fully_shard
    from shardkit.core.checkpoint.local_plan.save import LayoutCache, save_planned_locally
    from shardkit.core.runtime.groups import checkpoint_group
    from tests.core.export.export_models import Decoder, train_step

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = Decoder()
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], decoder_tp_plan(""))
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, optimizer, 0, rank)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    cache = LayoutCache()
    save_planned_locally(state, Path(root), cache, checkpoint_group())
    return cache.dcp_reason


def _tp_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 13), nn.ReLU(), nn.Linear(13, 6))


def _tp_styles() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"0": ColwiseParallel(), "2": RowwiseParallel()}  # every parameter in the plan


def _save_tp_covered(rank: int, world_size: int, root: str) -> str:
    """A model the TP plan covers whole under FSDP x TP (2 x 2), AdamW's state, saved."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from shardkit.core import fully_shard
    from shardkit.core.checkpoint.local_plan.save import LayoutCache, save_planned_locally
    from shardkit.core.runtime.groups import checkpoint_group

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _tp_model()
    parallelize_module(model, mesh["tp"], _tp_styles())
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)  # the state after a step, without a forward
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    cache = LayoutCache()
    state = {"model": model_state, "optim": optim_state}
    save_planned_locally(state, Path(root), cache, checkpoint_group())
    return cache.dcp_reason


def _predicted(
    mesh: CheckpointMesh,
    model: nn.Module | None = None,
    tp_dims: dict[str, int | None] | None = None,
) -> tuple[CheckpointCost, SaveLayout]:
    if model is None:
        with torch.device("meta"):
            model = _model()
    values, mappings, plain_sizes = checkpoint_state(model, mesh, "adamw", tp_dims)
    layout = SaveLayout.from_values(values, mesh.world_size)
    return checkpoint_cost(layout, plain_sizes, _COSTS, 1.0, mappings), layout


def _written(root: Path, world: int) -> dict[str, list[int]]:
    """Per rank, from the real checkpoint: data bytes, items and its file's size."""
    metadata = read_dcp_metadata(root)
    data, items = [0] * world, [0] * world
    for index, info in metadata.storage_data.items():
        rank = int(info.relative_path.split("_")[2])
        items[rank] += 1
        entry = metadata.state_dict_metadata[index.fqn]
        if not isinstance(entry, TensorStorageMetadata):
            continue  # a plain value, pickled: no tensor data
        (chunk,) = [c for c in entry.chunks if c.offsets == index.offset]
        data[rank] += math.prod(chunk.sizes) * entry.properties.dtype.itemsize
    files = [os.path.getsize(root / f"__{rank}_0.distcp") for rank in range(world)]
    return {"data": data, "items": items, "files": files}


@pytest.mark.parametrize("mesh_shape", [[2], [2, 2]], ids=["fsdp-w2", "hsdp-2x2"])
def test_predicted_bytes_per_rank_are_a_real_saves(tmp_path: Path, mesh_shape: list[int]) -> None:
    world = math.prod(mesh_shape)
    run_on_ranks(world, _save, root=str(tmp_path), mesh_shape=mesh_shape)
    mesh = CheckpointMesh(*mesh_shape) if len(mesh_shape) == 2 else CheckpointMesh(1, world)
    cost, layout = _predicted(mesh)
    real = _written(tmp_path, world)
    assert cost.data_bytes == real["data"]
    assert cost.items == real["items"]
    assert cost.file_bytes == real["files"]
    assert cost.items == [len(layout.items_of(rank)) for rank in range(world)]
    metadata = read_dcp_metadata(tmp_path)
    assert cost.entries == len(metadata.storage_data)
    assert cost.values == len(metadata.state_dict_metadata)
    # Its pickle also holds the checkpoint's path and storage meta: within a few hundred bytes.
    assert abs(cost.metadata_bytes - (tmp_path / ".metadata").stat().st_size) < 400
    # The layout record the save wrote beside .metadata: its size predicted exactly.
    assert cost.record_bytes == (tmp_path / "layout.json").stat().st_size
    # Every byte of the model and its two moments written once, whichever rank writes it.
    params = list(_model().parameters())
    elements = sum(p.numel() for p in params)
    assert sum(cost.data_bytes) == 3 * 4 * elements + 4 * len(params)  # and a float32 step each


def test_a_loads_planning_is_counted_work_times_measured_unit_costs() -> None:
    """Per value, per overlap of a rank's shards with the saved items, per record byte."""
    from shardkit.tools.plan.checkpoint.load_cost import LoadCosts, most_overlaps

    costs = LoadCosts(
        per_record_byte_s=1e-8,
        per_value_s=1e-5,
        per_overlap_s=1e-6,
        source="x",
        per_position_s=1e-7,
    )
    with torch.device("meta"):
        model = _model()
    values, mappings, plain_sizes = checkpoint_state(model, CheckpointMesh(1, 2), "adamw")
    layout = SaveLayout.from_values(values, 2)
    cost = checkpoint_cost(layout, plain_sizes, _COSTS, 1.0, mappings, load_costs=costs)
    # At the same layout under FSDP a rank's shards overlap one saved item a value.
    assert most_overlaps(layout) == len(values)
    positions = sum(g.ranks.size for g in layout.geometries.values())
    expected = cost.record_bytes * 1e-8 + len(values) * 1e-5 + len(values) * 1e-6
    expected += positions * 1e-7
    assert cost.load_plan_s == pytest.approx(expected)
    assert "load planning per rank" in format_checkpoint_cost(cost)


def test_under_hsdp_a_values_split_costs_more_with_more_replicas() -> None:
    """The sharing rule and the split run over the R replicas: per split value, a + b R."""
    from shardkit.tools.plan.checkpoint.load_cost import LoadCosts, load_plan_terms
    from shardkit.tools.plan.checkpoint.timing import synthetic_values

    costs = LoadCosts(0.0, 0.0, 0.0, "x", per_split_value_s=1e-5, per_split_replica_s=1e-8)
    for world, replicas in ((512, 64), (4096, 512)):
        layout = SaveLayout.from_values(synthetic_values(world, replicas), world)
        split = sum(v.kind == "dtensor" for v in layout.values)
        terms = load_plan_terms(layout, 0, costs)
        assert terms["split"] == pytest.approx(split * (1e-5 + replicas * 1e-8))


def test_under_hsdp_a_rank_plans_the_items_it_wrote() -> None:
    """The replicas split their shard's saved items (``replica_pieces``): each, what it wrote."""
    from shardkit.tools.plan.checkpoint.load_cost import most_overlaps
    from tests.core.checkpoint.layouts import llama_8b_layout

    layout = SaveLayout.from_values(llama_8b_layout(256), 256)  # pieces: a shard meets several
    plain = sum(v.kind != "dtensor" for v in layout.values)
    chunked = {v.fqn for v in layout.values if v.kind == "dtensor"}
    wrote = [sum(i.index.fqn in chunked for i in layout.items_of(r)) for r in range(256)]
    assert most_overlaps(layout) == plain + max(wrote)
    # Every item its shard meets (one shard of 8: an eighth of each value's items), as a
    # rank planned before its replicas split the items: more than it now plans.
    met = sum(
        layout.cut_pieces(o).chunk.size // 8
        for o, v in enumerate(layout.values)
        if v.kind == "dtensor"
    )
    assert most_overlaps(layout) < plain + met


def test_fsdp_x_tp_with_parameters_outside_the_tp_plan_falls_back_as_predicted(
    tmp_path: Path,
) -> None:
    from tests.core.export.export_models import Decoder

    reasons = run_on_ranks(4, _save_tp, root=str(tmp_path))
    with torch.device("meta"):
        model = Decoder()
    tp_dims = tp_dims_of(model, decoder_tp_plan("model.layers.*."))
    predicted = dcp_fallback_reason(model, CheckpointMesh(1, 2, 2), tp_dims)
    assert predicted.startswith("model.model.embed_tokens.weight is not in the TP plan")
    # The core's save found the same parameter off the world's mesh, on every rank.
    assert len(set(reasons)) == 1 and "model.model.embed_tokens.weight" in reasons[0]
    assert dcp_fallback_reason(model, CheckpointMesh(2, 2)) == ""  # no TP: planned locally


def test_predicted_bytes_per_rank_are_a_real_saves_under_fsdp_x_tp(tmp_path: Path) -> None:
    reasons = run_on_ranks(4, _save_tp_covered, root=str(tmp_path))
    assert reasons == [""] * 4  # planned locally
    with torch.device("meta"):
        model = _tp_model()
    tp_dims = tp_dims_of(model, _tp_styles())
    mesh = CheckpointMesh(1, 2, 2)
    assert dcp_fallback_reason(model, mesh, tp_dims) == ""
    cost, _ = _predicted(mesh, model, tp_dims)
    real = _written(tmp_path, 4)
    assert cost.data_bytes == real["data"]
    assert (cost.items, cost.file_bytes) == (real["items"], real["files"])
    assert cost.entries == len(read_dcp_metadata(tmp_path).storage_data)


def test_time_model_grows_with_the_world_and_writes_at_the_bandwidth() -> None:
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(4)))
    costs = []
    for world in (8, 64, 512):
        values, mappings, sizes = checkpoint_state(model, CheckpointMesh(1, world))
        layout = SaveLayout.from_values(values, world)
        costs.append(checkpoint_cost(layout, sizes, _COSTS, 2.0, mappings))
    for small, large in itertools.pairwise(costs):
        # Each save: the same values, and fewer plain values a rank as the world grows.
        assert small.plan_s >= large.plan_s
        # The first save of a layout adds the geometries, which span the world.
        assert small.first_plan_s - small.plan_s < large.first_plan_s - large.plan_s
        assert small.entries < large.entries and small.rank0_metadata_s < large.rank0_metadata_s
        assert max(small.file_bytes) > max(large.file_bytes)
    for cost in costs:
        walk = cost.values * _COSTS.per_value_s + max(cost.items) * _COSTS.per_item_s
        assert cost.plan_s == pytest.approx(walk)
        assert cost.write_s == pytest.approx(max(cost.file_bytes) / (2.0 * 2**30))
        assert cost.rank0_metadata_s == pytest.approx(cost.entries * _COSTS.per_entry_s)
    told = format_checkpoint_cost(dataclasses.replace(costs[0], dcp_fallback="x is off-mesh"))
    assert "falls back to DCP's planning: x is off-mesh." in told
    assert "falls back" not in format_checkpoint_cost(costs[0])
    with pytest.raises(ValueError, match="disk-gib-s"):
        checkpoint_cost(layout, sizes, _COSTS, 0.0, mappings)
    with pytest.raises(ValueError, match="--optimizer lion"):
        checkpoint_state(model, CheckpointMesh(1, 8), "lion")


def test_shardkit_plan_prints_and_writes_the_checkpoint(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["shardkit.tools.examples:llama_8b", "--bandwidth-gbps", "100", "--checkpoint"]
    assert main([*argv, "--world-size", "16", "--mesh", "2,8", "--json"]) == 0
    data: dict[str, Any] = json.loads(capsys.readouterr().out)["checkpoint"]
    assert data["world_size"] == 16 and len(data["file_bytes"]) == 16
    assert data["data_bytes_spread"]["max"] == max(data["data_bytes"])
    assert data["write_s"] == pytest.approx(max(data["file_bytes"]) / 2**30)
    assert "measured now" in data["costs"]["source"] and "SPMD" in data["assumption"]
    assert main([*argv, "--world-size", "16", "--mesh", "2,8", "--disk-gib-s", "4"]) == 0
    text = capsys.readouterr().out
    assert "Checkpoint save (W=16):" in text and "write at 4 GiB/s a rank" in text
    told = dict(
        line.strip().rsplit(None, 1)
        for line in text.splitlines()
        if line.startswith("  .metadata entries") or line.startswith("  busiest rank")
    )
    assert told[".metadata entries"] == f"{data['entries']:,}"
    assert int(told["busiest rank"]) == data["file_bytes"].index(max(data["file_bytes"]))
    assert main([*argv, "--world-size", "16", "--optimizer", "sgd_momentum"]) == 2
    assert "--optimizer sgd_momentum: a checkpoint's state is known for" in capsys.readouterr().err
    assert main([*argv, "--world-size", "16", "--disk-gib-s", "-1"]) == 2
    assert "--disk-gib-s must be positive, got -1.0" in capsys.readouterr().err
