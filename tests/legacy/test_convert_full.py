"""FULL_STATE_DICT files of torch's FSDP1 convert to DCP and safetensors, memory-mapped.

The safetensors output loads into shardkit.core with ``load_full_state_dict`` and into a plain
model with ``load_state_dict``; both train on with FSDP1's losses. The DCP output loads into
shardkit.core at another world size than FSDP1's.
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.core.file_mutations import rewrite_zip
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


@pytest.mark.parametrize("output", ["model.safetensors", "converted"])
def test_deflate_compressed_records_convert_as_torch_reads_them(
    output: str, tmp_path: Path
) -> None:
    # A valid torch.save file with its records DEFLATE-compressed (torch.load decompresses
    # them): mapped, the converter once wrote the compressed bytes as tensor data.
    source = tmp_path / "full.pt"
    state = {"a.weight": torch.randn(40, 30), "b.bias": torch.arange(7, dtype=torch.int64)}
    torch.save(state, source)
    source.write_bytes(rewrite_zip(source.read_bytes(), lambda _: zipfile.ZIP_DEFLATED))
    with zipfile.ZipFile(source) as archive:
        assert {i.compress_type for i in archive.infolist()} == {zipfile.ZIP_DEFLATED}
    out = tmp_path / output
    convert("full", str(source), "-o", str(out))
    assert_same_tensors(read_output(out), torch.load(source, weights_only=True))
    assert_same_tensors(read_output(out), state)
