"""The demo's process group and device mesh, from what torchrun put in the environment.

`init_distributed` survives `torchrun --max-restarts`; `build_mesh` lays the ranks out for plain
FSDP, HSDP across nodes, or FSDP x TP; `data_position` says which rows of the global batch are
this rank's on that mesh.
"""

from __future__ import annotations

import os

import torch.distributed as dist
from demo.model import ModelConfig
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["build_mesh", "data_position", "describe", "init_distributed"]


def init_distributed() -> None:
    """The gloo process group, on keys of this restart attempt only.

    Under `torchrun --max-restarts`, the workers of every attempt share the launcher's store,
    and torch's default init (env://) uses the same keys each time: a restarted worker can
    read the address its dead predecessor published and fail to connect ("Connection
    refused"), or wait forever in the store's barrier. Scoping the keys by the restart count
    makes every attempt rendezvous afresh. (Launching with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    does the same from outside: a new store per attempt.)
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group("gloo")
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # torch.distributed exports both stores at run time, without declaring them to type checkers.
    store = dist.TCPStore(host, port, world, is_master=False)  # type: ignore[attr-defined]
    scoped = dist.PrefixStore(f"demo/attempt_{attempt}", store)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=scoped, rank=rank, world_size=world)


def replica_count(replicas: int) -> int:
    """`replicas`, or with 0 the number of nodes torchrun launched (ranks per node from
    LOCAL_WORLD_SIZE): HSDP keeps the shard groups' traffic inside a node."""
    if replicas > 0:
        return replicas
    world = dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if per_node < 1 or world % per_node != 0:
        raise ValueError(f"LOCAL_WORLD_SIZE={per_node} does not divide the world size {world}")
    return world // per_node


def build_mesh(model_cfg: ModelConfig, *, tp: int, replicas: int) -> DeviceMesh:
    """("dp",) over every rank; ("dp_replicate", "dp_shard") for HSDP across nodes (the
    planner's and CommTracker's axis names: inter-node traffic is on dp_replicate); or
    ("dp", "tp") with tp ranks splitting each layer.

    Args:
        model_cfg: the model, whose heads, sequence and vocabulary tp must divide.
        tp: the tensor-parallel degree (--tp).
        replicas: HSDP replicas (--replicas); 0 means one per node.
    """
    world = dist.get_world_size()
    replicas = replica_count(replicas)
    if replicas > 1 and tp > 1:
        raise ValueError(f"--tp {tp} with {replicas} HSDP replicas is not in the demo")
    if replicas > 1:
        if world % replicas != 0:
            raise ValueError(f"--replicas {replicas} must divide the world size {world}")
        shape = (replicas, world // replicas)  # a node's ranks are consecutive: one shard group
        return init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard"))
    if tp == 1:
        return init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    sizes = {"the world size": world, "n_heads": model_cfg.n_heads, "seq_len": model_cfg.seq_len}
    sizes |= {"vocab_size": model_cfg.vocab_size}
    for what, size in sizes.items():
        if size % tp != 0:
            raise ValueError(f"--tp {tp} must divide {what} ({size})")
    return init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))


def describe(mesh: DeviceMesh) -> str:
    """The mesh as the progress line shows it, e.g. 'dp_replicate 2 x dp_shard 2'."""
    names = mesh.mesh_dim_names or ()
    return " x ".join(f"{name} {size}" for name, size in zip(names, mesh.shape, strict=True))


def data_position(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's index among the data-parallel ranks, and their number. The ranks of one
    TP group work on the same rows, so data follows "dp" only; under HSDP every rank has its
    own rows, in the order of the global ranks, as in plain FSDP over the same ranks."""
    names = mesh.mesh_dim_names or ()
    if "tp" in names:
        dp_mesh = mesh["dp"]
        return dp_mesh.get_local_rank(), dp_mesh.size()
    return dist.get_rank(), dist.get_world_size()
