"""The converter holds about one FSDP1 unit in memory, not the model.

FSDP1 shards a stack of 24 equal layers, each its own unit, so the largest unit is 1/24 of
the model. Converting each form to each output, the bytes of tensor memory alive at once
(storages made by operators; memory-mapped input pages do not count, see memory_support)
stay within two units: the tensor being written and, for SHARDED input, the chunk DCP reads
into it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from harness.pool import run_on_ranks
from shardkit.legacy import (
    Fsdp1Checkpoint,
    FullCheckpoint,
    LocalCheckpoint,
    ShardedCheckpoint,
    convert_checkpoint,
    flat_param_layout,
)
from tests.legacy import fsdp1_models, fsdp1_runs
from tests.legacy.convert_support import read_output
from tests.legacy.memory_support import HeldBytes


@pytest.fixture(scope="module")
def stack_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """FSDP1's checkpoints of the stack at W=2, and the model's bytes."""
    folder = tmp_path_factory.mktemp("stack")
    total = run_on_ranks(2, fsdp1_runs.write_stack_checkpoints, out=str(folder))[0]
    return folder, total


def _meta_stack() -> nn.Module:
    with torch.device("meta"):
        return fsdp1_models.stack()


def _source(mode: str, folder: Path) -> Fsdp1Checkpoint:
    if mode == "full":
        return FullCheckpoint(path=folder / "full.pt")
    if mode == "sharded":
        return ShardedCheckpoint(path=folder / "sharded", model=_meta_stack())
    files = [folder / "local" / f"rank{r}.pt" for r in range(2)]
    return LocalCheckpoint(
        files=files, model=_meta_stack(), world_size=2, auto_wrap_policy={nn.Linear}
    )


@pytest.mark.parametrize("mode", ["local", "sharded", "full"])
@pytest.mark.parametrize("output", ["converted", "model.safetensors"])
def test_memory_stays_near_the_largest_unit(
    stack_checkpoints: tuple[Path, int], mode: str, output: str, tmp_path: Path
) -> None:
    folder, total = stack_checkpoints
    layout = flat_param_layout(_meta_stack(), world_size=2, auto_wrap_policy={nn.Linear})
    largest = max(u.numel * u.dtype.itemsize for u in layout.units)
    assert total >= 20 * largest  # the premise: units are small parts of the model
    with HeldBytes() as held:
        convert_checkpoint(_source(mode, folder), tmp_path / output)
    assert held.peak <= 2 * largest, (held.peak, largest, total)
    expected = torch.load(folder / "full.pt", weights_only=True)
    converted = read_output(tmp_path / output)
    assert sorted(converted) == sorted(expected)
    assert all(converted[k].equal(v) for k, v in expected.items())


def test_the_count_sees_a_file_read_whole(stack_checkpoints: tuple[Path, int]) -> None:
    """What the bound guards against: without a memory map, the whole file is held."""
    folder, total = stack_checkpoints
    with HeldBytes() as held:
        torch.load(folder / "full.pt", weights_only=True)
    assert held.peak >= total
    with HeldBytes() as held:
        torch.load(folder / "full.pt", weights_only=True, mmap=True)
    assert held.peak == 0
