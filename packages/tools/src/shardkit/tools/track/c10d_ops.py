"""What each torch.distributed operator is, and how many bytes it moves.

Every c10d collective, whoever calls it (torch's ``fully_shard``, FSDP1, DDP's reducer, user
code), reaches the dispatcher as one of the ``c10d::`` operators below; every functional
collective (DTensor redistribution, tensor parallelism, compiled code) as one of the
``_c10d_functional::`` ones, whose result is ready once ``wait_tensor`` on it returns. A
kernel registered for them sees their arguments; this module turns those into a kind and
byte counts.

Two byte counts per rank: ``sent_bytes``, those of a bandwidth-optimal algorithm (a ring, for
instance), in which the theoretical minimum is stated (the payload); and ``wire_bytes``, what the
backend's own algorithm writes. They differ where the algorithm is not optimal: gloo (every
CPU collective) reduce-scatters by reducing the whole input, 2(W-1)/W of it per rank, twice the
payload (measured as the bytes written to gloo's sockets); its all-gather, all-reduce and
all-to-all, and NCCL's rings, send the payload.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _resolve_process_group
from torch.distributed.distributed_c10d import GroupName

__all__ = [
    "FUNCTIONAL",
    "OPERATORS",
    "WAIT_TENSOR",
    "OpInfo",
    "describe",
    "outputs",
    "wire_bytes",
]


@dataclass(frozen=True, slots=True)
class OpInfo:
    """One operator call, described."""

    kind: str
    group_size: int
    group: str
    input_bytes: int
    sent_bytes: int
    blocking: bool = False
    """The call itself waits for completion (``async_op=False``: the backend syncs in C++)."""
    wire_bytes: int = 0
    """Bytes the backend's algorithm sends from this rank (see the module docstring)."""


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    return 0


# Per operator: kind, and (input bytes, sent bytes) from (args by name, group size, rank).
_Bytes = Callable[[dict[str, Any], int, int], tuple[int, int]]


def _gather(key: str) -> _Bytes:
    def count(a: dict[str, Any], w: int, _r: int) -> tuple[int, int]:
        n = _nbytes(a[key])
        return n, n * (w - 1)

    return count


def _scatter_reduce(key: str) -> _Bytes:
    # The output is this rank's shard: a ring sends W-1 shards.
    def count(a: dict[str, Any], w: int, _r: int) -> tuple[int, int]:
        out = _nbytes(a[key])
        return out * w, out * (w - 1)

    return count


def _all_reduce(key: str) -> _Bytes:
    def count(a: dict[str, Any], w: int, _r: int) -> tuple[int, int]:
        n = _nbytes(a[key])
        return n, 2 * n * (w - 1) // w

    return count


def _broadcast(key: str) -> _Bytes:
    def count(a: dict[str, Any], _w: int, _r: int) -> tuple[int, int]:
        n = _nbytes(a[key])
        return n, n  # a pipelined chain: every rank forwards the whole tensor once

    return count


def _all_but_own_share(key: str) -> _Bytes:
    # An all-to-all, or a reduce-scatter given its whole input: this rank keeps 1/W of it.
    def count(a: dict[str, Any], w: int, _r: int) -> tuple[int, int]:
        n = _nbytes(a[key])
        return n, n * (w - 1) // w

    return count


def _all_to_all(key: str) -> _Bytes:
    # Split sizes (an alltoallv: the whole-matrix optimizers' exchange sends parts of any
    # length) say what this rank keeps: its own part, rows of the input's first dimension.
    # Without them the W parts are equal.
    even = _all_but_own_share(key)

    def count(a: dict[str, Any], w: int, r: int) -> tuple[int, int]:
        splits = a.get("input_split_sizes")
        tensor = a[key]
        if not splits or not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            return even(a, w, r)
        n = _nbytes(tensor)
        row = n // tensor.size(0) if tensor.size(0) else 0
        return n, n - int(splits[r]) * row

    return count


def _send(a: dict[str, Any], _w: int, _r: int) -> tuple[int, int]:
    n = _nbytes(a["tensors"])
    return n, n


def _recv(a: dict[str, Any], _w: int, _r: int) -> tuple[int, int]:
    return _nbytes(a["tensors"]), 0


def _to_root(a: dict[str, Any], _w: int, r: int) -> tuple[int, int]:
    key = "input_tensors" if "input_tensors" in a else "tensors"
    n = _nbytes(a[key])
    return n, 0 if r == a["root_rank"] else n


def _from_root(a: dict[str, Any], _w: int, r: int) -> tuple[int, int]:
    out = _nbytes(a["output_tensors"])
    return out, _nbytes(a["input_tensors"]) - out if r == a["root_rank"] else 0


def _nothing(_a: dict[str, Any], _w: int, _r: int) -> tuple[int, int]:
    return 0, 0


_C10D: dict[str, tuple[str, _Bytes]] = {
    "_allgather_base_": ("all_gather", _gather("input_tensor")),
    "allgather_": ("all_gather", _gather("input_tensors")),
    "allgather_into_tensor_coalesced_": ("all_gather", _gather("inputs")),
    "allgather_coalesced_": ("all_gather", _gather("input_list")),
    "_reduce_scatter_base_": ("reduce_scatter", _scatter_reduce("output_tensor")),
    "reduce_scatter_": ("reduce_scatter", _scatter_reduce("output_tensors")),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", _scatter_reduce("outputs")),
    "allreduce_": ("all_reduce", _all_reduce("tensors")),
    "allreduce_coalesced_": ("all_reduce", _all_reduce("tensors")),
    "broadcast_": ("broadcast", _broadcast("tensors")),
    "alltoall_base_": ("all_to_all", _all_to_all("input")),
    "alltoall_": ("all_to_all", _all_but_own_share("input_tensors")),
    "send": ("send", _send),
    "recv_": ("recv", _recv),
    "recv_any_source_": ("recv", _recv),
    "gather_": ("gather", _to_root),
    "reduce_": ("reduce", _to_root),
    "scatter_": ("scatter", _from_root),
    "barrier": ("barrier", _nothing),
    "monitored_barrier_": ("barrier", _nothing),
}

FUNCTIONAL = "_c10d_functional"
WAIT_TENSOR = "wait_tensor"
"""The functional operator that waits for a functional collective's result."""

_FUNCTIONAL: dict[str, tuple[str, _Bytes]] = {
    "all_gather_into_tensor": ("all_gather", _gather("input")),
    "all_gather_into_tensor_out": ("all_gather", _gather("input")),
    "all_gather_into_tensor_coalesced": ("all_gather", _gather("inputs")),
    "reduce_scatter_tensor": ("reduce_scatter", _all_but_own_share("input")),
    "reduce_scatter_tensor_out": ("reduce_scatter", _all_but_own_share("input")),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", _all_but_own_share("inputs")),
    "all_reduce": ("all_reduce", _all_reduce("input")),
    "all_reduce_": ("all_reduce", _all_reduce("input")),
    "all_reduce_coalesced": ("all_reduce", _all_reduce("inputs")),
    "all_reduce_coalesced_": ("all_reduce", _all_reduce("inputs")),
    "all_to_all_single": ("all_to_all", _all_to_all("input")),
    "broadcast": ("broadcast", _broadcast("input")),
    "broadcast_": ("broadcast", _broadcast("input")),
}

OPERATORS: dict[str, tuple[str, ...]] = {
    "c10d": tuple(_C10D),
    FUNCTIONAL: (*_FUNCTIONAL, WAIT_TENSOR),
}
"""The operators a tracker hooks, by namespace."""


def _named_args(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    named = dict(kwargs)
    for arg, value in zip(func._schema.arguments, args, strict=False):
        named[arg.name] = value
    return named


def _on_cpu(value: Any) -> bool:
    """Whether the first tensor in ``value`` (nested lists included) is on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.device.type == "cpu"
    if isinstance(value, list | tuple):
        return any(_on_cpu(v) for v in value[:1])
    return False


def wire_bytes(kind: str, sent_bytes: int, group_size: int, gloo: bool) -> int:
    """Bytes a rank writes for a collective whose payload is ``sent_bytes``.

    Args:
        kind: The collective's kind ('reduce_scatter', ...).
        sent_bytes: Its payload: what a bandwidth-optimal algorithm sends.
        group_size: Ranks in its group.
        gloo: Whether gloo runs it (CPU tensors): its reduce-scatter reduces the whole input
            as an all-reduce does, sending twice the payload; everything else is optimal.
    """
    if gloo and kind == "reduce_scatter" and group_size > 1:
        return 2 * sent_bytes
    return sent_bytes


def _info(kind: str, group: dist.ProcessGroup, counts: tuple[int, int], cpu: bool) -> OpInfo:
    size = group.size()
    input_bytes, sent = counts
    wire = wire_bytes(kind, sent, size, gloo=cpu)
    return OpInfo(kind, size, group.group_name, input_bytes, sent, wire_bytes=wire)


def _describe_c10d(name: str, named: dict[str, Any]) -> OpInfo:
    kind, count = _C10D[name]
    group = dist.ProcessGroup.unbox(named["process_group"])
    cpu = any(_on_cpu(v) for v in named.values())
    info = _info(kind, group, count(named, group.size(), group.rank()), cpu)
    return dataclasses.replace(info, blocking=named.get("async_op", True) is False)


def _describe_functional(name: str, named: dict[str, Any]) -> OpInfo:
    kind, count = _FUNCTIONAL[name]
    group = named["group_name"]
    if isinstance(group, str):  # DTensor passes the name; a ProcessGroup is accepted too
        group = _resolve_process_group(GroupName(group))
    cpu = any(_on_cpu(v) for v in named.values())
    return _info(kind, group, count(named, group.size(), group.rank()), cpu)


def describe(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> OpInfo | None:
    """The collective ``func`` (an OpOverload) performs, or None if it is not one."""
    namespace, name = func.namespace, func._opname
    if namespace == "c10d" and name in _C10D:
        return _describe_c10d(name, _named_args(func, args, kwargs))
    if namespace == FUNCTIONAL and name in _FUNCTIONAL:
        return _describe_functional(name, _named_args(func, args, kwargs))
    return None


def outputs(out: Any) -> list[torch.Tensor]:
    """The tensors a functional collective returned: ``wait_tensor`` is called on each."""
    items = out if isinstance(out, tuple | list) else (out,)
    return [item for item in items if isinstance(item, torch.Tensor)]
