"""Torch's own FSDP classes, and how shardkit's sharded modules answer torch's isinstance checks.

Libraries ask ``isinstance(module, torch.distributed.fsdp.FSDPModule)`` before they call
``unshard()``, ``set_requires_gradient_sync()`` and the like (torch's pipelining, Accelerate,
torchtitan, the FSDP2 examples). Torch's ``FSDPModule`` is a plain class, not an ABC, so the
only sound way to pass that check is to be a subclass: every ``FSDP<Cls>`` class that
``fully_shard`` makes has :class:`TorchFacing` among its bases, behind shardkit's own
``FSDPModule``. Method lookup therefore finds shardkit's methods first; :class:`TorchFacing`
answers the few private torch methods shardkit has no public twin for, so no call ever reaches
torch's implementation (which would look for torch's FSDP state and find none).

The classes are taken from the modules that define them, at import. ``patch_torch`` replaces
the public names (``torch.distributed.fsdp.FSDPModule`` becomes shardkit's), so code that must
tell torch's FSDP from shardkit's never looks a name up at call time.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule as _TorchFSDPModule
from torch.distributed.fsdp._fully_shard._fully_shard import UnshardHandle as TorchUnshardHandle
from torch.distributed.fsdp.fully_sharded_data_parallel import (
    FullyShardedDataParallel as _TorchFSDP1,
)

from shardkit.core.torch_facing.view import TorchFacingState, view_of

try:  # torch 2.13 on: shard_placement_fn may return a mesh of its own
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo as _TorchFSDPMeshInfo,
    )
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        HSDPMeshInfo as _TorchHSDPMeshInfo,
    )
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        ShardPlacementResult as _TorchShardPlacementResult,
    )
except ImportError:  # an older torch: no such result can be made
    _TorchFSDPMeshInfo = _TorchHSDPMeshInfo = _TorchShardPlacementResult = None  # type: ignore[assignment,misc]

try:  # torch's replicate on FSDP's engine, whose modules torch's pipelining tells apart
    from torch.distributed._composable.replicate_with_fsdp import (
        ReplicateModule as _TorchReplicateModule,
    )
except ImportError:  # a torch without it: torch's FSDPModule is the only class to pass
    _TorchReplicateModule = _TorchFSDPModule  # type: ignore[assignment,misc]

__all__ = [
    "TORCH_FSDP1",
    "TORCH_FSDP_MESH_INFO",
    "TORCH_FSDP_MODULE",
    "TORCH_HSDP_MESH_INFO",
    "TORCH_SHARD_PLACEMENT_RESULT",
    "TorchFacing",
    "TorchReplicateFacing",
    "TorchUnshardHandle",
    "managed_by_torch_fsdp",
]

logger = logging.getLogger(__name__)

TORCH_FSDP_MODULE: type = _TorchFSDPModule
"""Torch's ``FSDPModule`` class itself, whatever ``torch.distributed.fsdp`` names later."""

TORCH_FSDP1: type[nn.Module] = _TorchFSDP1
"""Torch's FSDP1 wrapper class itself."""

TORCH_SHARD_PLACEMENT_RESULT: type[Any] | None = _TorchShardPlacementResult
"""Torch's ``ShardPlacementResult`` (a placement and its mesh); None before torch 2.13."""

TORCH_FSDP_MESH_INFO: type[Any] | None = _TorchFSDPMeshInfo
"""Torch's ``FSDPMeshInfo``, the mesh a ``ShardPlacementResult`` names (HSDP's included)."""

TORCH_HSDP_MESH_INFO: type[Any] | None = _TorchHSDPMeshInfo
"""Torch's ``HSDPMeshInfo``: a (replicate, shard) mesh."""


class TorchFacing(_TorchFSDPModule):
    """The base that makes ``FSDP<Cls>`` an instance of torch's ``FSDPModule``.

    It comes after shardkit's ``FSDPModule`` in every ``FSDP<Cls>`` class's bases, so torch's
    public methods are all shadowed by shardkit's (a test checks each). What remains of torch's
    class are private methods; those are answered here.
    """

    # Where the module's own class sits in FSDP<Cls>'s method resolution order (torch's
    # attribute, read by torch's own code): FSDP<Cls>, FSDPModule, TorchFacing, torch's
    # FSDPModule, Cls.
    _orig_cls_mro_index: int = 4

    # Torch declares its own FSDPState here: the view stands in for it, serving its names.
    def _get_fsdp_state(self) -> TorchFacingState:  # type: ignore[override]
        """The torch-facing view of this module's state.

        Torch's private names that shardkit serves (pipelining's, torchtitan's), each on
        shardkit's engine; any other fails by name. See [Note: torch-facing view].
        """
        assert isinstance(self, nn.Module)
        return view_of(self)

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """Accepted, as torchtitan's callers expect: it changes nothing in shardkit's engine.

        In torch it moves the all-gather's allocation onto the default CUDA stream; shardkit
        draws its communication buffers from its own pool, whatever this says.

        Raises:
            TypeError: ``async_op`` is not a bool.
        """
        if not isinstance(async_op, bool):
            raise TypeError(
                f"{type(self).__name__}._set_unshard_async_op takes a bool, "
                f"got {type(async_op).__name__}"
            )
        logger.debug("%s._set_unshard_async_op(%s): no effect", type(self).__name__, async_op)


class TorchReplicateFacing(TorchFacing, _TorchReplicateModule):
    """The base that makes ``Replicate<Cls>`` an instance of torch's ``ReplicateModule``.

    Torch's pipelining asks ``isinstance(m, ReplicateModule)`` to read the state through
    torch's ``replicate.state(m)`` (the view answers it). Torch's ``ReplicateModule`` adds
    nothing to its ``FSDPModule`` but its place in the method resolution order.
    """


def managed_by_torch_fsdp(module: nn.Module) -> bool:
    """Whether torch's own FSDP (FSDP2's ``fully_shard`` or FSDP1) manages ``module``'s tree.

    shardkit's ``FSDP<Cls>`` classes are subclasses of torch's ``FSDPModule`` too (see
    :class:`TorchFacing`); they are told apart by that base.
    """
    for sub in module.modules():
        if isinstance(sub, TORCH_FSDP1):
            return True
        if isinstance(sub, TORCH_FSDP_MODULE) and not isinstance(sub, TorchFacing):
            return True
    return False
