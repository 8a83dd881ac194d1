"""Shared pieces of the converter tests: FSDP1's runs, reading outputs, resuming in shardkit.

An :class:`Fsdp1Run` is torch's FSDP1 training the tiny GPT for 2 SGD steps, writing its
checkpoints in the three forms, then training 3 more steps. A converted checkpoint loaded
into shardkit.core (or a plain model) must hold FSDP1's full state dict exactly, and training
it the same 3 steps must give FSDP1's losses.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from shardkit.legacy.convert.cli import main
from tests.core import models
from tests.core.ckpt_helpers import GLOBAL_BATCH, train
from tests.legacy import fsdp1_models, fsdp1_runs

FACTORY = "tests.legacy.fsdp1_models:tiny_gpt"
BLOCK = "shardkit.tools.plan.gpt:GPTBlock"


@dataclass(frozen=True)
class Setting:
    """How FSDP1 ran: world size, use_orig_params, mixed precision (None or "bf16")."""

    world_size: int
    use_orig_params: bool
    mp: str | None = None

    @property
    def name(self) -> str:
        return (
            f"W{self.world_size}_{'orig' if self.use_orig_params else 'flat'}_{self.mp or 'fp32'}"
        )

    def local_args(self) -> list[str]:
        """shardkit-convert's arguments for this setting's LOCAL files (after the files)."""
        args = ["--model", FACTORY, "--world-size", str(self.world_size), "--wrap", BLOCK]
        if self.use_orig_params:
            args.append("--use-orig-params")
        if self.mp:
            args += ["--param-dtype", self.mp]
        return args


SETTINGS = {
    "W2-flat": Setting(2, False),
    "W2-orig": Setting(2, True),
    "W2-orig-bf16": Setting(2, True, "bf16"),
    "W4-orig": Setting(4, True),
}


@dataclass(frozen=True)
class Fsdp1Run:
    """FSDP1's checkpoints of one setting, its full state dict at the save, and its losses."""

    setting: Setting
    folder: Path
    full: dict[str, torch.Tensor]
    after: list[float]

    @property
    def local_files(self) -> list[str]:
        return [str(self.folder / "local" / f"rank{r}.pt") for r in range(self.setting.world_size)]


def write_fsdp1_checkpoints(setting: Setting, folder: Path) -> Fsdp1Run:
    """Run FSDP1 on ``setting.world_size`` ranks; its checkpoints land in ``folder``."""
    results = run_on_ranks(
        setting.world_size,
        fsdp1_runs.write_checkpoints,
        out=str(folder),
        use_orig_params=setting.use_orig_params,
        mp=setting.mp,
        model="gpt",
    )
    return Fsdp1Run(setting, folder, results[0]["full"], results[0]["after"])


def convert(*args: str) -> None:
    """Run the console script's function; it must succeed."""
    assert main([*args, "--quiet"]) == 0, args


def read_dcp(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, read in this process."""
    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    values = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load(values, checkpoint_id=path, no_dist=True)
    return values


def read_output(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a converted checkpoint, DCP or safetensors."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        loaded: dict[str, torch.Tensor] = load_file(path)
        return loaded
    return read_dcp(path)


def assert_same_tensors(converted: dict[str, torch.Tensor], full: dict[str, torch.Tensor]) -> None:
    """The converted tensors are FSDP1's full state dict, key for key, bit for bit."""
    assert sorted(converted) == sorted(full)
    differ = [
        k for k, v in full.items() if v.dtype != converted[k].dtype or not v.equal(converted[k])
    ]
    assert differ == [], differ


def check_converted(
    run: Fsdp1Run, out: Path, world_sizes: tuple[int, ...] = (2,), rel: float = 1e-5
) -> None:
    """``out`` holds FSDP1's full state dict, and shardkit.core resumes from it at each of
    ``world_sizes`` with FSDP1's losses (to ``rel``)."""
    assert_same_tensors(read_output(out), run.full)
    for world_size in world_sizes:
        results = run_on_ranks(world_size, resume, path=str(out), mp=run.setting.mp)
        assert_same_tensors(results[0]["loaded"], run.full)
        assert results[0]["after"] == pytest.approx(run.after, rel=rel), world_size


def resume(rank: int, world_size: int, path: str, mp: str | None) -> dict[str, Any]:
    """Load a converted checkpoint into a shardkit.core model and train FSDP1's last 3 steps.

    DCP directories load with ``dcp.load(model.state_dict())``, safetensors files with
    ``load_full_state_dict``. Returns the losses and the loaded values.
    """
    from shardkit.core import MixedPrecisionPolicy, fully_shard, load_full_state_dict

    model = fsdp1_models.tiny_gpt(seed=7)  # other values than the checkpoint's
    mesh = init_device_mesh("cpu", (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if mp else None)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if path.endswith(".safetensors"):
        load_full_state_dict(model, path)
    else:
        dcp_load(model.state_dict(), checkpoint_id=path)
    loaded = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }
    opt = torch.optim.SGD(model.parameters(), lr=fsdp1_runs.LR)
    return {"loaded": loaded, "after": train(model, opt, fsdp1_runs.RESUMED, rank, world_size)}


def resume_single_process(path: Path) -> list[float]:
    """A plain model loads the safetensors file and trains FSDP1's last 3 steps alone."""
    from safetensors.torch import load_file

    model = fsdp1_models.tiny_gpt(seed=7)
    model.load_state_dict(load_file(path))
    opt = torch.optim.SGD(model.parameters(), lr=fsdp1_runs.LR)
    losses = []
    for step in fsdp1_runs.RESUMED:
        x, y = models.batch("gpt", step, GLOBAL_BATCH)
        loss = models.loss_of("gpt", model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


class Payload:
    """A pickle that would touch a file if it were ever unpickled (weights_only refuses it)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))
