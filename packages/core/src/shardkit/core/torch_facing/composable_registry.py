"""Torch's composable-API registry: which of its APIs a module is under, as torch reads it.

Torch's composable APIs (``fully_shard``, ``replicate``, ``checkpoint``) record their name
in a dict kept on the module (``torch.distributed._composable.contract``), and torch's own
code decides by it: ``fully_shard`` and its private ``_get_managed_modules`` leave out a
module that ``replicate`` manages, torch's ``replicate`` refuses one that ``fully_shard``
manages, and torch's tests assert the names are there. shardkit's ``fully_shard`` and
``replicate`` record theirs in the same place, so that torch's code sees shardkit's modules
as it sees its own.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn
from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem

__all__ = ["applied_apis", "record_api"]


def record_api(module: nn.Module, api: str) -> None:
    """Record that ``api`` (``"fully_shard"`` or ``"replicate"``) was applied to ``module``."""
    registry: dict[str, RegistryItem] = module.__dict__.setdefault(REGISTRY_KEY, OrderedDict())
    registry.setdefault(api, RegistryItem())


def applied_apis(module: nn.Module) -> tuple[str, ...]:
    """The names of the composable APIs applied to ``module`` (torch's and shardkit's)."""
    registry = module.__dict__.get(REGISTRY_KEY)
    return tuple(registry) if isinstance(registry, dict) else ()
