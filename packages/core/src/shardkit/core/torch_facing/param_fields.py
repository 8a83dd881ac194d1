"""torch's ``FSDPParam`` sizes, dtypes and states, read from a shardkit parameter.

Code written for torch's ``fully_shard`` reads them from a group's ``fsdp_params``: expert-
parallel libraries size the buffers of their own gathers from ``padded_sharded_param_size``,
``_orig_size`` and ``fsdp_placement``; custom all-gathers test ``sharded_state`` and read
``_sharded_param_data``; parameter swaps go through ``_module_info``. Each value here is derived
from what shardkit already holds for the parameter (its ``ShardGeometry``, its sharding spec,
its group's policies), and is what torch's engine reports for the same ``fully_shard`` call:
shardkit cuts a parameter as torch does (``torch.chunk`` along the shard dim, every rank's
shard padded to the first chunk's size), and aligns only between parameters in its flat
buffers, so one parameter's padded shard is contiguous, as torch's is.

Read-only: shardkit does not read these back, so none is settable (the view's strictness makes a
write fail by name). See [Note: torch-facing view].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.fsdp._fully_shard import _fsdp_param as _torch_param
from torch.distributed.tensor import Shard

from shardkit.core.policies import resolved
from shardkit.core.runtime.dtensors import contiguous_strides
from shardkit.core.state_machines import ShardedState
from shardkit.core.torch_release import REDUCES_IN_PARAM_DTYPE

if TYPE_CHECKING:
    from shardkit.core.engine.group.param_group import FSDPParamGroup
    from shardkit.core.engine.param import FSDPParam

__all__ = ["TorchParamFields", "torch_param_order", "torch_sharded_state"]


def torch_sharded_state(state: ShardedState) -> Any:
    """The member of torch's ``ShardedState`` named as shardkit's ``state`` is."""
    return _torch_param.ShardedState[state.name]


def torch_param_order(roots: Sequence[nn.Module], params: Sequence[FSDPParam]) -> list[int]:
    """Indices into ``params`` (a group's, as shardkit lists them) in torch's order.

    shardkit lists a group's parameters as ``named_parameters`` meets them (a module's own
    before its children's); torch's ``fully_shard`` lists them module by module with children
    before their parent. The two differ where a module holds parameters of its own beside
    children (a position embedding on the root): code that indexes ``fsdp_params`` gets
    torch's order. Within one module both keep registration order.
    """
    after_children: dict[nn.Module, int] = {}
    entered: set[nn.Module] = set()

    def visit(module: nn.Module) -> None:
        entered.add(module)
        for child in module.children():
            if child not in entered:
                visit(child)
        after_children[module] = len(after_children)

    for root in roots:
        if root not in entered:
            visit(root)
    unseen = len(after_children)

    def key(index: int) -> tuple[int, int]:
        first = min(after_children.get(slot.module, unseen) for slot in params[index].slots)
        return first, index

    return sorted(range(len(params)), key=key)


class TorchParamFields:
    """The fields of torch's ``FSDPParam`` that describe a parameter's layout and dtypes.

    A base of the view's parameter, which sets ``_param`` and ``_owner``.
    """

    __slots__ = ()
    _param: FSDPParam
    _param_fqn: str

    @property
    def _owner(self) -> FSDPParamGroup:
        raise NotImplementedError  # the view's parameter answers with its group

    # --- sizes ---------------------------------------------------------------------------

    @property
    def _orig_size(self) -> torch.Size:
        """The full parameter's size (under TP, its TP-local part's, as torch's)."""
        return self._param.geometry.shape

    @property
    def _contiguous_orig_stride(self) -> tuple[int, ...]:
        # torch's gather unflattens with these: the full parameter is contiguous.
        return contiguous_strides(self._param.geometry.shape)

    @property
    def sharded_size(self) -> torch.Size:
        """This rank's shard, unpadded (its dim is 0 on a rank past the last row)."""
        return self._param.geometry.local_shape(self._param.mesh_info.shard_rank)

    @property
    def contiguous_sharded_stride(self) -> tuple[int, ...]:
        """The strides of a contiguous tensor of ``sharded_size``."""
        return contiguous_strides(self.sharded_size)

    @property
    def padded_sharded_param_size(self) -> torch.Size:
        """Every rank's shard padded to the first chunk's size: what each rank all-gathers."""
        return self._param.geometry.padded_shard_shape

    @property
    def fsdp_placement(self) -> Shard:
        """The dim the data-parallel axis shards, as torch's placement (non-negative)."""
        return Shard(self._param.geometry.dim)

    @property
    def is_dtensor(self) -> bool:
        """Whether the parameter was a DTensor before sharding (tensor parallelism)."""
        return self._param.sharding_spec.unsharded_mesh is not None

    @property
    def _sharded_param_data(self) -> torch.Tensor:
        """This rank's padded shard, 1-D: the sharded parameter's local tensor and its padding.

        A view of the storage the engine gathers from, as torch's is: writes go to the shard.
        """
        param = self._param
        if param.hooks is not None:
            # Not an AttributeError: a property's would be replaced by the view's generic one.
            raise NotImplementedError(
                f"{self._param_fqn}: _sharded_param_data of a parameter gathered through "
                "all-gather hooks (a tensor subclass) is not served; its sharded_param is"
            )
        local, geo = param.current_local(), param.geometry
        # The local tensor is a narrow of the padded shard from its first element, so the
        # padded shard starts where the local tensor does and runs on contiguously.
        return local.as_strided((geo.shard_numel,), (1,), local.storage_offset())

    # --- dtypes and placement of the work ------------------------------------------------

    @property
    def orig_dtype(self) -> torch.dtype:
        """The sharded parameter's dtype (what the optimizer steps)."""
        return self._param.orig_dtype

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The dtype it is gathered and computed in; None where that is its own."""
        comm = self._param.comm_dtype
        return None if comm == self._param.orig_dtype else comm

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        """The policy's ``reduce_dtype``, as torch's parameter holds it.

        Before torch 2.15 it was None where it equals ``param_dtype`` (gradients were computed
        in that dtype, so no cast); from 2.15 ``reduce_dtype=None`` means the parameter's own
        dtype instead, and the policy's value is kept as given.
        """
        policy = self._owner.mp_policy
        if not REDUCES_IN_PARAM_DTYPE and policy.reduce_dtype == policy.param_dtype:
            return None
        return policy.reduce_dtype

    @property
    def mp_policy(self) -> Any:
        """The group's policy, with ``param_dtype_override_fn`` applied to this parameter."""
        own = self._param.orig_dtype if self._param.keeps_own_dtype else None
        return resolved(self._owner.mp_policy, own)

    @property
    def device(self) -> torch.device:
        """The mesh's device: where the full parameter and the collectives' buffers live."""
        return self._owner.plan.device

    @property
    def offload_to_cpu(self) -> bool:
        """Whether the sharded parameter lives on the CPU (``CPUOffloadPolicy``)."""
        return self._owner.plan.offload

    @property
    def pin_memory(self) -> bool:
        """Whether that CPU memory is pinned."""
        return self._owner.plan.pin_memory

    # --- where it is, and what it is now -------------------------------------------------

    @property
    def sharded_state(self) -> Any:
        """The member of torch's ``ShardedState`` named as the group's state is."""
        return torch_sharded_state(self._owner.sharded_state)

    @property
    def _module_info(self) -> Any:
        """Where it is registered, as torch's ``ParamModuleInfo``.

        The module and name, and those of its tied copies. A new object at each read: writing
        its fields changes nothing.
        """
        first, *tied = self._param.slots
        return _torch_param.ParamModuleInfo(
            first.module, first.name, [s.module for s in tied], [s.name for s in tied]
        )
