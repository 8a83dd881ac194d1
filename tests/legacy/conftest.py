"""Checkpoints written by torch's FSDP1, once per session and setting, for the converter tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.legacy.convert_support import Fsdp1Run, Setting, write_fsdp1_checkpoints


@pytest.fixture(scope="session")
def fsdp1_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Setting], Fsdp1Run]:
    """``get(setting)``: FSDP1's checkpoints in all three forms for that setting, and its run."""
    runs: dict[Setting, Fsdp1Run] = {}

    def get(setting: Setting) -> Fsdp1Run:
        if setting not in runs:
            folder = tmp_path_factory.mktemp(f"fsdp1_{setting.name}")
            runs[setting] = write_fsdp1_checkpoints(setting, folder)
        return runs[setting]

    return get
