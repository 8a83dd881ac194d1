"""Writing a conversion plan: a DCP checkpoint or one safetensors file, a tensor at a time.

Both outputs appear complete or not at all: they are written under a temporary name next to
the target and renamed when done, and removed on any error. Each tensor is read from the
input when the writer asks for it and let go once written. A line is logged per group.

DCP: ``dcp.save`` in this one process, from a state dict of meta tensors (shapes and dtypes
are all planning needs); a save planner reads each tensor when DCP resolves it. DCP keeps
every tensor of a data file alive until that file is written, hence one file per tensor.
The checkpoint has one chunk per tensor; ``dcp.load`` reads any part of it, so it loads
into models sharded at any world size.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from shardkit.core import write_state_dict_file
from shardkit.legacy.convert.plan import ConversionPlan, OutputTensor
from shardkit.legacy.convert.sharded import first_failure, without_process_group

__all__ = ["output_format", "write_dcp", "write_safetensors"]

logger = logging.getLogger(__name__)


def output_format(path: Path) -> str:
    """'safetensors' for a ``.safetensors`` path, else 'dcp' (a checkpoint directory)."""
    return "safetensors" if path.suffix == ".safetensors" else "dcp"


class _Progress:
    """Logs a line when the first tensor of each group is read, and a summary at the end."""

    def __init__(self, plan: ConversionPlan, output: Path) -> None:
        self._first = {g.tensors[0].key: (i, g) for i, g in enumerate(plan.groups) if g.tensors}
        self._count = len(plan.groups)
        self._output = output
        self._started = time.perf_counter()
        logger.info("converting %s to %s", plan.source, output)

    def reading(self, tensor: OutputTensor) -> None:
        if tensor.key in self._first:
            index, group = self._first[tensor.key]
            logger.info(
                "[%d/%d] %s: %d tensor(s), %s",
                index + 1,
                self._count,
                group.name,
                len(group.tensors),
                _size(group.nbytes),
            )

    def done(self, plan: ConversionPlan) -> None:
        total = sum(t.nbytes for t in plan.tensors())
        elapsed = time.perf_counter() - self._started
        logger.info("wrote %s (%s) in %.1f s", self._output, _size(total), elapsed)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _temporary(output: Path) -> Path:
    return output.with_name(f".{output.name}.partial-{os.getpid()}")


def _read(tensor: OutputTensor, progress: _Progress) -> torch.Tensor:
    progress.reading(tensor)
    value = tensor.read()
    assert tuple(value.shape) == tensor.shape and value.dtype == tensor.dtype, tensor.key
    return value


def write_safetensors(plan: ConversionPlan, output: Path) -> None:
    """Write ``plan`` to one safetensors file at ``output``."""
    progress = _Progress(plan, output)
    expected = {t.key: torch.empty(t.shape, dtype=t.dtype, device="meta") for t in plan.tensors()}

    def produce() -> Iterator[tuple[str, torch.Tensor]]:
        for tensor in plan.tensors():
            yield tensor.key, _read(tensor, progress)

    write_state_dict_file(output, expected, produce())
    progress.done(plan)


class _StreamingPlanner(DefaultSavePlanner):
    """Plans from meta tensors; reads each tensor only when DCP asks for its data."""

    def __init__(self, tensors: dict[str, OutputTensor], progress: _Progress) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._tensors = tensors
        self._progress = progress

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return _read(self._tensors[write_item.index.fqn], self._progress)


def write_dcp(plan: ConversionPlan, output: Path, prefix: str = "") -> None:
    """Write ``plan`` as a DCP checkpoint directory at ``output``, keys under ``prefix``."""
    progress = _Progress(plan, output)
    at = f"{prefix.rstrip('.')}." if prefix else ""
    tensors = {f"{at}{t.key}": t for t in plan.tensors()}
    layout = {k: torch.empty(t.shape, dtype=t.dtype, device="meta") for k, t in tensors.items()}
    temporary = _temporary(output)
    writer = FileSystemWriter(temporary, single_file_per_rank=False, thread_count=1)
    try:
        with without_process_group():
            dcp_save(
                layout,
                storage_writer=writer,
                planner=_StreamingPlanner(tensors, progress),
                no_dist=True,
            )
    except CheckpointException as err:  # DCP's wrapping of what a read or write raised
        shutil.rmtree(temporary, ignore_errors=True)
        failure = first_failure(err)
        if isinstance(failure, OSError) and failure.filename is None:  # ENOSPC from a write
            raise OSError(failure.errno, failure.strerror or str(failure), str(output)) from None
        raise failure from None
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    temporary.rename(output)
    progress.done(plan)
