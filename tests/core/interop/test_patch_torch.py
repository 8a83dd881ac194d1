"""``patch_torch``: torch's FSDP names resolve to shardkit's, reversibly, and programs run.

The oracle is torch itself: the same FSDP2 program (``fsdp2_example.py``, written against
``torch.distributed.fsdp``) trained unpatched on torch's ``fully_shard`` and patched on
shardkit's gives bit-identical losses at W=2, and a checkpoint one engine saves, the other
resumes from, continuing as the saving run would have.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import shardkit.core as sk
from harness.pool import run_on_ranks
from shardkit.core import torch_patch
from shardkit.core.replicate_api import is_composable_with_replicate
from tests.core.interop.fsdp2_example import Plan, train
from tests.core.torch_releases import torch_has

REPO = Path(__file__).resolve().parents[3]
WORLD_SIZE = 2
FSDP2_NAMES = {
    "fully_shard": sk.fully_shard,
    "FSDPModule": sk.FSDPModule,
    "MixedPrecisionPolicy": sk.MixedPrecisionPolicy,
    "CPUOffloadPolicy": sk.CPUOffloadPolicy,
    "OffloadPolicy": sk.OffloadPolicy,
    "UnshardHandle": sk.UnshardHandle,
    "register_fsdp_forward_method": sk.register_fsdp_forward_method,
    "DataParallelMeshDims": sk.DataParallelMeshDims,
    "share_comm_ctx": sk.share_comm_ctx,
    "GradientReductionHandle": sk.GradientReductionHandle,
}
# torch's replicate on FSDP's engine, where torch's pipelining imports it.
REPLICATE_NAMES = {
    "replicate": sk.replicate,
    "ReplicateModule": sk.ReplicateModule,
    "is_composable_with_replicate": is_composable_with_replicate,
}
PATCHED = {**FSDP2_NAMES, **REPLICATE_NAMES}
# The names the installed torch has (DataParallelMeshDims from 2.12, GradientReductionHandle
# from 2.15): the patch replaces those and adds no other.
_TORCHS = {name for name in FSDP2_NAMES if torch_has(name)}
# Where libraries import torch's FSDP2 names, and which of them each module has.
WHERE = {
    "torch.distributed.fsdp": _TORCHS,
    "torch.distributed.fsdp._fully_shard": _TORCHS,
    "torch.distributed._composable.fsdp": {
        "fully_shard", "FSDPModule", "MixedPrecisionPolicy", "CPUOffloadPolicy",
        "OffloadPolicy", "register_fsdp_forward_method",
    },
    "torch.distributed._composable.fsdp.fully_shard": {
        "fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method",
    },
    "torch.distributed._composable.replicate_with_fsdp": set(REPLICATE_NAMES),
}  # fmt: skip


def _torch_names() -> dict[tuple[str, str], object]:
    """What each patched name is bound to right now."""
    return {
        (module, name): getattr(importlib.import_module(module), name)
        for module, names in WHERE.items()
        for name in names
    }


@pytest.fixture(autouse=True)
def _unpatched() -> Iterator[None]:
    """Every test starts and ends with torch's own names (a failed test must not leak)."""
    assert not sk.is_torch_patched()
    yield
    sk.unpatch_torch()


def test_patch_replaces_every_name_and_unpatch_restores_torchs() -> None:
    before = _torch_names()
    assert all(type(v).__module__ != "shardkit" for v in before.values())
    sk.patch_torch()
    assert sk.is_torch_patched()
    for (module, name), value in _torch_names().items():
        assert value is PATCHED[name], (module, name)
    sk.unpatch_torch()
    assert not sk.is_torch_patched()
    after = _torch_names()
    assert {k: v for k, v in after.items() if v is not before[k]} == {}


def test_patch_twice_is_once_and_unpatch_twice_is_once() -> None:
    before = _torch_names()
    sk.patch_torch()
    sk.patch_torch()  # must not record shardkit's objects as "torch's originals"
    sk.unpatch_torch()
    assert _torch_names() == before
    sk.unpatch_torch()
    assert _torch_names() == before


def test_the_context_manager_restores_and_keeps_an_outer_patch() -> None:
    import torch.distributed.fsdp as torch_fsdp

    def bound() -> object:
        return torch_fsdp.fully_shard

    original, ours = bound(), sk.fully_shard
    with sk.patched_torch():
        assert bound() is ours
    assert bound() is original
    sk.patch_torch()
    with sk.patched_torch():
        pass
    assert bound() is ours  # the outer patch is still in effect


def test_a_failing_patch_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _torch_names()

    def missing_name() -> dict[str, dict[str, object]]:
        return {"torch.distributed.fsdp": {"NoSuchName": object()}}

    def broken() -> dict[str, dict[str, object]]:
        raise ImportError("a dependency is missing")

    def other_fully_shard() -> dict[str, dict[str, object]]:
        return {"torch.distributed.fsdp": {"fully_shard": object()}}

    cases = [
        (missing_name, "torch.distributed.fsdp.NoSuchName, which torch does not have"),
        (broken, "the patch of demo (demo:hook) failed: ImportError"),
        (other_fully_shard, "shardkit.core and demo (demo:hook) both replace"),
    ]
    for hook, message in cases:
        monkeypatch.setattr(torch_patch, "_registered", lambda h=hook: [("demo (demo:hook)", h)])
        with pytest.raises(RuntimeError, match=re.escape(message)):
            sk.patch_torch()
        assert not sk.is_torch_patched()
        assert _torch_names() == before


def test_torchs_internal_users_keep_torchs_objects() -> None:
    # DCP's helpers bind FSDP1's class at import and call its class methods on any model; a
    # patch made before they were imported must not hand them another class.
    with sk.patched_torch():
        from torch.distributed.checkpoint import state_dict as dcp_state_dict
    from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel

    assert vars(dcp_state_dict)["FSDP"] is FullyShardedDataParallel


def _root_after_blocks_body(rank: int, world_size: int) -> dict[str, Any]:
    from torch import nn

    from tests.core import models

    with sk.patched_torch():
        from torch.distributed.fsdp import FSDPModule, fully_shard

        model = models.build("mlp")
        for block in model.blocks:
            fully_shard(block)
        try:
            fully_shard(model)
        except ValueError as err:
            return {"error": str(err)}
        torch_managed = nn.Sequential(nn.Linear(2, 2))
        from torch.distributed.fsdp._fully_shard._fully_shard import (
            fully_shard as torch_fully_shard,
        )

        torch_fully_shard(torch_managed[0])
        try:
            fully_shard(torch_managed[0])
        except ValueError as err:
            refused = "already managed by torch's FSDP" in str(err)
        else:
            refused = False
        return {"error": None, "root": isinstance(model, FSDPModule), "refused": refused}


def test_the_root_fully_shard_under_the_patch() -> None:
    """Shardkit's blocks are not "torch's FSDP" when torch's names are shardkit's."""
    for result in run_on_ranks(WORLD_SIZE, _root_after_blocks_body):
        assert result == {"error": None, "root": True, "refused": True}


@contextlib.contextmanager
def _engine(engine: str) -> Iterator[None]:
    if engine == "shardkit":
        with sk.patched_torch():
            yield
    else:
        assert not sk.is_torch_patched()
        yield


def _train_body(rank: int, world_size: int, engine: str, **plan: Any) -> dict[str, Any]:
    steps = plan.pop("steps")
    run = Plan(steps=range(*steps), **plan)
    with _engine(engine):
        losses = train(run)
    return {"losses": losses, "checks": run.checks}


def _train(engine: str, **plan: Any) -> dict[str, Any]:
    results = run_on_ranks(WORLD_SIZE, _train_body, engine=engine, **plan)
    assert results[0] == results[1]  # losses are global; checks are per rank, the same
    return results[0]


# Where each engine makes its FSDP<Cls> classes (torch: _fully_shard up to 2.10, _fsdp_init
# from 2.11; the package is the same).
ENGINE_MODULES = {
    "torch": "torch.distributed.fsdp._fully_shard.",
    "shardkit": "shardkit.core.api",
}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_the_example_program_patched_trains_as_torch(bf16: bool) -> None:
    runs = {engine: _train(engine, steps=(0, 4), bf16=bf16) for engine in ENGINE_MODULES}
    for engine, run in runs.items():
        # Each engine really ran: its own FSDP<Cls> classes, all 5 modules FSDPModules.
        assert run["checks"]["fsdp_modules"] == 5
        assert run["checks"]["class_module"].startswith(ENGINE_MODULES[engine]), run["checks"]
    assert runs["shardkit"]["losses"] == runs["torch"]["losses"]  # bit-identical
    assert runs["torch"]["losses"][-1] < runs["torch"]["losses"][0]


@pytest.fixture(scope="module")
def uninterrupted() -> dict[str, list[float]]:
    """Each engine's losses over 5 steps without a stop."""
    return {engine: _train(engine, steps=(0, 5))["losses"] for engine in ENGINE_MODULES}


@pytest.mark.parametrize("kind", ["dcp", "full"])
@pytest.mark.parametrize(
    ("saver", "loader"), [("torch", "shardkit"), ("shardkit", "torch")], ids=["t2s", "s2t"]
)
def test_a_checkpoint_of_one_engine_resumes_on_the_other(
    uninterrupted: dict[str, list[float]], tmp_path: Path, kind: str, saver: str, loader: str
) -> None:
    path = str(tmp_path / ("ckpt" if kind == "dcp" else "full.pt"))
    whole = uninterrupted[saver]
    saved = _train(saver, steps=(0, 2), **{f"save_{kind}": path})["losses"]
    resumed = _train(loader, steps=(2, 5), **{f"load_{kind}": path})["losses"]
    assert saved == whole[:2]
    assert resumed == whole[2:]


def test_the_launcher_runs_the_program_on_shardkit_under_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "losses.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "shardkit.core.run", str(REPO / "tests/core/interop/fsdp2_example.py")]
    cmd += ["--steps", "3", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    job = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert job.returncode == 0, (job.stdout + job.stderr)[-3000:]
    report = json.loads(out.read_text())
    assert report["engine"] == "shardkit.core.api"
    assert report["checks"]["class_module"] == "shardkit.core.api"
    assert report["losses"] == _train("torch", steps=(0, 3))["losses"]


def _run_launcher(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "shardkit.core.run", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_the_launcher_runs_scripts_and_modules_as_python_does(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(
        "import sys\nfrom torch.distributed.fsdp import fully_shard\n"
        "import helper\nprint(fully_shard.__module__, __name__, sys.argv[1:], helper.X)\n"
    )
    (tmp_path / "helper.py").write_text("X = 'beside the script'\n")
    job = _run_launcher(str(script), "a", "--flag")
    assert job.returncode == 0, job.stderr
    assert job.stdout.split("\n")[0] == (
        "shardkit.core.api __main__ ['a', '--flag'] beside the script"
    )
    job = _run_launcher("-m", "json.tool", "--help")  # a module, with its own arguments
    assert job.returncode == 0 and "json.tool" in job.stdout, job.stderr
    job = _run_launcher()
    assert job.returncode == 2 and "give a script, or -m and a module" in job.stderr
