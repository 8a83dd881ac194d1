"""Optimizer-state helpers for the shardkit.legacy tests: two param groups, trained alike."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tests.legacy.ckpt_support import train_steps
from tests.legacy.legacy_parity import LegacyRun, lib, wrap_model

# FSDP1's flat parameters (use_orig_params=False): with use_orig_params=True, torch 2.13's
# optim_state_dict gives exp_avg_sq's values for exp_avg too.
RUN = LegacyRun(model="gpt")


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """The blocks' parameters, and the others at another lr and betas.

    Groups by FSDP unit, the finest FSDP1 allows with flat parameters.
    """
    blocks: list[nn.Parameter] = []
    rest: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        (blocks if "blocks." in name else rest).append(param)
    return [
        {"params": blocks, "weight_decay": 0.1},
        {"params": rest, "weight_decay": 0.0, "lr": 0.02, "betas": (0.8, 0.95)},
    ]


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW over the two groups."""
    return torch.optim.AdamW(param_groups(model), lr=0.05)


def trained(
    impl: str, steps: int = 2, run: LegacyRun = RUN
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model of ``run`` and its optimizer after ``steps`` steps."""
    model = wrap_model(impl, run)
    opt = adamw(model)
    train_steps(model, opt, run, range(steps))
    return model, opt


def call(impl: str, name: str, *args: Any, **kwargs: Any) -> Any:
    """``FSDP.<name>(...)`` of ``impl``, warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(lib(impl).FSDP, name)(*args, **kwargs)


@contextlib.contextmanager
def with_type(impl: str, model: nn.Module, kind: str, optim_config: Any = None) -> Iterator[None]:
    """``FSDP.state_dict_type(model, <kind>, None, optim_config)`` of ``impl``, quietly."""
    ns = lib(impl)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ns.FSDP.state_dict_type(model, getattr(ns.StateDictType, kind), None, optim_config):
            yield


def comparable(value: Any) -> Any:
    """A state value as plain data (ShardedTensors and DTensors: type and local pieces)."""
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(comparable(v) for v in value)
    if isinstance(value, DTensor):
        return ("DTensor", [str(p) for p in value.placements], value.to_local().clone())
    if type(value).__name__ == "ShardedTensor":
        boxes = [
            (tuple(m.shard_offsets), tuple(m.shard_sizes)) for m in value.metadata().shards_metadata
        ]
        local = [s.tensor.clone() for s in value.local_shards()]
        return ("ShardedTensor", boxes, local)
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def assert_same(ours: Any, theirs: Any, where: str = "") -> None:
    """Equal plain data, tensors within float tolerance."""
    if isinstance(ours, torch.Tensor):
        assert isinstance(theirs, torch.Tensor), where
        torch.testing.assert_close(ours, theirs, msg=where)
    elif isinstance(ours, dict):
        assert isinstance(theirs, dict) and ours.keys() == theirs.keys(), (where, ours, theirs)
        for key in ours:
            assert_same(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(ours, list | tuple):
        assert type(ours) is type(theirs) and len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert ours == theirs, (where, ours, theirs)
