"""torch's FSDP1 at work in the test workers: checkpoints in its three forms, and its layouts.

``write_checkpoints`` trains the test GPT under FSDP1 for two steps, writes a FULL state dict
(``full.pt``), a SHARDED one through DCP (``sharded/``, under the key ``model``) and LOCAL
ones (``local/rank{r}.pt``), then trains three more steps: the losses a converted
checkpoint must reproduce. ``unit_layouts`` reports the flat parameters FSDP1 builds for a
list of settings, so that shardkit's arithmetic can be compared with them.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.fsdp import (
    FullStateDictConfig,
    FullyShardedDataParallel,
    MixedPrecision,
    StateDictType,
)
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

from shardkit.legacy import WrapPolicy
from tests.core.ckpt_helpers import train
from tests.legacy import fsdp1_models

LR = 0.1  # plain SGD: no optimizer state to carry over, so the weights decide the losses
SAVED_AFTER = range(2)  # the steps trained before the checkpoints
RESUMED = range(2, 5)  # the steps trained after them (ckpt_helpers.train's global batches)


def mixed_precision(name: str | None) -> MixedPrecision | None:
    """FSDP1's MixedPrecision by name: None or "bf16" (bf16 parameters, the rest inferred)."""
    return None if name is None else MixedPrecision(param_dtype=torch.bfloat16)


def build(model_name: str, seed: int = 0) -> nn.Module:
    """A test model by name: "gpt" (the tiny GPT) or "normnet" (with BatchNorm)."""
    if model_name == "gpt":
        return fsdp1_models.tiny_gpt(seed)
    torch.manual_seed(seed)
    return fsdp1_models.NormNet()


Fsdp1Policy = ModuleWrapPolicy | CustomPolicy | Callable[..., bool]


def policy(name: str, model: nn.Module) -> Fsdp1Policy | None:
    """An FSDP1 auto-wrap policy by name, of each kind FSDP1 takes."""
    block = fsdp1_models.block_class()
    if name == "none":
        return None
    if name == "blocks":
        return ModuleWrapPolicy({block})
    if name == "classes":
        return ModuleWrapPolicy({block, nn.Linear})
    if name == "custom":
        picked = next(m for m in model.modules() if isinstance(m, nn.Sequential))
        return CustomPolicy(lambda m: isinstance(m, block) or m is picked)
    if name == "size":
        return functools.partial(size_based_auto_wrap_policy, min_num_params=150)
    if name == "transformer":
        return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block})
    raise ValueError(f"unknown policy {name!r}")


def shardkit_policy(name: str, model: nn.Module) -> WrapPolicy | None:
    """The same policy for shardkit's layout; "classes" as the bare set of classes it takes."""
    if name == "classes":
        return {fsdp1_models.block_class(), nn.Linear}
    return policy(name, model)


def wrap(model: nn.Module, policy_name: str, use_orig_params: bool, mp: str | None) -> Any:
    """``model`` under torch's FSDP1 on CPU (gloo) with these settings."""
    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=policy(policy_name, model),
        use_orig_params=use_orig_params,
        mixed_precision=mixed_precision(mp),
        device_id=torch.device("cpu"),
    )


@contextmanager
def quiet() -> Iterator[None]:
    """FSDP1's deprecation and ShardedTensor warnings, which every call repeats."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def write_checkpoints(
    rank: int, world_size: int, out: str, use_orig_params: bool, mp: str | None, model: str
) -> dict[str, Any]:
    """Train, write FULL, SHARDED and LOCAL checkpoints into ``out``, train on.

    Returns the full state dict at the save (rank 0), and the losses before and after.
    """
    with quiet():
        fsdp = wrap(build(model), "blocks", use_orig_params, mp)
        opt = torch.optim.SGD(fsdp.parameters(), lr=LR)
        before = train(fsdp, opt, SAVED_AFTER, rank, world_size)
        os.makedirs(f"{out}/local", exist_ok=True)
        with FullyShardedDataParallel.state_dict_type(fsdp, StateDictType.LOCAL_STATE_DICT):
            torch.save(fsdp.state_dict(), f"{out}/local/rank{rank}.pt")
        with FullyShardedDataParallel.state_dict_type(fsdp, StateDictType.SHARDED_STATE_DICT):
            dcp_save({"model": fsdp.state_dict()}, checkpoint_id=f"{out}/sharded")
        config = FullStateDictConfig(rank0_only=True, offload_to_cpu=False)
        with FullyShardedDataParallel.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT, config):
            full = {k: v.detach().clone() for k, v in fsdp.state_dict().items()}
        if rank == 0:
            torch.save(full, f"{out}/full.pt")
        after = train(fsdp, opt, RESUMED, rank, world_size)
    return {"full": full if rank == 0 else {}, "before": before, "after": after}


def unit_layouts(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each case (model, policy, use_orig_params, mp), FSDP1's units by prefix.

    Per unit: parameter names from the root, their shared names, ``_numels_with_padding``,
    ``_is_padding_mask``, the unpadded flat numel, and this rank's local and padding numels.
    """
    found = []
    for case in cases:
        with quiet():
            fsdp = wrap(build(case["model"]), case["policy"], case["use_orig_params"], case["mp"])
        found.append({_prefix(name): _describe(m, name) for name, m in _units(fsdp)})
    return found


def _units(fsdp: Any) -> list[tuple[str, Any]]:
    return [
        (name, m)
        for name, m in fsdp.named_modules()
        if isinstance(m, FullyShardedDataParallel) and m._handle is not None
    ]


def _prefix(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("._fsdp_wrapped_module", "")


def _describe(unit: Any, name: str) -> dict[str, Any]:
    flat = unit._handle.flat_param
    prefix = _prefix(name)
    shared = [_join(prefix, s.module_name, s.param_name) for s in flat._shared_param_infos]
    return {
        "fqns": [_join(prefix, f) for f in flat._fqns],
        "shared": shared,
        "numels_with_padding": list(flat._numels_with_padding),
        "padding_mask": list(flat._is_padding_mask),
        "numel": flat._unpadded_unsharded_size.numel(),
        "local": flat.numel() - flat._shard_numel_padded,
        "dtype": flat.dtype,
    }


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def write_stack_checkpoints(rank: int, world_size: int, out: str) -> int:
    """FSDP1 shards the many-layer stack (each Linear a unit) and saves all three forms.

    Returns the stack's parameter bytes.
    """
    model = fsdp1_models.stack()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    with quiet():
        fsdp = FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=torch.device("cpu")
        )
        os.makedirs(f"{out}/local", exist_ok=True)
        with FullyShardedDataParallel.state_dict_type(fsdp, StateDictType.LOCAL_STATE_DICT):
            torch.save(fsdp.state_dict(), f"{out}/local/rank{rank}.pt")
        with FullyShardedDataParallel.state_dict_type(fsdp, StateDictType.SHARDED_STATE_DICT):
            dcp_save(fsdp.state_dict(), checkpoint_id=f"{out}/sharded")
        config = FullStateDictConfig(rank0_only=True, offload_to_cpu=False)
        with FullyShardedDataParallel.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT, config):
            full = fsdp.state_dict()
        if rank == 0:
            torch.save(full, f"{out}/full.pt")
    return total
