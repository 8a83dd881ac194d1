"""The sharding extension point: the engine goes through it, DTensor parameters need one, and
installed extensions are found through their entry point."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

from harness.pool import run_on_ranks
from shardkit.core.extensions import (
    DataParallelSharding,
    ShardingExtension,
    register_extension,
)
from tests.core import models
from tests.core.api.extension_support import (
    RecordingSharding,
    ReplicatedDTensorSharding,
    SpmdReplicatedSharding,
)


def _train(model: Any, rank: int, world_size: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for step in range(3):
        x, y = models.batch("mlp", step, 2 * world_size)
        loss = models.loss_of("mlp", model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _mlp(mesh: Any, *, replicate_as_dtensors: bool) -> Any:
    torch.manual_seed(0)
    model = models.MLPNet()
    if replicate_as_dtensors:
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None:
                    dt = distribute_tensor(param.detach(), mesh, [Replicate()])
                    module._parameters[name] = nn.Parameter(dt)
    return model


def _sharded(mesh: Any, *, replicate_as_dtensors: bool) -> Any:
    from shardkit.core import fully_shard

    model = _mlp(mesh, replicate_as_dtensors=replicate_as_dtensors)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _recording_body(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    plain = _train(_sharded(mesh, replicate_as_dtensors=False), rank, world_size)
    recording = RecordingSharding()
    unregister = register_extension(recording)
    try:
        model = _sharded(mesh, replicate_as_dtensors=False)
        losses = _train(model, rank, world_size)
        full = {k: torch.zeros(v.shape) for k, v in model.state_dict().items()}
        model.load_state_dict(full)
        zeroed = all(float(v.to_local().abs().sum()) == 0 for v in model.state_dict().values())
    finally:
        unregister()
    return {"plain": plain, "ours": losses, "calls": dict(recording.calls), "zeroed": zeroed}


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_engine_shards_through_the_extension(world_size: int) -> None:
    result = run_on_ranks(world_size, _recording_body)[0]
    assert result["ours"] == result["plain"]
    params = 2 + 6 * 3 + 2 + 2  # inp, three blocks, norm, head
    calls = result["calls"]
    assert calls["param_spec"] == calls["make_sharded"] == params
    assert calls["make_unsharded"] == params  # once each, at the first unshard
    assert calls["chunk_full"] == params  # load_state_dict of plain full tensors
    assert calls["grad_local"] == 3 * params  # each gradient, each of the 3 steps
    assert result["zeroed"]


def _dtensor_params_body(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    reference = _train(_sharded(mesh, replicate_as_dtensors=False), rank, world_size)
    from shardkit.core import FSDPModule, fully_shard

    model = _mlp(mesh, replicate_as_dtensors=True)
    before = list(model.parameters())
    with pytest.raises(ValueError) as refused:
        fully_shard(model.blocks[0], mesh=mesh)
    assert not isinstance(model.blocks[0], FSDPModule)
    assert all(a is b for a, b in zip(model.parameters(), before, strict=True))
    unregister = register_extension(ReplicatedDTensorSharding())
    try:
        model = _sharded(mesh, replicate_as_dtensors=True)
        losses = _train(model, rank, world_size)
        placements = {str(p.placements) for p in model.parameters()}
    finally:
        unregister()
    return {
        "error": str(refused.value),
        "reference": reference,
        "losses": losses,
        "placements": placements,
    }


def test_dtensor_parameters_need_an_extension_and_train_through_one() -> None:
    result = run_on_ranks(2, _dtensor_params_body)[0]
    # shardkit-tp is installed here, and refuses a DTensor on the dp mesh itself; without
    # it, the core's own message says to install it (below).
    assert "norm.weight" in result["error"]
    assert result["losses"] == result["reference"]
    assert result["placements"] == {"(Shard(dim=0),)"}


def _spmd_mesh_body(rank: int, world_size: int) -> dict[str, Any]:
    from shardkit.core import DataParallelMeshDims, fully_shard

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    out: dict[str, Any] = {
        "reference": _train(_sharded(mesh, replicate_as_dtensors=False), rank, world_size)
    }
    unregister = register_extension(ReplicatedDTensorSharding())  # no spmd_param_spec
    try:
        with pytest.raises(ValueError) as refused:
            fully_shard(
                _mlp(mesh, replicate_as_dtensors=True),
                mesh=mesh,
                dp_mesh_dims=DataParallelMeshDims(shard="dp"),
            )
        out["refused"] = str(refused.value)
    finally:
        unregister()
    for mode in ("shard", "replicate"):
        dims = DataParallelMeshDims(**{mode: "dp"})
        extension = SpmdReplicatedSharding()
        unregister = register_extension(extension)
        try:
            model = _mlp(mesh, replicate_as_dtensors=True)
            for block in model.blocks:
                fully_shard(block, mesh=mesh, dp_mesh_dims=dims)
            fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
            out[mode] = _train(model, rank, world_size)
            out[f"{mode} placements"] = {str(p.placements) for p in model.parameters()}
            axes = extension.axes[0]
            out[f"{mode} axes"] = (
                axes.shard,
                axes.replicate,
                axes.mesh is mesh,
                axes.dp_mesh.shape,
            )
        finally:
            unregister()
    return out


def test_parameters_on_the_whole_mesh_go_through_the_spmd_seam() -> None:
    result = run_on_ranks(2, _spmd_mesh_body)[0]
    assert "does not support dp_mesh_dims" in result["refused"]
    # Sharded or replicated over "dp", training is plain FSDP's (sums of 2 are exact).
    assert result["shard"] == pytest.approx(result["reference"], rel=1e-6)
    assert result["replicate"] == pytest.approx(result["reference"], rel=1e-6)
    assert result["shard placements"] == {"(Shard(dim=0),)"}
    assert result["replicate placements"] == {"(Replicate(),)"}
    assert result["shard axes"] == (("dp",), (), True, (2,))
    assert result["replicate axes"] == ((), ("dp",), True, (2,))


def test_register_refuses_what_is_not_an_extension() -> None:
    with pytest.raises(TypeError, match="object does not implement"):
        register_extension(object())  # type: ignore[arg-type]
    assert isinstance(DataParallelSharding(), ShardingExtension)


# Run before shardkit.core is imported: the process then sees no installed shardkit-tp.
_WITHOUT_SHARDKIT_TP = """
import importlib.metadata as md
_entry_points = md.entry_points
def _without_tp(**selection):
    found = _entry_points(**selection)
    if not selection:  # every group (triton asks so, in torch's CUDA builds)
        return found
    return md.EntryPoints(e for e in found if e.dist is None or e.dist.name != "shardkit-tp")
md.entry_points = _without_tp
"""


def _run_python(script: str, extra_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    root = Path(__file__).resolve().parents[3]
    path = f"{extra_path}:{root}" if extra_path is not None else str(root)
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT_SHARDKIT_TP + textwrap.dedent(script)],
        env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_without_shardkit_tp_a_dtensor_parameter_says_to_install_it() -> None:
    script = """
        import pytest, torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, distribute_tensor
        from shardkit.core import fully_shard
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        model = torch.nn.Linear(2, 2)
        weight = distribute_tensor(model.weight.detach(), mesh, [Replicate()])
        model.weight = torch.nn.Parameter(weight)
        with pytest.raises(ValueError) as refused:
            fully_shard(model, mesh=init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)))
        print(refused.value)
        """
    out = _run_python(script)
    assert out.returncode == 0, out.stderr
    assert "parameter weight is already a DTensor" in out.stdout
    assert "install shardkit-tp" in out.stdout


def test_installed_extensions_are_found_by_entry_point(tmp_path: Path) -> None:
    # A distribution's metadata on sys.path is what an installed package leaves behind.
    dist_info = tmp_path / "fake_sharding-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fake-sharding\nVersion: 1.0\n"
    )
    (dist_info / "entry_points.txt").write_text(
        "[shardkit.core.extensions]\n"
        "replicated = tests.core.api.extension_support:ReplicatedDTensorSharding\n"
    )
    script = """
        from shardkit.core.extensions import extension_for, registered_extensions
        from tests.core.api.extension_support import ReplicatedDTensorSharding
        import torch
        found = registered_extensions()
        assert [type(e) for e in found] == [ReplicatedDTensorSharding], found
        plain = torch.nn.Parameter(torch.ones(2))
        assert type(extension_for(plain, "w")).__name__ == "DataParallelSharding"
        print("ok")
        """
    out = _run_python(script, extra_path=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
