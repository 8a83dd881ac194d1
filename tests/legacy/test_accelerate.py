"""Accelerate's FSDP1 plugin, on shardkit.legacy through ``patch_torch``, as on torch's FSDP1.

Accelerate imports FSDP1's wrapper and enums from
``torch.distributed.fsdp.fully_sharded_data_parallel`` when it prepares a model and when it saves
or loads state; under the patch those names are shardkit.legacy's, so ``prepare`` wraps the model
with shardkit.legacy and ``save_state`` / ``load_state`` go through its state-dict and
optimizer-state APIs. Accelerate treats a CPU-only machine as plain multi-CPU data parallelism,
so the job here sets its distributed type to FSDP by hand, as users of CPU FSDP must.

Torch's FSDP1 is the oracle where it runs on CPU: the losses before the save, and the losses
after ``load_state`` with SHARDED_STATE_DICT. With FULL_STATE_DICT torch's FSDP1 dies in
``save_state`` on CPU; shardkit's must save, load and resume to the same losses.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from harness.pool import run_on_ranks
from shardkit.core import patched_torch

STEPS_BEFORE_SAVE = 3
STEPS_AFTER_SAVE = 2
RUNS = [
    ("SHARDED_STATE_DICT", True),
    ("SHARDED_STATE_DICT", False),
    ("FULL_STATE_DICT", True),
]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def _accelerate_job(state_dict_type: str, optimizer_first: bool, folder: Path) -> dict[str, Any]:
    """Train, ``save_state``, train on, ``load_state``, and train the same batches again."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=1,
        state_dict_type=state_dict_type,
        use_orig_params=True,
        auto_wrap_policy="size_based_wrap",
        min_num_params=100,
        cpu_ram_efficient_loading=False,
        sync_module_states=False,
    )
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
    # Accelerate hands FSDP1 device_id=cpu:0, which torch's FSDP1 refuses for CPU modules.
    accelerator_device = vars(Accelerator)["device"]
    Accelerator.device = property(lambda self: torch.device("cpu"))
    # What makes Accelerate use its FSDP path on a machine without accelerators.
    for state in (accelerator.state, PartialState()):
        state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    try:
        model = _model()
        if optimizer_first:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            model, optimizer = accelerator.prepare(model, optimizer)
        else:
            model = accelerator.prepare(model)
            optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
        batches = torch.Generator().manual_seed(1 + torch.distributed.get_rank())

        def step() -> float:
            loss = model(torch.randn(8, 16, generator=batches)).square().mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            return float(loss.item())

        before = [step() for _ in range(STEPS_BEFORE_SAVE)]
        out: dict[str, Any] = {"wrapper": type(model).__module__, "before": before}
        accelerator.save_state(str(folder))
        # Accelerate returns from save_state without a barrier: on a FULL state dict, rank 0
        # may still be writing optimizer.bin while rank 1 lists the folder.
        torch.distributed.barrier()
        out["files"] = sorted(path.name for path in folder.iterdir())
        data_at_save = batches.get_state()
        out["after"] = [step() for _ in range(STEPS_AFTER_SAVE)]
        accelerator.load_state(str(folder))
        batches.set_state(data_at_save)
        out["resumed"] = [step() for _ in range(STEPS_AFTER_SAVE)]
        return out
    finally:
        Accelerator.device = accelerator_device
        AcceleratorState._reset_state(True)


def _body(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    root = Path(folder)
    results: dict[str, Any] = {}
    # torch's FSDP1, unpatched: the losses before the save, and SHARDED's resumed losses.
    results["torch"] = _accelerate_job("SHARDED_STATE_DICT", False, root / "torch")
    with patched_torch():
        # Both orders of optimizer and prepare; FULL with the optimizer built first, the case
        # where training once updated tensors the model no longer used.
        for state_dict_type, optimizer_first in RUNS:
            order = "optimizer-first" if optimizer_first else "model-first"
            name = f"{state_dict_type}-{order}"
            results[name] = _accelerate_job(state_dict_type, optimizer_first, root / name)
    torch.distributed.barrier()
    return results


def test_accelerate_fsdp1_save_and_load_state_as_torchs_fsdp1(tmp_path: Path) -> None:
    for results in run_on_ranks(2, _body, folder=str(tmp_path)):
        oracle = results.pop("torch")
        assert oracle["wrapper"].startswith("torch.distributed.fsdp")
        # The oracle itself resumes exactly; shardkit's runs must match it bit for bit.
        assert oracle["resumed"] == oracle["after"]
        for name, run in results.items():
            assert run["wrapper"] == "shardkit.legacy.wrapper", name
            assert run["before"] == oracle["before"], name
            assert run["after"] == oracle["after"], name
            assert run["resumed"] == oracle["after"], name
            if name.startswith("FULL"):
                assert {"pytorch_model_fsdp.bin", "optimizer.bin"} <= set(run["files"]), name
            else:
                assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(run["files"]), name
