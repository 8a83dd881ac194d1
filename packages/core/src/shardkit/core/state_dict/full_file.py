"""Full state dicts in one file, moved one parameter group at a time through the coordinator.

Saving consumes :func:`iter_full_state_dict`: the coordinator receives one group's full
tensors at a time and writes them, while the other ranks only send. Loading reads one group on
the coordinator, scatters each rank its shard and writes it into the sharded parameters in
place. The file is safetensors (``.safetensors``) or torch.save's format (anything else);
loading never unpickles arbitrary data. Every key is validated before anything is loaded, and
a save goes to a temporary file renamed into place when complete.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.core.param_group import FSDPParamGroup
from shardkit.core.runtime.buffers import pack_grads_rank_major
from shardkit.core.runtime.collectives import (
    broadcast_from,
    broadcast_from_first,
    ranks_where,
    scatter_from_first,
)
from shardkit.core.runtime.groups import barrier, global_rank, world_subgroup
from shardkit.core.state_dict.file_formats import (
    Entry,
    format_of,
    open_writer,
    read_entries,
    read_tensor,
)
from shardkit.core.state_dict.full import (
    FullStateDictPlan,
    iter_pieces,
    plan_full_state_dict,
    sharded_groups,
)
from shardkit.core.state_dict.validation import check_state_dict, format_problems

__all__ = ["load_full_state_dict", "save_full_state_dict"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _FileSource:
    """The file being loaded, open on the coordinator only.

    Every data-parallel group's first rank packs its group's shards. Without TP that is the
    coordinator alone; under TP each TP rank's data-parallel group has one, and each needs
    the full tensors to take its TP part: the coordinator reads and broadcasts to them.
    See [Note: tensor parallelism].
    """

    path: Path
    handle: Any  # from read_entries; None away from the coordinator
    is_reader: bool
    coordinator: int
    packers: dist.ProcessGroup | None  # first ranks of the dp groups; None: the coordinator only

    def read(self, entry: Entry) -> torch.Tensor:
        """The full tensor of ``entry`` (call on a packing rank)."""
        if self.is_reader:
            value = read_tensor(self.path, self.handle, entry)
        else:
            value = torch.empty(entry.shape, dtype=entry.dtype)
        if self.packers is not None:
            broadcast_from(value, self.coordinator, self.packers)
        return value


def _packers(groups: list[FSDPParamGroup], coordinator: int) -> dist.ProcessGroup | None:
    """The process group of the ranks that pack shards (see :class:`_FileSource`)."""
    packs = any(_packs(g) for g in groups)
    ranks = ranks_where(packs)
    if len(ranks) <= 1 or not packs:
        return None
    assert coordinator in ranks, (coordinator, ranks)
    return world_subgroup(tuple(ranks))


def _packs(group: FSDPParamGroup) -> bool:
    """Whether this rank is the first of ``group``'s data-parallel ranks (first replica)."""
    replicate = group.mesh_info.replicate_group
    first_replica = replicate is None or replicate.rank() == 0
    return first_replica and group.mesh_info.shard_group.rank() == 0


def _entries(plan: FullStateDictPlan) -> list[Entry]:
    """The file's entries in the order the generator yields them."""
    return [Entry(k, tuple(plan.expected[k].shape), plan.expected[k].dtype) for k in plan.keys]


def save_full_state_dict(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Save ``model``'s full state dict to one file, one parameter group at a time.

    Call on every rank; the coordinator (global rank 0 for a mesh over the whole world)
    writes. ``.safetensors`` paths are written as safetensors, other paths in torch.save's
    format (loadable with ``torch.load(path, weights_only=True)``). The file appears complete
    or not at all: it is written under a temporary name and renamed.
    """
    target = Path(path)
    plan = plan_full_state_dict(model, sharded_groups(model))
    writer = None
    partial = target.with_name(target.name + ".partial")
    if global_rank() == plan.coordinator:
        target.parent.mkdir(parents=True, exist_ok=True)
        writer = open_writer(partial, _entries(plan), format_of(target), list(plan.expected))
    started = time.perf_counter()
    for key, pieces in iter_pieces(plan, rank0_only=True, cpu_offload=True):
        assert writer is not None, "only the coordinator receives full tensors"
        writer.write_chunks(key, pieces)
    if writer is not None:
        writer.close()
        partial.replace(target)
        logger.info("saved %s in %.1f s", target, time.perf_counter() - started)
    barrier()


def load_full_state_dict(
    model: nn.Module, path: str | os.PathLike[str], *, strict: bool = True
) -> None:
    """Load a full state dict file, read by the coordinator, into a sharded model, group by group.

    Call on every rank; only the coordinator (global rank 0 for a mesh over the whole world)
    needs the file. Every key is checked first (shape,
    dtype, missing or unexpected): on any problem one error lists them all, on every rank,
    and nothing is loaded.
    """
    source = Path(path)
    groups = sharded_groups(model)
    plan = plan_full_state_dict(model, groups)
    reader = global_rank() == plan.coordinator
    handle = None
    entries: list[Entry] = []
    if reader:
        entries, handle = read_entries(source)
    entries = _broadcast_entries(entries, plan.coordinator)
    given = {e.name: torch.empty(e.shape, dtype=e.dtype, device="meta") for e in entries}
    problems = check_state_dict(plan.expected, given, strict=strict, cpu_only=False)
    if problems:
        raise RuntimeError(format_problems(model, problems))
    by_name = {e.name: e for e in entries}
    packers = _packers(groups, plan.coordinator)
    file = _FileSource(source, handle, reader, plan.coordinator, packers)
    for group in groups:
        keys = {plan.sharded[k][1]: k for k in plan.keys_of(group)}
        _scatter_group(group, keys, by_name, file)
    plain = _FileSource(source, handle, reader, plan.coordinator, None)
    for key, tensor in plan.plain.items():
        if key in by_name:
            _broadcast_plain(tensor, by_name[key], plain, plan)
    barrier()


def _broadcast_entries(entries: list[Entry], src: int) -> list[Entry]:
    """The coordinator's entries on every rank, as JSON bytes (no pickling)."""
    payload = json.dumps(
        [[e.name, list(e.shape), str(e.dtype).removeprefix("torch.")] for e in entries]
    ).encode()
    size = torch.tensor([len(payload)], dtype=torch.int64)
    broadcast_from(size, src)
    buffer = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if global_rank() == src and payload
        else torch.empty(int(size.item()), dtype=torch.uint8)
    )
    broadcast_from(buffer, src)
    decoded = json.loads(bytes(buffer.tolist()).decode())
    return [Entry(name, tuple(shape), getattr(torch, dtype)) for name, shape, dtype in decoded]


def _scatter_group(
    group: FSDPParamGroup, keys: dict[int, str], by_name: dict[str, Entry], source: _FileSource
) -> None:
    """The coordinator reads a group's full tensors and scatters each rank its padded shards."""
    mesh_info = group.mesh_info
    layout = group.storage_layout
    replicate = mesh_info.replicate_group
    first_replica = replicate is None or replicate.rank() == 0
    rows: list[torch.Tensor] | None = None
    if _packs(group):
        rows_buffer = torch.zeros(mesh_info.shard_size, layout.nbytes, dtype=torch.uint8)
        for index, p in enumerate(group.params):
            key = keys.get(index)
            if key is None or key not in by_name:
                continue  # absent (strict=False): every rank keeps its current shard
            dp_full = p.extension.chunk_full(source.read(by_name[key]), p.sharding_spec)
            start = layout.offsets[index]
            typed = rows_buffer[:, start : start + p.geometry.shard_numel * p.orig_dtype.itemsize]
            pack_grads_rank_major([dp_full], [p.geometry], [0], typed.view(p.orig_dtype))
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


def _broadcast_plain(
    tensor: torch.Tensor, entry: Entry, source: _FileSource, plan: FullStateDictPlan
) -> None:
    value = source.read(entry) if source.is_reader else torch.empty(entry.shape, dtype=entry.dtype)
    broadcast_from(value, plan.coordinator)
    with torch.no_grad():
        tensor.copy_(value)
