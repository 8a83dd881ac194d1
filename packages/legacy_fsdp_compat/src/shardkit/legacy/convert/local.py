"""LOCAL_STATE_DICT checkpoints: one torch.save file per rank of each unit's flat shard.

Each rank's file holds, per FSDP1 unit, ``<unit>._flat_param``: the rank's piece of the unit's
flat parameter (a 1-D ShardedTensor), plus the buffers under their own names, and with
``use_orig_params=True`` every parameter's name too (a 1-D view of its part of that piece).
The flat layout (:mod:`shardkit.legacy.flat_layout`) says where each parameter lies; its
pieces are cut out of the ranks' shards and joined, one parameter at a time.
See [Note: FSDP1 checkpoints].
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecision

from shardkit.legacy.convert.plan import (
    CheckpointError,
    ConversionPlan,
    OutputTensor,
    TensorGroup,
    check_matches,
)
from shardkit.legacy.convert.safe_load import LocalShard, ShardedTensorRecord, load_torch_file
from shardkit.legacy.flat_layout import (
    FlatParamEntry,
    FlatParamLayout,
    FlatParamUnit,
    WrapPolicy,
    flat_param_layout,
)

__all__ = ["LocalCheckpoint", "local_plan"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalCheckpoint:
    """An FSDP1 LOCAL_STATE_DICT checkpoint: each rank's ``model.state_dict()`` in a file.

    The files do not say where each parameter lies in the flat shards: that comes from the
    model and the FSDP1 settings it was trained with, which must be given exactly.
    """

    files: Sequence[str | os.PathLike[str]]
    """One torch.save file per rank, in any order (each file records its rank)."""
    model: nn.Module
    """The model as given to FSDP1 (build it on the meta device: only shapes are read)."""
    world_size: int
    """Ranks in FSDP1's process group when it saved (the shard group under HYBRID_SHARD)."""
    auto_wrap_policy: WrapPolicy | None = None
    """FSDP1's ``auto_wrap_policy`` (or the module classes it wrapped); None: root only."""
    use_orig_params: bool = False
    """FSDP1's ``use_orig_params``."""
    mixed_precision: MixedPrecision | None = None
    """FSDP1's ``mixed_precision`` (its ``param_dtype`` moves the alignment padding)."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(
                f"LocalCheckpoint: world_size must be at least 1, not {self.world_size}"
            )
        if not self.files:
            raise ValueError("LocalCheckpoint: no files given (one per rank)")


@dataclass(frozen=True, slots=True)
class _RankFile:
    """One rank's file: its flat shards by unit key, and its plain tensors by name."""

    path: Path
    rank: int
    world_size: int
    flat: dict[str, LocalShard]
    plain: dict[str, torch.Tensor]


def _read_rank_file(path: Path) -> _RankFile:
    loaded = load_torch_file(path)
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{path}: holds a {type(loaded).__name__}, not a state dict")
    flat: dict[str, LocalShard] = {}
    plain: dict[str, torch.Tensor] = {}
    for key, value in loaded.items():
        if isinstance(value, ShardedTensorRecord):
            flat[key] = LocalShard.of(value, key, path)
        elif isinstance(value, torch.Tensor):
            plain[key] = value
        else:
            raise CheckpointError(f"{path}: {key} is a {type(value).__name__}, not a tensor")
    if not flat:
        raise CheckpointError(
            f"{path}: no ShardedTensor (<unit>._flat_param) in it: not an FSDP1 "
            "LOCAL_STATE_DICT (a FULL one converts with the full mode)"
        )
    saved_by = {(s.rank, s.world_size) for s in flat.values()}
    if len(saved_by) > 1:
        raise CheckpointError(
            f"{path}: its ShardedTensors record several (rank, world size): {sorted(saved_by)}"
        )
    ((rank, world_size),) = saved_by
    return _RankFile(path, rank, world_size, flat, plain)


def _in_rank_order(files: list[_RankFile], world_size: int) -> list[_RankFile]:
    """The files sorted by the rank each records, checked to be one per rank of one run."""
    sizes = sorted({f.world_size for f in files})
    if len(sizes) > 1:
        listing = ", ".join(f"{f.path} ({f.world_size} ranks)" for f in files)
        raise CheckpointError(f"the files come from runs of different world sizes: {listing}")
    if sizes[0] != world_size:
        raise CheckpointError(
            f"wrong world size: the files were saved by {sizes[0]} ranks (as each records), "
            f"but the conversion was told {world_size}"
        )
    by_rank: dict[int, list[Path]] = {}
    for f in files:
        by_rank.setdefault(f.rank, []).append(f.path)
    twice = {r: [str(p) for p in ps] for r, ps in by_rank.items() if len(ps) > 1}
    if twice:
        raise CheckpointError(f"several files of the same rank: {twice}")
    missing = [r for r in range(world_size) if r not in by_rank]
    if missing:
        raise CheckpointError(
            f"files of rank(s) {missing} are missing: {world_size} ranks saved, "
            f"{len(files)} file(s) given"
        )
    return sorted(files, key=lambda f: f.rank)


def _check_units(files: list[_RankFile], layout: FlatParamLayout, settings: str) -> None:
    """Each rank holds each unit's flat shard, of the size and place the layout gives."""
    expected = {u.state_dict_key: u for u in layout.units}
    for f in files:
        missing = sorted(set(expected) - set(f.flat))
        unexpected = sorted(set(f.flat) - set(expected))
        if missing or unexpected:
            raise CheckpointError(
                f"{f.path}: its units do not match the model and wrap policy: the layout "
                f"has {missing} that the file lacks, the file has {unexpected} that the "
                f"layout lacks ({settings})"
            )
        for key, shard in f.flat.items():
            _check_shard(f, key, shard, expected[key], settings)


def _check_shard(
    f: _RankFile, key: str, shard: LocalShard, unit: FlatParamUnit, settings: str
) -> None:
    if shard.numel != unit.numel:
        raise CheckpointError(
            f"{f.path}: unit {key} holds {shard.numel} elements in all, the model gives "
            f"{unit.numel} ({settings}): the model, wrap policy, use_orig_params or mixed "
            "precision differ from those FSDP1 had"
        )
    held = 0 if shard.data is None else shard.data.numel()
    place = unit.shard_offset(f.rank) if held else 0
    if held != unit.local_numel(f.rank) or shard.offset != place:
        raise CheckpointError(
            f"{f.path}: rank {f.rank}'s shard of {key} holds {held} elements at offset "
            f"{shard.offset}; at world size {unit.world_size} it would hold "
            f"{unit.local_numel(f.rank)} at {unit.shard_offset(f.rank)}"
        )
    if shard.data is not None and shard.data.dtype != unit.dtype:
        raise CheckpointError(
            f"{f.path}: {key} is {shard.data.dtype}, the model's parameters are {unit.dtype}"
        )


def _check_use_orig_params(files: list[_RankFile], spec: LocalCheckpoint) -> None:
    """With use_orig_params=True FSDP1 also saves each parameter under its own name."""
    names = {n for n, _ in spec.model.named_parameters(remove_duplicate=False)}
    for f in files:
        views = sorted(names & set(f.plain))
        if views and not spec.use_orig_params:
            raise CheckpointError(
                f"{f.path} holds the parameters' own names too ({views[:3]} ...): FSDP1 saved "
                "it with use_orig_params=True; convert with use_orig_params=True"
            )
        if spec.use_orig_params and not views:
            raise CheckpointError(
                f"{f.path} holds no parameter under its own name: FSDP1 saved it with "
                "use_orig_params=False; convert with use_orig_params=False"
            )


def _check_views(files: list[_RankFile], layout: FlatParamLayout) -> None:
    """Each parameter's saved view (use_orig_params=True) is the size the layout gives it.

    The units already agree in size; this catches alignment put in other places.
    """
    for f in files:
        for name, view in f.plain.items():
            try:
                unit, entry = layout.find(name)
            except KeyError:
                continue  # a buffer
            held = sum(p.stop - p.start for p in unit.pieces(entry) if p.rank == f.rank)
            if view.numel() != held:
                raise CheckpointError(
                    f"{f.path}: rank {f.rank} holds {view.numel()} elements of {name}, the "
                    f"layout puts {held} there: is mixed precision's param_dtype the one "
                    "FSDP1 had? (alignment counts in it)"
                )


def _check_keys(file: _RankFile, expected: dict[str, torch.Tensor], model: nn.Module) -> None:
    """The model's parameters are in the units by construction; the buffers must be there."""
    found = {
        k: (tuple(v.shape), v.dtype) for k, v in expected.items() if isinstance(v, nn.Parameter)
    }
    for key, value in file.plain.items():
        if key in found:
            continue  # a use_orig_params view, checked with the units
        # A buffer may be in MixedPrecision's buffer_dtype: it converts back to the model's.
        dtype = expected[key].dtype if key in expected else value.dtype
        found[key] = (tuple(value.shape), dtype)
    check_matches(found, model, f"the LOCAL state dict {file.path}")


def _read_param(files: list[_RankFile], unit: FlatParamUnit, entry: FlatParamEntry) -> torch.Tensor:
    """A parameter cut out of the ranks' shards of its unit (a view when in one piece)."""
    parts: list[torch.Tensor] = []
    for piece in unit.pieces(entry):
        data = files[piece.rank].flat[unit.state_dict_key].data
        assert data is not None, (unit.prefix, entry.fqn, piece)  # _check_units saw it held
        parts.append(data[piece.start : piece.stop])
    flat = parts[0] if len(parts) == 1 else torch.cat(parts)
    return entry.unflatten(flat)


def _read_buffer(file: _RankFile, key: str, dtype: torch.dtype) -> torch.Tensor:
    value = file.plain[key]
    if value.dtype == dtype:
        return value
    # MixedPrecision.buffer_dtype keeps buffers low precision, and LOCAL saves them so.
    logger.info(
        "%s: buffer %s is %s; written as the model's %s", file.path, key, value.dtype, dtype
    )
    return value.to(dtype)


def local_plan(spec: LocalCheckpoint) -> ConversionPlan:
    """Read and check every rank's file; the plan of one group per FSDP1 unit.

    Raises:
        CheckpointError: a file is unreadable or refused, the files are not one per rank of
            a run at ``spec.world_size``, or they do not match the model and settings.
    """
    files = _in_rank_order([_read_rank_file(Path(p)) for p in spec.files], spec.world_size)
    layout = flat_param_layout(
        spec.model,
        world_size=spec.world_size,
        auto_wrap_policy=spec.auto_wrap_policy,
        use_orig_params=spec.use_orig_params,
        mixed_precision=spec.mixed_precision,
    )
    param_dtype = None if spec.mixed_precision is None else spec.mixed_precision.param_dtype
    settings = (
        f"world size {spec.world_size}, use_orig_params={spec.use_orig_params}, "
        f"param_dtype={param_dtype}"
    )
    _check_use_orig_params(files, spec)
    _check_units(files, layout, settings)
    _check_views(files, layout)
    expected = spec.model.state_dict(keep_vars=True)
    _check_keys(files[0], expected, spec.model)
    buffers = {k: v for k, v in expected.items() if not isinstance(v, nn.Parameter)}
    groups = (*_unit_groups(files, layout, expected), _buffer_group(files[0], buffers))
    return ConversionPlan(
        source=f"LOCAL state dict of {spec.world_size} rank(s) ({files[0].path.parent})",
        groups=tuple(g for g in groups if g.tensors),
    )


def _unit_groups(
    files: list[_RankFile], layout: FlatParamLayout, expected: dict[str, torch.Tensor]
) -> tuple[TensorGroup, ...]:
    """One group per unit: each parameter under each of its state-dict keys."""
    keys: dict[int, list[str]] = {}
    for key, value in expected.items():
        if isinstance(value, nn.Parameter):
            keys.setdefault(id(value), []).append(key)
    groups = []
    for unit in layout.units:
        tensors = []
        for entry in unit.params:
            param = expected.get(entry.fqn)
            for key in keys.get(id(param), [entry.fqn]):
                read = _reader(files, unit, entry)
                tensors.append(OutputTensor(key, entry.shape, unit.dtype, read))
        groups.append(TensorGroup(unit.prefix or "(root)", tuple(tensors)))
    return tuple(groups)


def _reader(
    files: list[_RankFile], unit: FlatParamUnit, entry: FlatParamEntry
) -> Callable[[], torch.Tensor]:
    return lambda: _read_param(files, unit, entry)


def _buffer_group(file: _RankFile, buffers: dict[str, torch.Tensor]) -> TensorGroup:
    tensors = tuple(
        OutputTensor(key, tuple(b.shape), b.dtype, _buffer_reader(file, key, b.dtype))
        for key, b in buffers.items()
    )
    return TensorGroup("buffers", tensors)


def _buffer_reader(file: _RankFile, key: str, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    return lambda: _read_buffer(file, key, dtype)
