"""With shardkit-legacy installed, ``patch_torch`` makes torch's FSDP1 names shardkit.legacy's.

The core finds legacy's patch through an entry point (the core knows nothing of legacy). FSDP1
code that takes its wrapper, enums and wrap policies from ``torch.distributed.fsdp`` then runs
on shardkit.legacy, and trains as torch's FSDP1 does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp.fully_sharded_data_parallel as torch_fsdp1_module
import torch.distributed.fsdp.wrap as torch_wrap

import shardkit.core as sk
import shardkit.legacy as legacy
from harness.pool import run_on_ranks
from shardkit.legacy import fully_sharded_data_parallel, wrap
from tests.legacy.legacy_parity import LegacyRun, assert_close_traces, train, wrap_model

# torch's wrap module names that shardkit.legacy.wrap provides.
WRAP_NAMES = sorted(set(torch_wrap.__all__) & set(wrap.__all__))


@pytest.fixture(autouse=True)
def _unpatched() -> Iterator[None]:
    assert not sk.is_torch_patched()
    yield
    sk.unpatch_torch()


def test_fsdp1_names_are_legacys_while_patched() -> None:
    before = {n: getattr(torch_fsdp, n) for n in fully_sharded_data_parallel.__all__}
    before_wrap = {n: getattr(torch_wrap, n) for n in WRAP_NAMES}
    assert "ModuleWrapPolicy" in WRAP_NAMES and "transformer_auto_wrap_policy" in WRAP_NAMES
    with sk.patched_torch():
        for name in before:
            assert getattr(torch_fsdp, name) is getattr(legacy, name), name
            # Where FSDP1 is defined: Accelerate imports the wrapper from there.
            assert getattr(torch_fsdp1_module, name) is getattr(legacy, name), name
        for name in before_wrap:
            assert getattr(torch_wrap, name) is getattr(wrap, name), name
        assert vars(torch_fsdp)["fully_shard"] is sk.fully_shard  # the core's names too
    assert {n: getattr(torch_fsdp, n) for n in before} == before
    assert {n: getattr(torch_fsdp1_module, n) for n in before} == before
    assert {n: getattr(torch_wrap, n) for n in WRAP_NAMES} == before_wrap


def _patched_fsdp1_body(rank: int, world_size: int, run: LegacyRun) -> dict[str, Any]:
    # "torch" takes FSDP, ShardingStrategy and ModuleWrapPolicy from torch.distributed.fsdp.
    with sk.patched_torch():
        patched = train("torch", run, rank, world_size)
        module = type(wrap_model("torch", run)).__module__  # what such code really builds
    return {"patched": patched, "torch": train("torch", run, rank, world_size), "module": module}


def test_fsdp1_code_on_torchs_names_trains_on_legacy_as_torch() -> None:
    run = LegacyRun(model="mlp", strategy="FULL_SHARD", wrap="blocks", steps=4)
    for result in run_on_ranks(2, _patched_fsdp1_body, run=run):
        assert result["module"] == "shardkit.legacy.wrapper"
        assert_close_traces(result["patched"], result["torch"], what="patched FSDP1")
