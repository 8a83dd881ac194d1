"""shardkit.legacy's names have FSDP1's fields, defaults, signatures and wrapping decisions."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from enum import Enum
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp.wrap as torch_wrap
from torch import nn

import shardkit.legacy as legacy
from harness.pool import run_on_ranks
from tests.core import models

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
        "FullyShardedDataParallel", "FSDP", "CustomPolicy", "ModuleWrapPolicy",
        "transformer_auto_wrap_policy", "size_based_auto_wrap_policy",
        "lambda_auto_wrap_policy", *CONFIGS, *ENUMS,
    }  # fmt: skip
    assert wanted <= set(legacy.__all__)
    assert legacy.FSDP is legacy.FullyShardedDataParallel


def _default_of(value: Any) -> Any:
    return value.name if isinstance(value, Enum) else value


def test_the_constructor_and_methods_take_fsdp1_arguments() -> None:
    for name in [
        "__init__", "summon_full_params", "clip_grad_norm_", "fsdp_modules", "apply",
        "state_dict_type", "set_state_dict_type", "get_state_dict_type", "no_sync",
    ]:  # fmt: skip
        ours = inspect.signature(getattr(legacy.FSDP, name)).parameters
        theirs = inspect.signature(getattr(torch_fsdp.FullyShardedDataParallel, name)).parameters
        assert list(ours) == list(theirs), name
        for arg in ours:
            ours_default = _default_of(ours[arg].default)
            assert ours_default == _default_of(theirs[arg].default), (name, arg)


def test_size_based_policy_keeps_its_public_attributes() -> None:
    policy = legacy.size_based_auto_wrap_policy
    assert {nn.MultiheadAttention} == policy.FORCE_LEAF_MODULES  # type: ignore[attr-defined]
    assert {nn.ModuleList, nn.ModuleDict} == policy.EXCLUDE_WRAP_MODULES  # type: ignore[attr-defined]


def _policies(impl: str) -> dict[str, Any]:
    ns: Any = legacy if impl == "shardkit" else torch_wrap
    blocks = {models.Block}
    return {
        "module": ns.ModuleWrapPolicy(blocks),
        "custom": ns.CustomPolicy(lambda m: isinstance(m, nn.Linear) and m.out_features == 64),
        "transformer": functools.partial(
            ns.transformer_auto_wrap_policy, transformer_layer_cls=blocks
        ),
        "size": functools.partial(ns.size_based_auto_wrap_policy, min_num_params=1000),
        "lambda": functools.partial(
            ns.lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.LayerNorm)
        ),
        "always": ns.always_wrap_policy,
    }


def _wrapped_paths(rank: int, world_size: int) -> dict[str, dict[str, list[str]]]:
    import warnings

    warnings.simplefilter("ignore")
    out: dict[str, dict[str, list[str]]] = {}
    # Torch's policies and configs given to shardkit.legacy's wrapper (imports half changed).
    for impl, policy_impl in (("shardkit", "shardkit"), ("torch", "torch"), ("shardkit", "torch")):
        fsdp: Any = legacy.FSDP if impl == "shardkit" else torch_fsdp.FullyShardedDataParallel
        found: dict[str, list[str]] = {}
        for name, policy in _policies(policy_impl).items():
            model = fsdp(
                models.build("mlp"),
                auto_wrap_policy=policy,
                device_id=torch.device("cpu"),
                mixed_precision=torch_fsdp.MixedPrecision(param_dtype=torch.float16)
                if name == "module"
                else None,
            )
            found[name] = [n for n, m in model.named_modules() if isinstance(m, fsdp)]
        out[f"{impl}/{policy_impl}"] = found
    return out


def test_auto_wrap_policies_wrap_what_fsdp1_wraps() -> None:
    (out,) = run_on_ranks(1, _wrapped_paths)
    assert out["shardkit/shardkit"] == out["torch/torch"]
    assert out["shardkit/torch"] == out["torch/torch"]
    assert out["torch/torch"]["size"] and out["torch/torch"]["lambda"]  # the check has teeth
