"""LOCAL_STATE_DICT checkpoints of torch's FSDP1 convert exactly, and train on in shardkit.

FSDP1 trains the tiny GPT (3 blocks wrapped as units, tied head, uneven sizes) and each rank
saves its LOCAL state dict. The converter, in this one process, rebuilds every parameter from
the flat shards: the DCP and safetensors outputs must equal FSDP1's full state dict bit for
bit, and shardkit.core models loaded from them at other world sizes must train on with FSDP1's
losses.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.legacy.convert_support import SETTINGS, Fsdp1Run, Setting, check_converted, convert

Checkpoints = Callable[[Setting], Fsdp1Run]
# Where shardkit resumes each setting's checkpoint: other world sizes than FSDP1's too.
RESUME_AT = {"W2-flat": (1, 2), "W2-orig": (2, 4), "W2-orig-bf16": (2,), "W4-orig": (2,)}


def _tolerance(setting: Setting) -> float:
    # bf16 compute and reduction: rounding differs with the world size (3e-4 seen at W=4).
    return 1e-3 if setting.mp else 1e-5


@pytest.mark.parametrize("name", list(SETTINGS))
def test_local_to_dcp(fsdp1_checkpoints: Checkpoints, name: str, tmp_path: Path) -> None:
    run = fsdp1_checkpoints(SETTINGS[name])
    out = tmp_path / "converted"
    convert("local", *reversed(run.local_files), "-o", str(out), *run.setting.local_args())
    check_converted(run, out, RESUME_AT[name], _tolerance(run.setting))


@pytest.mark.parametrize("name", ["W2-flat", "W2-orig-bf16"])
def test_local_to_safetensors(fsdp1_checkpoints: Checkpoints, name: str, tmp_path: Path) -> None:
    run = fsdp1_checkpoints(SETTINGS[name])
    out = tmp_path / "model.safetensors"
    convert("local", *run.local_files, "-o", str(out), *run.setting.local_args())
    check_converted(run, out, rel=_tolerance(run.setting))
