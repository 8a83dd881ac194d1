"""FULL_STATE_DICT files of torch's FSDP1 convert to DCP and safetensors, memory-mapped.

The safetensors output loads into shardkit.core with ``load_full_state_dict`` and into a plain
model with ``load_state_dict``; both train on with FSDP1's losses. The DCP output loads into
shardkit.core at another world size than FSDP1's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.legacy.convert_support import (
    FACTORY,
    SETTINGS,
    Fsdp1Run,
    Setting,
    assert_same_tensors,
    check_converted,
    convert,
    read_output,
    resume_single_process,
)

Checkpoints = Callable[[Setting], Fsdp1Run]


def test_full_to_safetensors(fsdp1_checkpoints: Checkpoints, tmp_path: Path) -> None:
    run = fsdp1_checkpoints(SETTINGS["W2-orig"])
    out = tmp_path / "model.safetensors"
    convert("full", str(run.folder / "full.pt"), "-o", str(out), "--model", FACTORY)
    check_converted(run, out)
    assert resume_single_process(out) == pytest.approx(run.after, rel=1e-5)


def test_full_to_dcp_loads_at_another_world_size(
    fsdp1_checkpoints: Checkpoints, tmp_path: Path
) -> None:
    run = fsdp1_checkpoints(SETTINGS["W2-flat"])
    out = tmp_path / "converted"
    convert("full", str(run.folder / "full.pt"), "-o", str(out))  # no model: nothing to check
    check_converted(run, out, world_sizes=(4,))


def test_a_nested_full_state_dict(fsdp1_checkpoints: Checkpoints, tmp_path: Path) -> None:
    """``{"model": sd, "step": 3}``: the model's entries are found under ``model``."""
    run = fsdp1_checkpoints(SETTINGS["W2-flat"])
    nested = tmp_path / "train_state.pt"
    torch.save({"model": run.full, "step": 3}, nested)
    out = tmp_path / "model.safetensors"
    convert("full", str(nested), "-o", str(out), "--model", FACTORY)
    assert_same_tensors(read_output(out), run.full)
