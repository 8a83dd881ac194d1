"""``convert_checkpoint``: an FSDP1 checkpoint in, a DCP checkpoint or a safetensors file out."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from shardkit.legacy.convert.full import FullCheckpoint, full_plan
from shardkit.legacy.convert.local import LocalCheckpoint, local_plan
from shardkit.legacy.convert.plan import CheckpointError, ConversionPlan
from shardkit.legacy.convert.sharded import ShardedCheckpoint, sharded_plan
from shardkit.legacy.convert.writers import output_format, write_dcp, write_safetensors

__all__ = ["ConversionResult", "Fsdp1Checkpoint", "convert_checkpoint"]

Fsdp1Checkpoint = FullCheckpoint | ShardedCheckpoint | LocalCheckpoint
"""An FSDP1 checkpoint in one of its three forms."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ConversionResult:
    """What :func:`convert_checkpoint` wrote."""

    output: Path
    format: str
    """"dcp" or "safetensors"."""
    tensors: int
    nbytes: int
    """Bytes of tensor data written."""
    groups: int
    """FSDP1 units (LOCAL) or layers (FULL, SHARDED) converted one after the other."""


def _plan(source: Fsdp1Checkpoint) -> ConversionPlan:
    if isinstance(source, LocalCheckpoint):
        return local_plan(source)
    if isinstance(source, ShardedCheckpoint):
        return sharded_plan(source)
    return full_plan(source)


def convert_checkpoint(
    source: Fsdp1Checkpoint, output: str | os.PathLike[str], *, output_prefix: str = ""
) -> ConversionResult:
    """Convert an FSDP1 checkpoint for shardkit.core (or any FSDP2 model) to load.

    Runs in one process, without a process group or GPU. Everything that can be checked is
    checked before anything is written: the files are readable (nothing but tensors and
    plain data is unpickled), LOCAL files are one per rank of a run at the given world size,
    and the checkpoint matches the model when one is given. Tensors are then read one at a
    time and written out, so memory holds about one tensor.

    Args:
        source: the checkpoint: :class:`FullCheckpoint`, :class:`ShardedCheckpoint` or
            :class:`LocalCheckpoint`.
        output: a ``.safetensors`` path for one file of full tensors (for
            ``shardkit.core.load_full_state_dict``, or ``load_state_dict`` of a plain
            model); any other path becomes a DCP checkpoint directory, which ``dcp.load``
            reads into a model sharded at any world size. It must not exist yet.
        output_prefix: DCP only: keys go under this prefix (``model`` for a checkpoint
            loaded as ``dcp.load({"model": model.state_dict()}, ...)``).

    Raises:
        CheckpointError: the checkpoint is unreadable, refused, incomplete or does not match
            (the message names the file, key or unit); nothing is written.
        FileExistsError: ``output`` exists.
    """
    target = Path(output)
    if target.exists():
        raise FileExistsError(f"{target}: already exists; convert to a new path")
    kind = output_format(target)
    if output_prefix and kind != "dcp":
        raise ValueError("output_prefix applies to DCP output only")
    plan = _plan(source)
    if not any(group.tensors for group in plan.groups):
        raise CheckpointError(f"{plan.source}: nothing to convert")
    target.parent.mkdir(parents=True, exist_ok=True)
    if kind == "safetensors":
        write_safetensors(plan, target)
    else:
        write_dcp(plan, target, output_prefix)
    tensors = list(plan.tensors())
    return ConversionResult(
        output=target,
        format=kind,
        tensors=len(tensors),
        nbytes=sum(t.nbytes for t in tensors),
        groups=len(plan.groups),
    )
