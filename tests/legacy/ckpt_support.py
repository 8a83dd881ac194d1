"""Checkpoint helpers for the shardkit.legacy tests: train, save, load, go on, compare."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from tests.core import models
from tests.legacy.legacy_parity import LegacyRun, lib, train_steps, wrap_model

__all__ = ["describe", "fresh", "load_into", "plain_sgd", "state_dict_of", "train_steps"]


def plain_sgd(model: nn.Module) -> torch.optim.Optimizer:
    """Momentum-free SGD: what comes next depends on the parameters only."""
    return torch.optim.SGD(model.parameters(), lr=0.05)


def state_dict_of(impl: str, model: nn.Module, kind: str, config: Any = None) -> dict[str, Any]:
    """``model.state_dict()`` under ``StateDictType.<kind>`` (and ``config``)."""
    ns = lib(impl)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ns.FSDP.state_dict_type(model, getattr(ns.StateDictType, kind), config):
            return dict(model.state_dict())


def load_into(impl: str, model: nn.Module, kind: str, state_dict: dict[str, Any]) -> Any:
    """``model.load_state_dict(state_dict)`` under ``StateDictType.<kind>``."""
    ns = lib(impl)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ns.FSDP.state_dict_type(model, getattr(ns.StateDictType, kind)):
            return model.load_state_dict(state_dict)


def describe(state_dict: dict[str, Any]) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(key, type, shape, dtype) of every entry, in order."""
    return [
        (k, type(v).__name__, tuple(v.shape), str(v.dtype).removeprefix("torch."))
        for k, v in state_dict.items()
    ]


def fresh(impl: str, run: LegacyRun) -> nn.Module:
    """A model of ``run`` wrapped by ``impl``, with other initial values than seed 0's."""
    model: nn.Module = wrap_model(impl, run, models.build(run.model, seed=5))
    return model
