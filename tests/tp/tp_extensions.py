"""The differential oracle for DTensorExtensions: torch's FSDP1 extensions and ours, same inputs.

Bodies run on 4 gloo ranks. The inputs are plain tensors of 3 and 5 rows (uneven across 2 dp
ranks) and every parameter of the TP test models after their TP plans. DTensors and
ShardedTensors do not cross processes, so each result comes back described as plain values
(``describe``): type, mesh and placements, shard metadata, local values.

torch's extensions mishandle two kinds of input, so the differential bodies leave them out and
the tests check ours alone on them: a TP part cut unevenly (torch builds overlapping shard
metadata, and its chunk_dtensor puts the ranks' collectives out of step), and chunk_tensor of
a DTensor on ranks outside the first TP group (torch names shards by TP-group rank where
ShardedTensor wants global ranks).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.fsdp  # first: torch's tensor.parallel.fsdp imports it back
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel.fsdp import DTensorExtensions as TorchExtensions

from shardkit.tp import DTensorExtensions
from tests.tp import tp_models
from tests.tp.tp_parity import TPRun, build_sharded, dp_mesh_of, global_mesh

Description = dict[str, Any]
Results = dict[str, dict[str, Any]]  # input name -> what each implementation gave, and more

MESHES = ((2, 2), (2, 1, 2))  # (dp, tp) and HSDP x TP: (dp_replicate, dp_shard, tp)


def extensions() -> dict[str, Any]:
    """Torch's extensions (CPU "device handle") and ours, by implementation name."""
    return {"torch": TorchExtensions(torch.cpu), "shardkit": DTensorExtensions()}


def inputs(mesh: DeviceMesh) -> dict[str, torch.Tensor]:
    """Plain tensors, and every parameter of the TP test models on ``mesh``'s "tp" axis."""
    torch.manual_seed(0)
    values = {"rows3": torch.randn(3, 4), "rows5": torch.randn(5, 2, 3), "bias5": torch.randn(5)}
    for name in ("mlp", "sp"):
        model = tp_models.build(name)
        tp_models.parallelize(name, model, mesh["tp"])
        values.update({f"{name}.{fqn}": p for fqn, p in model.named_parameters()})
    return values


def tp_uneven(value: torch.Tensor) -> bool:
    """Whether TP cut one of ``value``'s dims into parts of different sizes."""
    if not isinstance(value, DTensor):
        return False
    mesh = value.device_mesh
    return any(
        isinstance(p, Shard) and value.size(p.dim) % mesh.size(axis) != 0
        for axis, p in enumerate(value.placements)
    )


def describe(value: object) -> Description:
    """``value`` as plain values: everything the differential tests compare."""
    if isinstance(value, ShardedTensor):
        metadata = value.metadata()
        properties = metadata.tensor_properties
        return {
            "type": "ShardedTensor",
            "size": tuple(metadata.size),
            "properties": (properties.dtype, properties.requires_grad, properties.pin_memory),
            "shards": [box(m) for m in metadata.shards_metadata],
            "local": [(box(s.metadata), describe(s.tensor)) for s in value.local_shards()],
            "group": dist.get_process_group_ranks(value._process_group),
        }
    if isinstance(value, DTensor):
        return {
            "type": "DTensor",
            **describe_layout(value.device_mesh, value.placements, value.shape, value.stride()),
            "requires_grad": value.requires_grad,
            "local": describe(value.to_local()),
        }
    if isinstance(value, torch.Tensor):
        return {
            "type": type(value).__name__,
            "value": value.detach().clone(),
            "requires_grad": value.requires_grad,
        }
    raise TypeError(f"nothing to describe in a {type(value).__name__}")


def describe_layout(
    mesh: DeviceMesh, placements: Any, shape: torch.Size, stride: tuple[int, ...]
) -> Description:
    """A DTensor's mesh, placements, global shape and strides."""
    return {
        "mesh": (mesh.mesh.tolist(), mesh.mesh_dim_names),
        "placements": tuple(repr(p) for p in placements),
        "shape": tuple(shape),
        "stride": tuple(stride),
    }


def box(metadata: ShardMetadata) -> tuple[list[int], list[int], str]:
    """A shard's offsets, sizes and placement ("rank:R/device")."""
    return metadata.shard_offsets, metadata.shard_sizes, str(metadata.placement)


def attempt(fn: Any, *args: object) -> Any:
    """``fn(*args)``, or the error it raised as {"error": name, "message": text}."""
    try:
        return fn(*args)
    except Exception as error:  # the test decides which errors are expected
        return {"error": type(error).__name__, "message": str(error)}


def local_part(value: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``value``: a DTensor's or ShardedTensor's local tensor, else all."""
    if isinstance(value, ShardedTensor):
        return value.local_tensor()
    return value.to_local() if isinstance(value, DTensor) else value


# -- pre_flatten_transform / post_unflatten_transform ------------------------------------------


class _AsyncGrad(torch.autograd.Function):
    """Identity whose gradient comes back as a pending functional collective's result."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return AsyncCollectiveTensor(grad.clone())


def _flatten_round_trip(ext: Any, value: torch.Tensor) -> Description:
    local, metadata = ext.pre_flatten_transform(value)
    out: Description = {"local": describe(local), "metadata": metadata is not None}
    if metadata is None:
        out["same object"] = local is value
        return out
    out["layout"] = describe_layout(
        metadata.mesh, metadata.placements, metadata.shape, metadata.stride
    )
    assert isinstance(value, DTensor)
    out["shares storage"] = local.data_ptr() == value.to_local().data_ptr()
    rebuilt = ext.post_unflatten_transform(local, metadata)
    out["rebuilt"] = describe(rebuilt)
    out["no copy"] = rebuilt.to_local().data_ptr() == local.data_ptr()
    through: torch.Tensor = _AsyncGrad.apply(rebuilt.to_local())  # type: ignore[no-untyped-call]  # Function.apply is unannotated
    through.sum().backward()
    out["grad type"] = type(local.grad).__name__  # waited for by the unflatten hook
    return out


def flatten_body(rank: int, world_size: int) -> Results:
    """Flatten then unflatten every input by both; the input described, to compare with."""
    mesh = global_mesh(TPRun(mesh=(2, 2)))
    results: Results = {}
    for name, value in inputs(mesh).items():
        results[name] = {"input": describe(value)}
        for impl, ext in extensions().items():
            results[name][impl] = _flatten_round_trip(ext, value)
    return results


# -- chunk_tensor / pre_load_state_dict_transform ----------------------------------------------


def _chunk_args(dp: DeviceMesh) -> tuple[int, int, int, dist.ProcessGroup]:
    """FSDP1's arguments to chunk_tensor: dp rank and size, devices per node, dp group."""
    return dp.get_local_rank(), dp.size(), 0, dp.get_group()


def _chunk_and_unwrap(ext: Any, value: torch.Tensor, dp: DeviceMesh) -> Any:
    """chunk_tensor, then pre_load_state_dict_transform of its result (no communication)."""
    chunked = attempt(ext.chunk_tensor, value, *_chunk_args(dp))
    if not isinstance(chunked, ShardedTensor):
        return chunked
    loaded, shards = ext.pre_load_state_dict_transform(chunked)
    return {
        "chunked": describe(chunked),
        "loaded": describe(loaded),
        "shards": [(box(s.metadata), describe(s.tensor)) for s in shards],
    }


def _load_back(value: torch.Tensor, dp: DeviceMesh) -> torch.Tensor:
    """Ours: chunk_tensor, unwrap, and what FSDP1's load does next: gather the dp shards."""
    ext = DTensorExtensions()
    _, shards = ext.pre_load_state_dict_transform(ext.chunk_tensor(value, *_chunk_args(dp)))
    gathered: list[torch.Tensor | None] = [None] * dp.size()
    dist.all_gather_object(gathered, shards[0].tensor if shards else None, group=dp.get_group())
    return torch.cat([t for t in gathered if t is not None])


def _tp_sharded_input(mesh: DeviceMesh) -> torch.Tensor:
    """A ShardedTensor over TP, 5 rows cut 3 + 2 (torch's FSDP1 chunking builds it)."""
    torch.manual_seed(1)
    full = torch.randn(5, 4)
    tp = mesh["tp"]
    chunked = TorchExtensions(torch.cpu).chunk_tensor(
        full, tp.get_local_rank(), tp.size(), 0, tp.get_group()
    )
    assert isinstance(chunked, ShardedTensor)
    return chunked


def chunk_tensor_body(rank: int, world_size: int, uneven: bool) -> Results:
    """chunk_tensor then pre_load_state_dict_transform by both, on the even (or uneven) inputs.

    Each result has the input's local part ("expected"), what ours loads back of it
    ("restored") and, for a DTensor, where that part lies in the whole tensor ("part box", by
    DTensor's own arithmetic). Torch's may fail on some ranks, so only ours gathers.
    """
    mesh = global_mesh(TPRun(mesh=(2, 2)))
    values = {n: v for n, v in inputs(mesh).items() if tp_uneven(v) == uneven}
    if not uneven:
        values["sharded"] = _tp_sharded_input(mesh)
    results: Results = {}
    for name, value in values.items():
        results[name] = {"expected": local_part(value).detach().clone()}
        if isinstance(value, DTensor):
            sizes, offsets = compute_local_shape_and_global_offset(
                value.shape, value.device_mesh, value.placements
            )
            results[name]["part box"] = (list(offsets), list(sizes))  # as ShardMetadata has them
        for impl, ext in extensions().items():
            results[name][impl] = _chunk_and_unwrap(ext, value, mesh["dp"])
        results[name]["restored"] = _load_back(value, mesh["dp"])
    return results


# -- chunk_dtensor / all_gather_dtensor --------------------------------------------------------


def _place_and_gather(ext: Any, value: torch.Tensor, mesh: DeviceMesh) -> Description:
    placed = ext.chunk_dtensor(value, 0, dp_mesh_of(mesh))
    return {"placed": describe(placed), "gathered": describe(ext.all_gather_dtensor(placed, mesh))}


def chunk_dtensor_body(rank: int, world_size: int) -> dict[tuple[int, ...], Results]:
    """chunk_dtensor then all_gather_dtensor by both, on a 2D and a 3D mesh (even inputs)."""
    results: dict[tuple[int, ...], Results] = {}
    for shape in MESHES:
        mesh = global_mesh(TPRun(mesh=shape))
        results[shape] = {}
        for name, value in inputs(mesh).items():
            if tp_uneven(value):
                continue  # torch's chunk_dtensor would leave the ranks' collectives out of step
            results[shape][name] = {"expected": describe(local_part(value).detach())}
            for impl, ext in extensions().items():
                results[shape][name][impl] = _place_and_gather(ext, value, mesh)
    return results


def round_trip_body(rank: int, world_size: int) -> dict[tuple[int, ...], Results]:
    """Ours alone, every input: placed onto the 2D (3D) layout, gathered back, rebuilt.

    "placed" is the 2D DTensor's full tensor, "gathered" the TP rank's part gathered over
    dp, "rebuilt" the full tensor of the TP DTensor rebuilt around that part.
    """
    ext = DTensorExtensions()
    results: dict[tuple[int, ...], Results] = {}
    for shape in MESHES:
        mesh = global_mesh(TPRun(mesh=shape))
        results[shape] = {}
        for name, value in inputs(mesh).items():
            placed = ext.chunk_dtensor(value, 0, dp_mesh_of(mesh))
            gathered = ext.all_gather_dtensor(placed, mesh)
            full = value.full_tensor() if isinstance(value, DTensor) else value
            out = {"full": full.detach(), "placed": placed.full_tensor()}
            out.update(gathered=gathered, part=local_part(value).detach())
            _, metadata = ext.pre_flatten_transform(value)
            if metadata is not None:
                rebuilt = ext.post_unflatten_transform(gathered, metadata)
                assert isinstance(rebuilt, DTensor)
                out["rebuilt"] = rebuilt.full_tensor()
            results[shape][name] = out
    return results


def gather_sharded_params_body(rank: int, world_size: int) -> Results:
    """all_gather_dtensor by both on the 2D parameters of shardkit's ``fully_shard`` + TP.

    "expected" is the TP rank's local tensor of the same parameter in a TP-only model.
    """
    mesh = global_mesh(TPRun(mesh=(2, 2)))
    results: Results = {}
    for model_name in ("mlp", "sp"):
        sharded = build_sharded("shardkit", TPRun(model=model_name), mesh)
        reference = tp_models.build(model_name)
        tp_models.parallelize(model_name, reference, mesh["tp"])
        expected = dict(reference.named_parameters())
        for fqn, param in sharded.named_parameters():
            name = f"{model_name}.{fqn}"
            results[name] = {"expected": describe(local_part(expected[fqn]).detach())}
            for impl, ext in extensions().items():
                results[name][impl] = describe(ext.all_gather_dtensor(param, mesh))
    return results


def _refusal(fn: Any, *args: object) -> dict[str, str | None]:
    """The error ``fn(*args)`` raised, as ``attempt`` gives it; error None if it returned."""
    result = attempt(fn, *args)
    if isinstance(result, dict) and "error" in result:
        return result
    return {"error": None, "message": f"returned a {type(result).__name__}"}


def misuse_body(rank: int, world_size: int) -> dict[str, dict[str, str | None]]:
    """What ours raises for each misuse: {"error": type name, "message": text}."""
    ext = DTensorExtensions()
    mesh = global_mesh(TPRun(mesh=(2, 2)))
    flat = DeviceMesh("cpu", list(range(world_size)))
    on_dp = ext.chunk_dtensor(torch.ones(4, 2), 0, mesh["dp"])
    dp_only = DTensor.from_local(torch.ones(2, 2), mesh["dp"], [Shard(0)], run_check=False)
    dp = mesh["dp"]
    return {
        "gather on another mesh": _refusal(ext.all_gather_dtensor, on_dp, mesh["dp"]),
        "chunk_dtensor on a 1D mesh": _refusal(ext.chunk_dtensor, torch.ones(4, 2), 0, flat),
        "chunk_dtensor of a dp DTensor": _refusal(ext.chunk_dtensor, dp_only, 0, dp),
        "chunk_tensor of a 2D DTensor": _refusal(
            ext.chunk_tensor, on_dp, dp.get_local_rank(), 2, 0, dp.get_group()
        ),
        "load a plain tensor": _refusal(ext.pre_load_state_dict_transform, torch.ones(2)),
    }
