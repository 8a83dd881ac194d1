"""One shardkit on every torch release of the tested range: the warning outside it, and the
names of torch releases newer than the installed one (implemented, or refused by name)."""

from __future__ import annotations

import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import shardkit.core as sk
from harness.pool import run_on_ranks
from shardkit.core import torch_release
from shardkit.core.engine import buffer_layout as group_layout_module
from shardkit.core.engine.buffer_layout import group_layout
from shardkit.core.engine.param_layout import ParamSpec
from shardkit.core.torch_release import UntestedTorchWarning, release_of, warn_if_untested


@pytest.mark.parametrize(
    ("version", "release"),
    [("2.13.0+cpu", (2, 13)), ("2.16.0.dev20261201+cu130", (2, 16)), ("2.10.0", (2, 10))],
)
def test_release_of_a_version_string(version: str, release: tuple[int, int]) -> None:
    assert release_of(version) == release


@pytest.mark.parametrize("version", ["2.10.0", "2.11.0+cu130", "2.13.0+cpu", "2.15.1"])
def test_no_warning_inside_the_tested_range(version: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_untested(version)


@pytest.mark.parametrize(("version", "side"), [("2.16.0", "newer"), ("2.9.1", "older")])
def test_a_warning_names_the_tested_range_outside_it(version: str, side: str) -> None:
    with pytest.warns(UntestedTorchWarning) as caught:
        warn_if_untested(version)
    message = str(caught[0].message)
    assert "tested on torch 2.10 to 2.15" in message
    assert f"torch {version} is {side}" in message


# What importing shardkit loads beyond what torch's own fully_shard and DTensor load: torch's
# compiler stack is most of a second of every process's start (each torchrun worker's).
_IMPORT_PROBE = """
import sys, warnings
warnings.simplefilter("error")
import torch.distributed.fsdp, torch.distributed.tensor, torch.distributed.tensor.parallel
before = set(sys.modules)
import shardkit.core, shardkit.tp, shardkit.legacy
added = sorted(set(sys.modules) - before)
print(" ".join(m for m in added if m.startswith(("torch._dynamo", "torch._inductor"))))
"""


def test_the_installed_torch_imports_shardkit_without_a_warning_or_the_compiler() -> None:
    # A fresh interpreter: the import-time check runs once per process.
    done = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [], "importing shardkit loaded torch's compiler"


def test_refusals_name_the_feature_and_the_release() -> None:
    missing = torch_release.not_in_shardkit("X(True)", "2.15", "it does Y")
    assert str(missing) == "X(True) (torch 2.15's FSDP2) is not implemented by shardkit: it does Y"


def _backward_finalization_body(rank: int, world_size: int) -> dict[str, Any]:
    # torch 2.15's manual finalization, on whatever torch is installed: two backwards without
    # gradient sync, then finalize_backward reduces once; gradients as one backward's.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    reference = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    reference.load_state_dict(model.state_dict())
    for layer in model:
        sk.fully_shard(layer, mesh=init_device_mesh("cpu", (world_size,)))
    root = sk.fully_shard(model)
    refused: list[str] = []

    def refuse(call: Any) -> None:
        try:
            call()
        except (NotImplementedError, RuntimeError) as error:
            refused.append(f"{type(error).__name__}: {error}")

    root.set_keep_unsharded_storage(False, recurse=False)
    before = root.finalize_backward()  # before the first forward: nothing to finalize
    model(torch.ones(3, 4)).sum().backward()  # automatic: the backward finalized itself
    refuse(root.finalize_backward)  # not under manual finalization
    inner = model[0]
    assert isinstance(inner, sk.FSDPModule)
    refuse(lambda: inner.set_manual_backward_finalization(True))  # not the root
    for p in model.parameters():
        p.grad = None
    root.set_manual_backward_finalization(True)
    root.set_requires_gradient_sync(False)
    x = torch.arange(24, dtype=torch.float32).reshape(6, 4) / 10 + rank
    for chunk in x.chunk(2):
        model(chunk).sum().backward()
    unreduced = [p.grad is None for p in model.parameters()]
    refuse(lambda: root.set_manual_backward_finalization(False))  # after backward started
    root.set_requires_gradient_sync(True)
    handle = root.finalize_backward(async_op=True)
    assert isinstance(handle, sk.GradientReductionHandle)
    in_flight = any(p.grad is None for p in model.parameters())  # the handle finishes it
    refuse(root.finalize_backward)  # before the handle's wait
    handle.wait()
    root.set_manual_backward_finalization(False)
    rows = torch.cat([x + r - rank for r in range(world_size)])
    reference(rows).sum().div(world_size).backward()
    return {
        "before": before,
        "refused": refused,
        "unreduced": unreduced,
        "in_flight": in_flight,
        "grads": [
            torch.allclose(_full(p.grad), _full(q.grad))
            for p, q in zip(model.parameters(), reference.parameters(), strict=True)
        ],
    }


def _full(grad: torch.Tensor | None) -> torch.Tensor:
    assert grad is not None
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def test_backward_finalization_of_torch_2_15() -> None:
    for result in run_on_ranks(2, _backward_finalization_body):
        automatic, not_root, changed, not_waited = result["refused"]
        assert "requires manual backward finalization" in automatic
        assert "must be called on the root" in not_root
        assert "cannot change mode after backward starts" in changed
        assert "previous gradient reduction must be waited on" in not_waited
        assert result["in_flight"]
        assert result["before"] is None
        assert all(result["unreduced"]) and all(result["grads"])


@pytest.mark.parametrize(
    ("from_2_15", "reduced_in"), [(False, torch.bfloat16), (True, torch.float32)]
)
def test_reduce_dtype_none_follows_the_installed_torchs_rule(
    monkeypatch: pytest.MonkeyPatch, from_2_15: bool, reduced_in: torch.dtype
) -> None:
    # torch 2.10-2.14 reduce in param_dtype, 2.15 in the parameters' own dtype.
    monkeypatch.setattr(group_layout_module, "REDUCES_IN_PARAM_DTYPE", from_2_15)
    spec = ParamSpec(fqn="w", shape=(4, 4), dtype=torch.float32)
    layout = group_layout([spec], shard_world=2, param_dtype=torch.bfloat16)
    assert layout.reduce_dtype == reduced_in
    fixed = group_layout(
        [spec], shard_world=2, param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16
    )
    assert fixed.reduce_dtype == torch.bfloat16
