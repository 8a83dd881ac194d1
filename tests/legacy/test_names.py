"""shardkit.legacy's names have FSDP1's fields, defaults, signatures and wrapping decisions."""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Any

import pytest
import torch.distributed.fsdp as torch_fsdp
from torch import nn

import shardkit.legacy as legacy

CONFIGS = [
    "MixedPrecision", "CPUOffload", "StateDictConfig", "FullStateDictConfig",
    "LocalStateDictConfig", "ShardedStateDictConfig", "OptimStateDictConfig",
    "FullOptimStateDictConfig", "LocalOptimStateDictConfig", "ShardedOptimStateDictConfig",
    "StateDictSettings",
]  # fmt: skip
ENUMS = ["ShardingStrategy", "BackwardPrefetch", "StateDictType", "OptimStateKeyType"]


def _fields(cls: type) -> list[tuple[str, Any]]:
    return [(f.name, f.default) for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("name", CONFIGS)
def test_configs_have_fsdp1_fields_defaults_and_order(name: str) -> None:
    ours, theirs = getattr(legacy, name), getattr(torch_fsdp, name)
    assert _fields(ours) == _fields(theirs)
    assert issubclass(ours, getattr(legacy, theirs.__mro__[1].__name__, object))


@pytest.mark.parametrize("name", ENUMS)
def test_enums_have_fsdp1_members(name: str) -> None:
    ours: type[Enum] = getattr(legacy, name)
    theirs: type[Enum] = getattr(torch_fsdp, name)
    assert [(m.name, m.value) for m in ours] == [(m.name, m.value) for m in theirs]


def test_every_name_of_the_issue_is_exported() -> None:
    wanted = {
        "CustomPolicy", "ModuleWrapPolicy",
        "transformer_auto_wrap_policy", "size_based_auto_wrap_policy",
        "lambda_auto_wrap_policy", *CONFIGS, *ENUMS,
    }  # fmt: skip
    assert wanted <= set(legacy.__all__)


def test_size_based_policy_keeps_its_public_attributes() -> None:
    policy = legacy.size_based_auto_wrap_policy
    assert {nn.MultiheadAttention} == policy.FORCE_LEAF_MODULES  # type: ignore[attr-defined]
    assert {nn.ModuleList, nn.ModuleDict} == policy.EXCLUDE_WRAP_MODULES  # type: ignore[attr-defined]
