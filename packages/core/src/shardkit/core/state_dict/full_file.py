"""Full state dicts in one file, moved one parameter group at a time through the coordinator.

Saving consumes :func:`iter_full_state_dict`: the coordinator receives one group's full
tensors at a time and writes them, while the other ranks only send. Loading reads one group on
the coordinator, scatters each rank its shard and writes it into the sharded parameters in
place. The file is safetensors (``.safetensors``) or torch.save's format (anything else);
loading never unpickles arbitrary data. The whole file and every key are validated before
anything is loaded, and a save goes to a temporary file renamed into place when complete.

Only the coordinator reads the file, so whatever it finds wrong is shared before any tensor
is sent (``agreement.from_rank``): every rank raises the same error instead of waiting in a
collective for data that never comes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from shardkit.core.engine.group.param_group import FSDPParamGroup
from shardkit.core.engine.reduce import pack_grads_rank_major
from shardkit.core.formats.file_readers import StateDictReader, open_reader
from shardkit.core.formats.file_writers import Entry, FileWriter, format_of, open_writer
from shardkit.core.runtime.groups import barrier, global_rank, world_group
from shardkit.core.runtime.p2p.agreement import from_rank
from shardkit.core.runtime.p2p.object_collectives import (
    broadcast_from,
    broadcast_from_first,
    ranks_where,
    scatter_from_first,
)
from shardkit.core.state_dict.full import (
    FullStateDictPlan,
    group_pieces,
    plain_pieces,
    plan_full_state_dict,
    sharded_groups,
)
from shardkit.core.state_dict.validation import check_state_dict, format_problems

__all__ = ["load_full_state_dict", "save_full_state_dict"]

logger = logging.getLogger(__name__)


def _entries(plan: FullStateDictPlan) -> list[Entry]:
    """The file's entries in the order the generator yields them."""
    return [Entry(k, tuple(plan.expected[k].shape), plan.expected[k].dtype) for k in plan.keys]


def save_full_state_dict(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Save ``model``'s full state dict to one file, one parameter group at a time.

    Call on every rank; the coordinator (global rank 0 for a mesh over the whole world)
    writes. ``.safetensors`` paths are written as safetensors, other paths in torch.save's
    format (loadable with ``torch.load(path, weights_only=True)``). The file appears complete
    or not at all: it is written under a temporary name and renamed.

    Raises:
        OSError: the coordinator could not write the file (a full disk, no permission): on
            every rank, with the same message naming the file and the coordinator's rank, as
            soon as the group being gathered is done. The temporary file is removed.
    """
    target = Path(path)
    plan = plan_full_state_dict(model, sharded_groups(model))
    save = _CoordinatedWrite(target, plan.coordinator)
    started = time.perf_counter()
    save.open(_entries(plan), list(plan.expected))
    for group in plan.groups:
        # Every rank gathers the whole group whatever the coordinator's writes gave (the
        # gathers stay paired), then learns their outcome before the next group.
        for key, pieces in group_pieces(plan, group, rank0_only=True, cpu_offload=True):
            save.write(key, pieces)
        save.agree()
    for key, pieces in plain_pieces(plan, rank0_only=True, cpu_offload=True):
        save.write(key, pieces)
    save.finish()
    if global_rank() == plan.coordinator:
        logger.info("saved %s in %.1f s", target, time.perf_counter() - started)


class _CoordinatedWrite:
    """The coordinator's writes of one file, their outcome shared with every rank.

    A write that fails on the coordinator (a full disk) must not leave the other ranks
    waiting in the next gather until the process group's timeout: the error is kept, the
    temporary file removed, later writes skipped, and :meth:`agree` raises the error on
    every rank at the next group boundary (one small broadcast per group).
    """

    def __init__(self, target: Path, coordinator: int) -> None:
        self.target = target
        self.partial = target.with_name(target.name + ".partial")
        self.coordinator = coordinator
        self.writing = global_rank() == coordinator
        self.writer: FileWriter | None = None  # the coordinator's, until done or failed
        self.failure: Exception | None = None

    def open(self, entries: list[Entry], key_order: list[str]) -> None:
        """Open the temporary file on the coordinator (collective: every rank learns how)."""

        def open_partial() -> None:
            self.target.parent.mkdir(parents=True, exist_ok=True)
            self.writer = open_writer(self.partial, entries, format_of(self.target), key_order)

        if self.writing:
            self._attempt(open_partial)
        self.agree()

    def write(self, key: str, pieces: list[torch.Tensor]) -> None:
        """Append one tensor (on the coordinator, unless a write failed already)."""
        writer = self.writer
        if writer is not None:
            self._attempt(lambda: writer.write_chunks(key, pieces))

    def finish(self) -> None:
        """Close the file and rename it into place (collective: every rank learns how)."""
        writer = self.writer
        if writer is not None:

            def close_and_rename() -> None:
                writer.close()
                self.writer = None
                self.partial.replace(self.target)

            self._attempt(close_and_rename)
        self.agree()

    def agree(self) -> None:
        """Every rank raises the coordinator's write error, if any (collective)."""

        def outcome() -> None:
            if self.failure is not None:
                raise self.failure

        from_rank(self.coordinator, outcome, doing=f"write {self.target}")

    def _attempt(self, work: Callable[[], None]) -> None:
        try:
            work()
        except Exception as error:
            self.failure = error
            if self.writer is not None:
                with contextlib.suppress(Exception):
                    self.writer.close()  # lets go of the file, which is then removed
            self.writer = None
            self.partial.unlink(missing_ok=True)


def load_full_state_dict(
    model: nn.Module, path: str | os.PathLike[str], *, strict: bool = True
) -> None:
    """Load a full state dict file, read by the coordinator, into a sharded model, group by group.

    Call on every rank; only the coordinator (global rank 0 for a mesh over the whole world)
    needs the file. The whole file is checked first (a truncated or malformed file, offsets
    outside it, unknown dtypes, pickled objects), then every key (shape, missing or
    unexpected; other dtypes are converted, as ``nn.Module.load_state_dict`` does): on any
    problem, every rank raises the same error and nothing is loaded.

    Raises:
        StateDictFileError: the file is malformed (the message says what, and where).
        OSError: the coordinator cannot open the file.
        RuntimeError: keys are missing, unexpected or of another shape (all listed).
    """
    source = Path(path)
    groups = sharded_groups(model)
    plan = plan_full_state_dict(model, groups)
    opened: list[StateDictReader] = []  # the coordinator's reader, once open

    def open_file() -> list[list[object]]:
        opened.append(open_reader(source))
        return [[e.name, list(e.shape), _dtype_name(e.dtype)] for e in opened[0].entries]

    try:
        listed = from_rank(plan.coordinator, open_file)
        entries = [Entry(name, tuple(shape), getattr(torch, dt)) for name, shape, dt in listed]
        given = {e.name: torch.empty(e.shape, dtype=e.dtype, device="meta") for e in entries}
        problems = check_state_dict(
            plan.expected, given, strict=strict, cpu_only=False, placeholders=True
        )
        if problems:
            raise RuntimeError(format_problems(model, problems, source=str(source)))
        _load_entries(plan, groups, {e.name: e for e in entries}, opened[0] if opened else None)
    finally:
        for reader in opened:
            reader.close()
    barrier()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _load_entries(
    plan: FullStateDictPlan,
    groups: list[FSDPParamGroup],
    by_name: dict[str, Entry],
    reader: StateDictReader | None,
) -> None:
    """Scatter each group's shards, then broadcast the plain tensors, from the reader."""
    source = _Source(reader, plan.coordinator, _packers(groups, plan.coordinator))
    for group in groups:
        keys = {plan.sharded[k][1]: k for k in plan.keys_of(group)}
        _scatter_group(group, keys, by_name, source)
    plain = [(tensor, by_name[key]) for key, tensor in plan.plain.items() if key in by_name]
    values: list[torch.Tensor] = []

    def read_plain() -> None:
        assert reader is not None, "the coordinator has the file open"
        values.extend(reader.read(entry) for _, entry in plain)

    from_rank(plan.coordinator, read_plain)
    for index, (tensor, entry) in enumerate(plain):
        value = values[index] if values else torch.empty(entry.shape, dtype=entry.dtype)
        broadcast_from(value, plan.coordinator)
        with torch.no_grad():
            tensor.copy_(value)  # converts the file's dtype, as load_state_dict does


@dataclass(frozen=True, slots=True)
class _Source:
    """Where the full tensors come from: the coordinator's reader, and who packs shards.

    Every data-parallel group's first rank packs its group's shards into rows. Without TP that
    is the coordinator alone; under TP each TP rank's data-parallel group has one, and each
    needs the full tensors to take its TP part: the coordinator reads and broadcasts to them.
    See [Note: tensor parallelism].
    """

    reader: StateDictReader | None  # open on the coordinator only
    coordinator: int
    packers: dist.ProcessGroup | None  # the dp groups' first ranks; None: the coordinator only


def _packers(groups: list[FSDPParamGroup], coordinator: int) -> dist.ProcessGroup | None:
    """The process group of the ranks that pack shards (see :class:`_Source`)."""
    packs = any(_packs(g) for g in groups)
    ranks = ranks_where(packs)  # every rank takes part: a collective over the world
    if len(ranks) <= 1:
        return None
    assert not packs or coordinator in ranks, (coordinator, ranks)
    # Made by every rank, packers or not (all of them are here): a group the packers made
    # alone would advance torch's group counter on them alone (torch 2.14 on).
    group = world_group(tuple(ranks))
    return group if packs else None


def _packs(group: FSDPParamGroup) -> bool:
    """Whether this rank is the first of ``group``'s data-parallel ranks (first replica)."""
    replicate = group.mesh_info.replicate_group
    first_replica = replicate is None or replicate.rank() == 0
    return first_replica and group.mesh_info.shard_group.rank() == 0


def _scatter_group(
    group: FSDPParamGroup, keys: dict[int, str], by_name: dict[str, Entry], source: _Source
) -> None:
    """The packing ranks turn a group's full tensors into rows; each rank gets its shards."""
    mesh_info = group.mesh_info
    packed: list[torch.Tensor] = []  # the coordinator's rows (no TP)
    fulls: dict[int, torch.Tensor] = {}  # the coordinator's full tensors by index (TP)

    def read_group() -> None:
        reader = source.reader
        assert reader is not None, "the coordinator has the file open"
        if source.packers is None:
            packed.append(_pack_rows(group, keys, by_name, lambda _, entry: reader.read(entry)))
        else:
            fulls.update({i: reader.read(by_name[k]) for i, k in keys.items() if k in by_name})

    # A read that fails after the file was checked (an I/O error) is shared before any data.
    from_rank(source.coordinator, read_group)
    if source.packers is not None and _packs(group):

        def shared(index: int, entry: Entry) -> torch.Tensor:
            value = fulls.pop(index, None)
            if value is None:
                value = torch.empty(entry.shape, dtype=entry.dtype)
            broadcast_from(value, source.coordinator, source.packers)
            return value

        packed.append(_pack_rows(group, keys, by_name, shared))
    rows = list(packed[0].to(group.sharded_buffer.device).unbind(0)) if packed else None
    replicate = mesh_info.replicate_group
    received = torch.empty_like(group.sharded_buffer)
    if replicate is None or replicate.rank() == 0:
        scatter_from_first(received, rows, mesh_info.shard_group)
    if replicate is not None:
        broadcast_from_first(received, replicate)
    _write_shards(group, received, keys, by_name)


def _pack_rows(
    group: FSDPParamGroup,
    keys: dict[int, str],
    by_name: dict[str, Entry],
    full_of: Callable[[int, Entry], torch.Tensor],
) -> torch.Tensor:
    """A group's full tensors as (W, bytes) rows of each rank's padded shards."""
    layout = group.layout.storage
    rows = torch.zeros(group.mesh_info.shard_size, layout.nbytes, dtype=torch.uint8)
    for index, p in enumerate(group.params):
        key = keys.get(index)
        if key is None or key not in by_name:
            continue  # absent (strict=False): every rank keeps its current shard
        dp_full = p.extension.chunk_full(full_of(index, by_name[key]), p.sharding_spec)
        start = layout.offsets[index]
        typed = rows[:, start : start + p.geometry.shard_numel * p.orig_dtype.itemsize]
        # The copy converts the file's dtype to the parameter's, as load_state_dict does.
        pack_grads_rank_major([dp_full], [p.geometry], [0], typed.view(p.orig_dtype))
    return rows


def _write_shards(
    group: FSDPParamGroup, received: torch.Tensor, keys: dict[int, str], by_name: dict[str, Entry]
) -> None:
    layout = group.layout.storage
    for index in range(len(group.params)):
        key = keys.get(index)
        if key is None or key not in by_name:
            continue
        target = layout.view(group.sharded_buffer, index)
        target.copy_(layout.view(received, index))
