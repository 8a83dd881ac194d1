"""Checkpoint helpers for the shardkit.legacy tests: train, save, load, go on, compare."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tests.core import models
from tests.legacy.legacy_parity import LegacyRun, lib, train_steps, wrap_model

__all__ = [
    "assert_same_form",
    "describe",
    "fresh",
    "load_into",
    "plain_sgd",
    "sharded_form",
    "state_dict_of",
    "train_steps",
]


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


def load_into(
    impl: str, model: nn.Module, kind: str, state_dict: dict[str, Any], strict: bool = True
) -> Any:
    """``model.load_state_dict(state_dict, strict)`` under ``StateDictType.<kind>``."""
    ns = lib(impl)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ns.FSDP.state_dict_type(model, getattr(ns.StateDictType, kind)):
            return model.load_state_dict(state_dict, strict=strict)


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


def sharded_form(value: Any) -> Any:
    """What a sharded value is: type, global shape, and this rank's piece with its place."""
    if isinstance(value, DTensor):
        return ("DTensor", tuple(value.shape), [str(p) for p in value.placements],
                value.to_local().clone())  # fmt: skip
    if type(value).__name__ == "ShardedTensor":
        boxes = [
            (tuple(m.shard_offsets), tuple(m.shard_sizes), str(m.placement))
            for m in value.metadata().shards_metadata
        ]
        local = [(tuple(s.metadata.shard_offsets), s.tensor.clone()) for s in value.local_shards()]
        return ("ShardedTensor", tuple(value.size()), boxes, local)
    return (type(value).__name__, tuple(value.shape), value.clone())


def assert_same_form(ours: Any, theirs: Any, where: str) -> None:
    assert type(ours) is type(theirs), where
    if isinstance(ours, torch.Tensor):
        torch.testing.assert_close(ours, theirs, msg=where)
    elif isinstance(ours, list | tuple):
        assert len(ours) == len(theirs), where
        for a, b in zip(ours, theirs, strict=True):
            assert_same_form(a, b, where)
    else:
        assert ours == theirs, where


def forms_after_training(
    run: LegacyRun, kind: str, form: Callable[[Any], Any] = sharded_form
) -> dict[str, dict[str, Any]]:
    """Each implementation's ``kind`` state dict after two steps, as ``form`` describes it."""
    out: dict[str, dict[str, Any]] = {}
    for impl in ("shardkit", "torch"):
        model = wrap_model(impl, run)
        train_steps(model, plain_sgd(model), run, range(2))
        out[impl] = {k: form(v) for k, v in state_dict_of(impl, model, kind).items()}
    return out
