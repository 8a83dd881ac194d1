"""SHARDED_STATE_DICT checkpoints of torch's FSDP1 (DCP, ShardedTensor chunks) convert exactly.

FSDP1 saves ``{"model": model.state_dict()}`` through DCP on 2 ranks. The converter reads it
in this one process, finding the ``model.`` prefix from the model's keys (or told it), and
writes DCP or safetensors holding FSDP1's full state dict; shardkit.core trains on from both
with FSDP1's losses.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.legacy.convert_support import (
    FACTORY,
    SETTINGS,
    Fsdp1Run,
    Setting,
    assert_same_tensors,
    check_converted,
    convert,
    read_output,
)

Checkpoints = Callable[[Setting], Fsdp1Run]


@pytest.mark.parametrize("name", ["W2-flat", "W2-orig"])
@pytest.mark.parametrize("output", ["converted", "model.safetensors"])
def test_sharded_converts(
    fsdp1_checkpoints: Checkpoints, name: str, output: str, tmp_path: Path
) -> None:
    run = fsdp1_checkpoints(SETTINGS[name])
    out = tmp_path / output
    convert("sharded", str(run.folder / "sharded"), "-o", str(out), "--model", FACTORY)
    check_converted(run, out)


def test_sharded_without_a_model(fsdp1_checkpoints: Checkpoints, tmp_path: Path) -> None:
    """Told the prefix, no model needed; the output's keys can go under a prefix again."""
    run = fsdp1_checkpoints(SETTINGS["W2-flat"])
    out = tmp_path / "converted"
    convert("sharded", str(run.folder / "sharded"), "-o", str(out), "--prefix", "model",
            "--output-prefix", "model")  # fmt: skip
    converted = read_output(out)
    assert_same_tensors({k.removeprefix("model."): v for k, v in converted.items()}, run.full)
    assert all(k.startswith("model.") for k in converted)
