"""torch's Muon refused on sharded matrices, with the parameter's name and the fix.

``torch.optim.Muon`` takes ``fully_shard``'s DTensor parameters without a word and runs Newton-
Schulz through DTensor's sharded matmuls: every rank runs every matrix's iteration, with
collectives inside it (27 a step for a two-matrix MLP at W=2), and the result is not a single
process's (2.2e-3 apart after 3 steps; docs/guide/muon.md). A program that swaps AdamW for
Muon would get that silently, so once shardkit's ``fully_shard`` has run in a process, a global
optimizer pre-step hook (torch's own extension point, no patching) stops torch's Muon before its
first step on a matrix sharded over a mesh axis of more than one rank, whichever engine sharded
it, and names :class:`~shardkit.core.optim.muon.Muon` as the fix. Matrices whole on every
rank (plain tensors, ``Replicate``) are left to it: there it computes what a single process
does.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from shardkit.core.errors import ShardedMatrixError

__all__ = ["refuse_torch_muon_on_shards", "sharded_matrix_name"]

# The modules fully_shard was applied to: where a refused parameter's name is looked up.
_MODULES: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_installed = False


def refuse_torch_muon_on_shards(modules: Iterable[nn.Module] = ()) -> None:
    """Refuse ``torch.optim.Muon``'s steps on sharded matrices from now on, in this process.

    ``fully_shard`` calls it with the modules it shards (their parameters' names are what the
    error says). Installs the hook once; later calls only add modules.
    """
    global _installed
    _MODULES.update(modules)
    if not _installed:
        register_optimizer_step_pre_hook(_refuse)
        _installed = True


def _refuse(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not isinstance(opt, torch.optim.Muon):
        return
    name = sharded_matrix_name(opt)
    if name is not None:
        raise ShardedMatrixError(
            f"torch.optim.Muon was given {name}, a matrix sharded across ranks: it would "
            "orthogonalize it through DTensor's sharded matmuls, with collectives inside every "
            "Newton-Schulz iteration on every rank and other bits than a single process's "
            "Muon. Use shardkit.core.optim.Muon (the same arguments and defaults): it "
            "orthogonalizes each matrix once, whole, on one rank, with a single process's bits."
        )


def sharded_matrix_name(opt: torch.optim.Optimizer) -> str | None:
    """The name of ``opt``'s first parameter sharded over more than one rank, or None."""
    for index, group in enumerate(opt.param_groups):
        names: list[str] | None = group.get("param_names")
        for j, param in enumerate(group["params"]):
            if _is_sharded(param):
                if names:
                    return repr(names[j])
                return _name_of(param) or f"param_groups[{index}]['params'][{j}]"
    return None


def _is_sharded(param: torch.Tensor) -> bool:
    if not isinstance(param, DTensor):
        return False
    mesh = param.device_mesh
    return any(p.is_shard() and mesh.size(axis) > 1 for axis, p in enumerate(param.placements))


def _name_of(param: torch.Tensor) -> str | None:
    """``param``'s name in a module ``fully_shard`` was applied to (the outermost's first)."""
    found: list[str] = []
    for module in list(_MODULES):
        found += [repr(n) for n, p in module.named_parameters() if p is param]
    return max(found, key=len, default=None)
