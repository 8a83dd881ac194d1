"""Shared steps of the ported FSDP1 state-dict scenarios: blank, read back, broadcast, compare."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.legacy.fsdp1_scenario_models import quiet
from tests.legacy.legacy_parity import lib
from tests.legacy.optim_support import assert_same

IMPLS = ("shardkit", "torch")
KINDS = ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT")
ALL_MATCHED = "<All keys matched successfully>"


def params(impl: str, model: nn.Module) -> list[torch.Tensor]:
    """Every parameter, full (fp32), in ``model.parameters()`` order."""
    with quiet(), lib(impl).FSDP.summon_full_params(model, writeback=False):
        return [p.detach().clone().float() for p in model.parameters()]


def zero(impl: str, model: nn.Module) -> None:
    """Every parameter and buffer set to zero, as FSDP1's tests blank a model."""
    with quiet(), lib(impl).FSDP.summon_full_params(model), torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.zero_()


def rank0_config(impl: str, rank0: bool) -> Any:
    """``FullStateDictConfig(rank0_only=True)`` of ``impl``, or None (the default config).

    Never with ``offload_to_cpu``: torch's FSDP1 fails it on a machine without a GPU.
    """
    return lib(impl).FullStateDictConfig(rank0_only=True) if rank0 else None


def everywhere(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's state dict on every rank (FSDP1's tests broadcast a rank0_only one)."""
    box = [state_dict]
    dist.broadcast_object_list(box, src=0)
    out: dict[str, Any] = box[0]
    return out


def assert_same_as_fsdp1(results: list[dict[str, Any]], skip: tuple[str, ...] = ()) -> None:
    """Every ``shardkit/<case>`` entry equals ``torch/<case>`` on every rank.

    Both implementations must have run each case: a case only one of them ran fails.
    """
    for rank, out in enumerate(results):
        ours = {k.removeprefix("shardkit/") for k in out if k.startswith("shardkit/")}
        theirs = {k.removeprefix("torch/") for k in out if k.startswith("torch/")}
        assert ours == theirs and ours, (rank, ours ^ theirs)
        for case in sorted(ours):
            if not case.startswith(skip):
                assert_same(out[f"shardkit/{case}"], out[f"torch/{case}"], f"rank {rank} {case}")
