"""Full state dicts in one file, moved one parameter group at a time through rank 0.

Saving gathers one group's shards to rank 0 (on the CPU), rebuilds its full tensors and
writes them, then moves on: rank 0 never holds more than one group, and the other ranks only
send. Loading reads one group on rank 0, scatters each rank its shard, and writes it into the
sharded parameters in place. The file is safetensors (``.safetensors``) or torch.save's
format (anything else); loading never unpickles arbitrary data. Every key is validated before
anything is loaded, and a save goes to a temporary file renamed into place when complete.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from shardkit.core.file_formats import Entry, format_of, open_writer, read_entries, read_tensor
from shardkit.core.load_validation import check_state_dict, format_problems, param_keys
from shardkit.core.param_group import FSDPParamGroup
from shardkit.core.runtime.buffers import copy_out_unsharded, pack_grads_rank_major
from shardkit.core.runtime.collectives import (
    broadcast_from_first,
    gather_to_first,
    scatter_from_first,
)

__all__ = ["load_full_state_dict", "save_full_state_dict"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Plan:
    """The model's state dict as groups of sharded parameters plus plain tensors."""

    entries: list[Entry]  # in file order: group by group, then plain tensors
    sharded: dict[str, tuple[FSDPParamGroup, int]]  # key -> (group, index of the param)
    plain: dict[str, torch.Tensor]  # buffers and unsharded parameters
    groups: list[FSDPParamGroup]
    expected: dict[str, torch.Tensor]  # the model's state dict (for validation)


def _plan(model: nn.Module, groups: list[FSDPParamGroup]) -> _Plan:
    expected = model.state_dict(keep_vars=True)
    owner = param_keys(model, groups)
    sharded = {k: owner[k] for k in expected if k in owner}
    plain = {k: v for k, v in expected.items() if k not in owner and isinstance(v, torch.Tensor)}
    order = [k for g in groups for k in sharded if sharded[k][0] is g] + list(plain)
    entries = [
        Entry(k, tuple(expected[k].shape), expected[k].dtype) for k in order if k in expected
    ]
    return _Plan(entries, sharded, plain, groups, dict(expected))


def _groups(model: nn.Module) -> list[FSDPParamGroup]:
    from shardkit.core.api import FSDPModule

    if not isinstance(model, FSDPModule):
        raise TypeError(f"{type(model).__name__} is not sharded with shardkit's fully_shard")
    groups = model._groups_under(recurse=True)
    for group in groups:
        group.reshard()  # the sharded buffers are the source of truth
        group.check_materialized()
    return groups


def save_full_state_dict(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Save ``model``'s full state dict to one file, written by rank 0, one group at a time.

    Call on every rank. ``.safetensors`` paths are written as safetensors, other paths in
    torch.save's format (loadable with ``torch.load(path, weights_only=True)``).
    """
    target = Path(path)
    groups = _groups(model)
    plan = _plan(model, groups)
    writer = None
    partial = target.with_name(target.name + ".partial")
    if dist.get_rank() == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        writer = open_writer(partial, plan.entries, format_of(target), list(plan.expected))
    started = time.perf_counter()
    for number, group in enumerate(groups, start=1):
        rows = _gather_rows(group)  # each rank's shard bytes, on rank 0 only
        for key in [k for k in plan.sharded if plan.sharded[k][0] is group]:
            if writer is not None and rows is not None:
                writer.write_chunks(key, _param_chunks(group, plan.sharded[key][1], rows))
        del rows
        logger.info("saved group %d/%d (%s)", number, len(groups), group.fqn or "<root>")
    for key, tensor in plan.plain.items():
        if writer is not None:
            writer.write(key, tensor.detach().cpu())
    if writer is not None:
        writer.close()
        partial.replace(target)  # the file appears complete or not at all
        logger.info("saved %s in %.1f s", target, time.perf_counter() - started)
    dist.barrier()


def _gather_rows(group: FSDPParamGroup) -> list[torch.Tensor] | None:
    """Every shard rank's sharded buffer (bytes), on rank 0 (CPU); None elsewhere."""
    mesh_info = group.mesh_info
    replicate = mesh_info.replicate_group
    if replicate is not None and replicate.rank() != 0:
        return None  # one replica is enough
    rows = gather_to_first(group.sharded_buffer, mesh_info.shard_group)
    if rows is None or dist.get_rank() != 0:
        return None
    return [row.cpu() for row in rows]


def _param_chunks(
    group: FSDPParamGroup, index: int, rows: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The full parameter ``index`` as pieces of its flat data, from the gathered rows.

    A dim-0 shard is a run of whole rows of the full tensor, so the full tensor is just each
    rank's unpadded shard in rank order: written straight from the rows, nothing rebuilt.
    """
    p = group.params[index]
    geo = p.geometry
    shards = [group.storage_layout.view(row, index) for row in rows]
    if geo.dim == 0:
        return [s[: geo.local_length(r) * geo.row_numel] for r, s in enumerate(shards)]
    padded = torch.empty(geo.world * geo.shard_numel, dtype=p.orig_dtype)
    copy_out_unsharded(shards, geo, padded)
    return [padded[: geo.shape.numel()]]


def load_full_state_dict(
    model: nn.Module, path: str | os.PathLike[str], *, strict: bool = True
) -> None:
    """Load a full state dict file read by rank 0, into a sharded model, group by group.

    Call on every rank; only rank 0 needs the file. Every key is checked first (shape,
    dtype, missing or unexpected): on any problem one error lists them all, on every rank,
    and nothing is loaded.
    """
    source = Path(path)
    groups = _groups(model)
    plan = _plan(model, groups)
    handle = None
    entries: list[Entry] = []
    if dist.get_rank() == 0:
        entries, handle = read_entries(source)
    entries = _broadcast_entries(entries)
    given = {e.name: torch.empty(e.shape, dtype=e.dtype, device="meta") for e in entries}
    problems = check_state_dict(plan.expected, given, strict=strict, cpu_only=False)
    if problems:
        raise RuntimeError(format_problems(model, problems))
    by_name = {e.name: e for e in entries}
    for group in groups:
        keys = {plan.sharded[k][1]: k for k in plan.sharded if plan.sharded[k][0] is group}
        _scatter_group(group, keys, by_name, source, handle)
    for key, tensor in plan.plain.items():
        if key in by_name:
            _broadcast_plain(tensor, by_name[key], source, handle)
    dist.barrier()


def _broadcast_entries(entries: list[Entry]) -> list[Entry]:
    """Rank 0's entries on every rank, as JSON bytes (no pickling)."""
    payload = json.dumps(
        [[e.name, list(e.shape), str(e.dtype).removeprefix("torch.")] for e in entries]
    ).encode()
    size = torch.tensor([len(payload)], dtype=torch.int64)
    broadcast_from_first(size)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else None
    buffer = (
        data
        if dist.get_rank() == 0 and data is not None
        else torch.empty(int(size.item()), dtype=torch.uint8)
    )
    broadcast_from_first(buffer)
    decoded = json.loads(bytes(buffer.tolist()).decode())
    return [Entry(name, tuple(shape), getattr(torch, dtype)) for name, shape, dtype in decoded]


def _scatter_group(
    group: FSDPParamGroup,
    keys: dict[int, str],
    by_name: dict[str, Entry],
    source: Path,
    handle: object,
) -> None:
    """Rank 0 reads a group's full tensors and scatters each rank its padded shards."""
    mesh_info = group.mesh_info
    layout = group.storage_layout
    world = mesh_info.shard_size
    replicate = mesh_info.replicate_group
    first_replica = replicate is None or replicate.rank() == 0
    rows: list[torch.Tensor] | None = None
    if dist.get_rank() == 0:
        rows_buffer = torch.zeros(world, layout.nbytes, dtype=torch.uint8)
        for index, p in enumerate(group.params):
            key = keys.get(index)
            if key is None or key not in by_name:
                continue  # absent (strict=False): every rank keeps its current shard
            full = read_tensor(source, handle, by_name[key])
            start = layout.offsets[index]
            typed = rows_buffer[:, start : start + p.geometry.shard_numel * p.orig_dtype.itemsize]
            pack_grads_rank_major([full], [p.geometry], [0], typed.view(p.orig_dtype))
        rows = list(rows_buffer.to(group.sharded_buffer.device).unbind(0))
    received = torch.empty_like(group.sharded_buffer)
    if first_replica:
        scatter_from_first(received, rows, mesh_info.shard_group)
    if replicate is not None:
        broadcast_from_first(received, replicate)
    _write_shards(group, received, keys, by_name)


def _write_shards(
    group: FSDPParamGroup, received: torch.Tensor, keys: dict[int, str], by_name: dict[str, Entry]
) -> None:
    layout = group.storage_layout
    for index in range(len(group.params)):
        key = keys.get(index)
        if key is None or key not in by_name:
            continue
        target = layout.view(group.sharded_buffer, index)
        target.copy_(layout.view(received, index))


def _broadcast_plain(tensor: torch.Tensor, entry: Entry, source: Path, handle: object) -> None:
    value = (
        read_tensor(source, handle, entry)
        if dist.get_rank() == 0
        else torch.empty(entry.shape, dtype=entry.dtype)
    )
    broadcast_from_first(value)
    with torch.no_grad():
        tensor.copy_(value)
