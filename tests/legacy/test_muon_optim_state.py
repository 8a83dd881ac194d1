"""FSDP1's optimizer-state APIs take shardkit's Muon (beside AdamW, or with it as one
``MuonWithAdamW``), and training goes on alike.

A model wrapped by ``shardkit.legacy``'s FSDP (``use_orig_params=True``: Muon needs the
matrices, not FSDP1's flat 1-D parameters) trains 2 steps with Muon on its blocks' matrices
and AdamW on the rest, and saves model and both optimizers through FSDP1's APIs: under
``state_dict_type`` FULL or SHARDED (``FSDP.optim_state_dict`` / ``optim_state_dict_to_load``),
and the older ``full_optim_state_dict`` (on rank 0) / ``scatter_full_optim_state_dict``. A
fresh model and fresh optimizers load it and train 3 steps, which must give the parameters of
the run that went on without stopping, bit for bit.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness.pool import run_on_ranks
from shardkit.core.optim import Muon, MuonWithAdamW
from tests.core import models
from tests.legacy.ckpt_support import load_into, state_dict_of
from tests.legacy.legacy_parity import LegacyRun, full_params, lib, rank_batch, wrap_model

RUN = LegacyRun(model="gpt", extra={"use_orig_params": True})
SAVED_AT, STEPS = 2, 5


def _optimizers(model: nn.Module, kind: str) -> list[torch.optim.Optimizer]:
    """Muon beside AdamW ("pair"), or the two as one ``MuonWithAdamW`` ("one")."""
    matrices = [(n, p) for n, p in model.named_parameters() if p.dim() == 2 and "blocks." in n]
    taken = {id(p) for _, p in matrices}
    others = [p for p in model.parameters() if id(p) not in taken]
    if kind == "one":
        groups = [
            {"params": matrices, "use_muon": True, "lr": 0.02},
            {"params": others, "use_muon": False, "lr": 1e-3, "weight_decay": 0.1},
        ]
        return [MuonWithAdamW(groups)]
    return [Muon(matrices, lr=0.02), torch.optim.AdamW(others, lr=1e-3, weight_decay=0.1)]


def _train(model: nn.Module, opts: list[torch.optim.Optimizer], steps: range) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for step in steps:
        x, y = rank_batch(RUN, step, rank, world_size)
        models.loss_of(RUN.model, model(x), y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()


def _fsdp(name: str, *args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(lib("shardkit").FSDP, name)(*args, **kwargs)


def _save(model: nn.Module, opts: list[torch.optim.Optimizer], form: str) -> list[Any]:
    if form == "full_optim_state_dict":
        return [_fsdp("full_optim_state_dict", model, opt) for opt in opts]
    ns = lib("shardkit")
    with ns.FSDP.state_dict_type(model, getattr(ns.StateDictType, form)):
        return [copy.deepcopy(_fsdp("optim_state_dict", model, opt)) for opt in opts]


def _load(model: nn.Module, opts: list[torch.optim.Optimizer], saved: list[Any], form: str) -> None:
    for opt, osd in zip(opts, saved, strict=True):
        if form == "full_optim_state_dict":
            # Rank 0 holds the full state; the others receive their shards from it.
            full = osd if dist.get_rank() == 0 else None
            opt.load_state_dict(_fsdp("scatter_full_optim_state_dict", full, model, optim=opt))
            continue
        ns = lib("shardkit")
        with ns.FSDP.state_dict_type(model, getattr(ns.StateDictType, form)):
            opt.load_state_dict(_fsdp("optim_state_dict_to_load", model, opt, osd))


def _body(rank: int, world_size: int, form: str, optimizer: str) -> dict[str, Any]:
    model = wrap_model("shardkit", RUN)
    opts = _optimizers(model, optimizer)
    _train(model, opts, range(SAVED_AT))
    kind = "FULL_STATE_DICT" if form == "full_optim_state_dict" else form
    model_sd = copy.deepcopy(state_dict_of("shardkit", model, kind))
    saved = _save(model, opts, form)
    momentum = [k for s in saved[0].get("state", {}).values() for k in s]
    _train(model, opts, range(SAVED_AT, STEPS))
    straight = full_params("shardkit", model)

    fresh = wrap_model("shardkit", RUN, models.build(RUN.model, seed=7))
    fresh_opts = _optimizers(fresh, optimizer)
    load_into("shardkit", fresh, kind, model_sd)
    _load(fresh, fresh_opts, saved, form)
    _train(fresh, fresh_opts, range(SAVED_AT, STEPS))
    resumed = full_params("shardkit", fresh)
    return {
        "momentum_keys": set(momentum),
        "differs": [n for n in straight if not torch.equal(straight[n], resumed[n])],
    }


@pytest.mark.parametrize(
    "form",
    [
        "FULL_STATE_DICT",
        pytest.param("SHARDED_STATE_DICT", marks=pytest.mark.slow),
        pytest.param("full_optim_state_dict", marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("optimizer", ["pair", "one"])
def test_fsdp1_optimizer_state_apis_take_muon(form: str, optimizer: str) -> None:
    one = optimizer == "one"
    keys = {"momentum_buffer"} | ({"exp_avg", "exp_avg_sq", "step"} if one else set())
    for rank, result in enumerate(run_on_ranks(2, _body, form=form, optimizer=optimizer)):
        if rank == 0 or form != "full_optim_state_dict":  # rank 0's alone, there
            assert result["momentum_keys"] == keys, rank
        assert result["differs"] == [], (rank, result["differs"])
