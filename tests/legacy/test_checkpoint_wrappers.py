"""FSDP1 state dicts of models with activation-checkpoint wrappers around or inside units.

torch's ``checkpoint_wrapper`` renames its keys (it drops ``_checkpoint_wrapped_module.``),
applied before FSDP, after it or both; a hand-written wrapper keeps its own name in the keys.
Each under an FSDP root and under a plain root (``nn.Module``'s own load walks the units, and
checkpoint_wrapper's load hook moves the keys under it). torch's FSDP1 is the oracle: FULL
and SHARDED forms compare equal, and a model loaded from them computes what the saved one
computes. FULL with ``rank0_only`` and ``offload_to_cpu`` is checked against the single
process (FSDP1 cannot offload on a CPU-only machine).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from harness.pool import run_on_ranks
from tests.legacy.legacy_parity import lib
from tests.legacy.optim_support import assert_same, comparable

MODES = ("before", "after", "both", "hand_written")


class HandWritten(nn.Module):
    """A user's own checkpointing wrapper: recomputes its module in backward."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.inner = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)
        return out


def _net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    block = nn.Sequential(nn.Linear(6, 6), nn.ReLU())
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), block, nn.Linear(6, 3))


def _build(impl: str, mode: str, seed: int, root: str = "fsdp") -> nn.Module:
    """The net with its wrappers.

    ``root="plain"``: a plain root holding a unit that holds the checkpointed unit (a
    container of wrapped blocks, as torch's own state-dict test builds it).
    """
    fsdp = lib(impl).FSDP
    model = _net(seed)
    kwargs = {"device_id": torch.device("cpu")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mode == "before":
            model[2] = fsdp(checkpoint_wrapper(model[2]), **kwargs)
        elif mode == "after":
            model[2] = checkpoint_wrapper(fsdp(model[2], **kwargs))
        elif mode == "both":
            model[2] = checkpoint_wrapper(fsdp(checkpoint_wrapper(model[2]), **kwargs))
        else:
            model[2] = fsdp(HandWritten(model[2]), **kwargs)
        if root == "plain":
            inner = fsdp(nn.Sequential(model[2], model[3]), **kwargs)
            return nn.Sequential(model[0], model[1], inner)
        wrapped: nn.Module = fsdp(model, **kwargs)
    if mode == "after":
        wrapped = checkpoint_wrapper(wrapped)
    return wrapped


def _round_trip(impl: str, mode: str, kind: str, root: str) -> dict[str, Any]:
    ns = lib(impl)
    source = _build(impl, mode, seed=0, root=root)
    x = torch.randn(2, 4)
    source(x).sum().backward()
    target = _build(impl, mode, seed=1, root=root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ns.FSDP.state_dict_type(source, getattr(ns.StateDictType, kind)):
            saved = source.state_dict()
        with ns.FSDP.state_dict_type(target, getattr(ns.StateDictType, kind)):
            result = str(target.load_state_dict(saved))
    return {
        "saved": comparable(saved),
        "result": result,
        "same": bool(torch.equal(source(x), target(x))),
    }


def _body(rank: int, world_size: int, mode: str, root: str) -> dict[str, Any]:
    return {
        kind: {impl: _round_trip(impl, mode, kind, root) for impl in ("shardkit", "torch")}
        for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
    }


@pytest.mark.parametrize("root", ["fsdp", "plain"])
@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_wrapped_models_save_and_load_as_fsdp1(mode: str, root: str) -> None:
    for rank, out in enumerate(run_on_ranks(2, _body, mode=mode, root=root)):
        for kind, both in out.items():
            ours, theirs = both["shardkit"], both["torch"]
            where = f"rank {rank} {mode} {root} root {kind}"
            assert_same(ours["saved"], theirs["saved"], where)
            assert ours["result"] == theirs["result"], where
            assert ours["same"] and theirs["same"], where


def _offloaded_body(rank: int, world_size: int) -> dict[str, Any]:
    import shardkit.legacy as legacy

    out: dict[str, Any] = {}
    for mode in MODES:
        model = _build("shardkit", mode, seed=0)
        config = legacy.FullStateDictConfig(rank0_only=True, offload_to_cpu=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with legacy.FSDP.state_dict_type(model, legacy.StateDictType.FULL_STATE_DICT, config):
                out[mode] = model.state_dict()
    plain = _net(0)
    plain[2] = HandWritten(plain[2])
    out["plain"] = {k.replace("inner.", ""): v for k, v in plain.state_dict().items()}
    return out


def test_full_rank0_only_with_offload_gives_the_single_process_state_dict() -> None:
    results = run_on_ranks(2, _offloaded_body)
    for rank, out in enumerate(results):
        for mode in MODES:
            if rank != 0:
                assert out[mode] == {}, mode
                continue
            got = {k.replace("inner.", ""): v for k, v in out[mode].items()}
            assert got.keys() == out["plain"].keys(), mode
            for key, value in out["plain"].items():
                assert torch.equal(got[key], value), (mode, key)
