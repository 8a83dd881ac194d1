"""``fully_shard(..., dp_mesh_dims=...)``: parameters given as DTensors on the whole SPMD mesh
train as with torch's ``fully_shard`` in the same mode and as in one process; checkpoints
interchange with torch's; user errors are torch's."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from harness.pool import run_on_ranks
from shardkit.core import MixedPrecisionPolicy
from tests.core.parity import assert_parity
from tests.core.torch_releases import INSTALLED, torch_has
from tests.tp.spmd_parity import (
    SpmdRun,
    full_state_dict_body,
    load_body,
    parity_body,
    save_body,
)

# torch's fully_shard takes dp_mesh_dims from 2.12 on; on an older torch shardkit is checked
# against one process only, and what compares with torch's is skipped.
TORCHS = torch_has("fully_shard.dp_mesh_dims")
needs_torchs = pytest.mark.skipif(
    not TORCHS, reason=f"torch {torch.__version__} has no dp_mesh_dims (2.12 added it)"
)

LAYOUTS: dict[str, SpmdRun] = {
    # FSDP on "dp", TP on "tp": dp shards the TP-local rows (strided), uneven
    "shard 2x2": SpmdRun(),
    # DDP-style: every rank holds its whole TP part, gradients all-reduced over "dp"
    "replicate 2x2": SpmdRun(shard=None, replicate="dp"),
    # HSDP x TP, with torch's DataParallelMeshDims passed to shardkit
    "hsdp 1x2x2": SpmdRun(
        mesh=(1, 2, 2),
        names=("dp_replicate", "dp_shard", "tp"),
        shard="dp_shard",
        replicate="dp_replicate",
        torch_dims=True,
    ),
    # two shard axes flattened into one of 4 ranks
    "shard dp x cp 2x2x1": SpmdRun(mesh=(2, 2, 1), names=("dp", "cp", "tp"), shard=("dp", "cp")),
    # HSDP with its shard axes flattened: the (replicate, dp_shard_cp) mesh. torchtitan leaves
    # an axis of one rank out of its mesh; this one keeps dp_shard to flatten two axes, and
    # leaves tp out (with four axes DTensor's sharding propagation takes 20 s of the run; a
    # trailing tp axis is "shard dp x cp 2x2x1" and "hsdp 1x2x2").
    "hsdp flattened 2x1x2": SpmdRun(
        mesh=(2, 1, 2),
        names=("dp_replicate", "dp_shard", "cp"),
        shard=("dp_shard", "cp"),
        replicate="dp_replicate",
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_training_matches_torch_and_one_process(layout: str) -> None:
    run = LAYOUTS[layout]
    if not TORCHS:
        run = dataclasses.replace(run, impls=("shardkit", "local"), torch_dims=False)
    traces = run_on_ranks(4, parity_body, run=run)
    assert_parity(traces)
    # The same sharded parameters as torch's: mesh axes and placements (strided ones too).
    # Torch 2.12, the first with dp_mesh_dims, left a parameter sharded on several axes on the
    # whole mesh (one Shard per axis); from 2.13 torch flattens those axes into one, as
    # shardkit does on every release.
    several = not isinstance(run.shard, str) and run.shard is not None
    if TORCHS and not (several and INSTALLED < (2, 13)):
        assert traces[0]["shardkit"]["layout"] == traces[0]["torch"]["layout"]


def _torchs_replicate_takes_dp_mesh_dims() -> bool:
    from torch.distributed._composable.replicate_with_fsdp import replicate

    return "dp_mesh_dims" in inspect.signature(replicate).parameters


def test_replicate_with_dp_mesh_dims_matches_torchs_replicate_and_one_process() -> None:
    # replicate on the whole SPMD mesh: each rank its whole TP part, all-reduced over "dp".
    run = SpmdRun(shard=None, replicate="dp", api="replicate")
    if not _torchs_replicate_takes_dp_mesh_dims():
        run = dataclasses.replace(run, impls=("shardkit", "local"))
    traces = run_on_ranks(4, parity_body, run=run)
    assert_parity(traces)
    if "torch" in run.impls:
        engines = [{k: v for k, v in t.items() if k != "local"} for t in traces]
        assert_parity(engines, rtol=0, atol=0)  # against torch's replicate: bit for bit
        assert traces[0]["shardkit"]["layout"] == traces[0]["torch"]["layout"]


@needs_torchs
def test_bf16_mixed_precision_matches_torch() -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    run = SpmdRun(shard_kwargs={"mp_policy": policy}, impls=("shardkit", "torch"))
    assert_parity(run_on_ranks(4, parity_body, run=run), rtol=0, atol=0)


def test_full_state_dicts_are_the_single_models() -> None:
    runs = [LAYOUTS[name] for name in ("shard 2x2", "replicate 2x2", "hsdp flattened 2x1x2")]
    assert run_on_ranks(4, full_state_dict_body, runs=runs)[0] == [True, True, True]


CHECKPOINTED = LAYOUTS["shard 2x2"]


# --- checkpoints ----------------------------------------------------------------------------


def _metadata(path: str) -> dict[str, Any]:
    """What DCP recorded for each key: global size, dtype and the chunks written."""
    out: dict[str, Any] = {}
    for key, meta in FileSystemReader(path).read_metadata().state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks)
            out[key] = (tuple(meta.size), meta.properties.dtype, chunks)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """One checkpoint of the 2x2 FSDP x TP layout per implementation, after 2 AdamW steps."""
    out: dict[str, dict[str, Any]] = {}
    for impl in ("shardkit", "torch"):
        path = str(tmp_path_factory.mktemp(f"spmd_{impl}"))
        result = run_on_ranks(4, save_body, impl=impl, run=CHECKPOINTED, path=path)[0]
        out[impl] = dict(result, path=path)
    return out


@needs_torchs
@pytest.mark.parametrize(("saver", "loader"), [("shardkit", "torch"), ("torch", "shardkit")])
def test_dcp_checkpoints_interchange_with_torch(
    saved: dict[str, dict[str, Any]], saver: str, loader: str
) -> None:
    written = saved[saver]
    result = run_on_ranks(4, load_body, impl=loader, run=CHECKPOINTED, path=written["path"])[0]
    for kind in ("model", "optim"):
        assert result[kind].keys() == written[kind].keys(), kind
        differs = [k for k, v in written[kind].items() if not result[kind][k].equal(v)]
        assert differs == [], f"{kind}: loaded values differ from the saved ones: {differs}"
    assert result["after"] == pytest.approx(written["after"], rel=1e-5)
    assert _metadata(saved["shardkit"]["path"]) == _metadata(saved["torch"]["path"])


@needs_torchs
def test_data_parallel_mesh_dims_reads_as_torchs() -> None:
    from torch.distributed.fsdp import DataParallelMeshDims as TorchDims

    from shardkit.core import DataParallelMeshDims

    given: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        (("dp",), {}),  # positional: shard
        ((), {"replicate": "dp"}),
        ((), {"shard": ("dp_shard", "cp"), "replicate": "dp_replicate"}),
        ((), {"shard": ["dp", "cp"]}),  # a list, as torch's takes
    ]
    for args, kwargs in given:
        ours, theirs = DataParallelMeshDims(*args, **kwargs), TorchDims(*args, **kwargs)
        assert (ours.shard_names, ours.replicate_names) == (
            theirs.shard_names,
            theirs.replicate_names,
        )
    with pytest.raises(TypeError, match="must be a mesh axis name"):
        DataParallelMeshDims(shard=0)  # type: ignore[arg-type]  # the mistake under test


# --- errors ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fake_world() -> Iterator[None]:
    """Four "ranks" in this process on the fake backend: both fully_shards can run here."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _linear(mesh: DeviceMesh, placements: tuple[Placement, ...]) -> nn.Linear:
    """A Linear(4, 4) whose parameters are DTensors on ``mesh``."""
    linear = nn.Linear(4, 4)
    for name, param in list(linear.named_parameters()):
        dtensor = distribute_tensor(param.detach(), mesh, list(placements))
        linear.register_parameter(name, nn.Parameter(dtensor))
    return linear


Case = tuple[nn.Module, dict[str, Any]]  # the module and fully_shard's keyword arguments


def _dp_tp() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _on_dp_tp(placements: tuple[Placement, ...], **kwargs: Any) -> Case:
    mesh = _dp_tp()
    return _linear(mesh, placements), dict(kwargs, mesh=mesh)


def _plain_parameters(dims: Any) -> Case:
    return nn.Linear(4, 4), {"mesh": _dp_tp(), "dp_mesh_dims": dims(shard="dp")}


def _no_axis_names(dims: Any) -> Case:
    mesh = init_device_mesh("cpu", (2, 2))
    return _linear(mesh, (Replicate(), Shard(0))), {"mesh": mesh, "dp_mesh_dims": dims(shard="dp")}


def _unknown_axis(dims: Any) -> Case:
    return _on_dp_tp((Replicate(), Shard(0)), dp_mesh_dims=dims(shard="x"))


def _no_axis(dims: Any) -> Case:
    return _on_dp_tp((Replicate(), Shard(0)), dp_mesh_dims=dims())


def _emptied(dims: Any) -> Case:
    from torch.distributed.fsdp import DataParallelMeshDims as TorchDims

    emptied = TorchDims(shard="dp")  # torch's instances can be changed after creation
    emptied.shard = None
    return _on_dp_tp((Replicate(), Shard(0)), dp_mesh_dims=emptied)


def _int_reshard(dims: Any) -> Case:
    kwargs = {"dp_mesh_dims": dims(shard="dp"), "reshard_after_forward": 2}
    return _on_dp_tp((Replicate(), Shard(0)), **kwargs)


def _sharded_on_dp(dims: Any) -> Case:
    return _on_dp_tp((Shard(0), Shard(0)), dp_mesh_dims=dims(shard="dp"))


def _sharded_on_replicate(dims: Any) -> Case:
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("r", "s", "tp"))
    module = _linear(mesh, (Shard(0), Replicate(), Replicate()))
    return module, {"mesh": mesh, "dp_mesh_dims": dims(shard="s", replicate="r")}


def _on_another_mesh(dims: Any) -> Case:
    mesh = _dp_tp()
    return _linear(mesh["tp"], (Shard(0),)), {"mesh": mesh, "dp_mesh_dims": dims(shard="dp")}


# (case, torch's exception type, torch's wording that ours must contain as well)
ERRORS: list[tuple[Callable[[Any], Case], type[BaseException], str]] = [
    (
        _plain_parameters,
        ValueError,
        "all parameters must be DTensors on the full SPMD mesh (e.g. via distribute_module). "
        "Got plain tensor for parameter 'weight'",
    ),
    (_no_axis_names, ValueError, "mesh must have mesh_dim_names when dp_mesh_dims is provided"),
    (_unknown_axis, ValueError, "Mesh dim name 'x' not found in mesh.mesh_dim_names ('dp', 'tp')"),
    (
        _no_axis,
        ValueError,
        "At least one of shard or replicate must be set in DataParallelMeshDims",
    ),
    (_emptied, ValueError, "At least one of shard or replicate must be set in dp_mesh_dims"),
    (
        _int_reshard,
        NotImplementedError,
        "reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims)",
    ),
    (
        _sharded_on_dp,
        ValueError,
        "Expected Replicate() on DP shard dim 'dp' (index 0) but got S(0)",
    ),
    (
        _sharded_on_replicate,
        ValueError,
        "Expected Replicate() on DP replicate dim 'r' (index 0) but got S(0)",
    ),
    (
        _on_another_mesh,
        ValueError,
        "Expected param's DTensor mesh to be the same mesh passed to fully_shard, but got "
        "different mesh objects",
    ),
]


def _torchs() -> list[tuple[Any, Any]]:
    """torch's fully_shard and DataParallelMeshDims, where torch has them (2.12 on)."""
    if not TORCHS:
        return []
    from torch.distributed.fsdp import DataParallelMeshDims as TorchDims
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    return [(torch_fully_shard, TorchDims)]


@pytest.mark.parametrize(("case", "kind", "wording"), ERRORS, ids=[c[0].__name__ for c in ERRORS])
def test_errors_are_torchs_and_change_nothing(
    fake_world: None, case: Callable[[Any], Case], kind: type, wording: str
) -> None:
    from shardkit.core import DataParallelMeshDims, FSDPModule, fully_shard

    if not TORCHS and case is _emptied:
        pytest.skip(f"torch {torch.__version__} has no DataParallelMeshDims (2.12 added it)")
    for fs, dims in [*_torchs(), (fully_shard, DataParallelMeshDims)]:
        module: nn.Module | None = None
        before: dict[str, nn.Parameter] = {}
        with pytest.raises(kind) as raised:
            module, kwargs = case(dims)
            before = dict(module.named_parameters())
            fs(module, **kwargs)
        assert wording in str(raised.value), (fs.__module__, str(raised.value))
        if fs is fully_shard and module is not None:
            assert not isinstance(module, FSDPModule)
            assert all(p is before[name] for name, p in module.named_parameters())


def test_an_all_reduce_hook_stream_is_refused_with_hsdp_only(fake_world: None) -> None:
    from shardkit.core import DataParallelMeshDims, fully_shard

    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("r", "s", "tp"))
    placements = (Replicate(), Replicate(), Shard(0))
    for fs, dims in [*_torchs(), (fully_shard, DataParallelMeshDims)]:
        replicated = fs(_linear(mesh, placements), mesh=mesh, dp_mesh_dims=dims(replicate="r"))
        stream: Any = object()  # a CUDA stream, as far as the check goes
        replicated.set_all_reduce_hook(lambda grad: None, stream=stream)  # as torch: accepted
        hsdp = fs(_linear(mesh, placements), mesh=mesh, dp_mesh_dims=dims(shard="s", replicate="r"))
        with pytest.raises(ValueError, match="stream cannot be set when using native HSDP"):
            hsdp.set_all_reduce_hook(lambda grad: None, stream=stream)
