"""The layout of sharded parameters, as a read-only view: what lives where, and how big.

Two halves share one piece of arithmetic:

- :func:`group_layout` computes a group's layout from parameter shapes alone (no process
  group, no allocation). The engine builds its own buffers from it, and the planner in
  ``shardkit.tools`` calls it for a model it has never run, so their sizes cannot drift; both
  ask :func:`keeps_own_dtype` which parameters a mixed precision policy's
  ``param_dtype_override_fn`` keeps out of ``param_dtype`` (``ParamSpec``'s flag).
- :func:`layout_of` describes a live sharded module: its groups, each parameter's state-dict
  keys, geometry, a view of its local shard, and the mesh. The FSDP1 layer reads flat-parameter
  layouts and key mappings from it.

Nothing here changes the engine's state but opt-ins for an adapter that keeps one flat
parameter per group (FSDP1's): the group's flat shard (:meth:`GroupView.flat_shard`), which an
optimizer may step between steps as it steps the sharded parameters that view the same bytes;
reductions laid out as that shard (:meth:`GroupView.reduce_into_flat_layout`); parameters
registered off ``parameters()`` (:meth:`GroupView.list_params`); and FSDP1's gradient
accumulation (:meth:`GroupView.accumulate_unsynced_grads_in_param_dtype`,
:meth:`GroupView.reduce_accumulated_grads`). See [Note: flat group buffers].
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shardkit.core.engine.buffer_layout import GroupLayout, group_layout, pooled_sizes
from shardkit.core.engine.group.param_group import FSDPParamGroup
from shardkit.core.engine.param_layout import HookInput, ParamLayout, ParamSpec
from shardkit.core.engine.param_listing import ParamSlot
from shardkit.core.engine.reduce import WireFormat
from shardkit.core.engine.state_registry import states_under
from shardkit.core.policies import keeps_own_dtype
from shardkit.core.reduce_precision import ReducePrecision
from shardkit.core.runtime.buffers import ALIGN_BYTES, ShardGeometry
from shardkit.core.runtime.watch.step_check import HEADER_BYTES as STEP_CHECK_HEADER_BYTES
from shardkit.core.runtime.watch.step_check import step_checks_on

__all__ = [
    "ALIGN_BYTES",
    "GroupLayout",
    "GroupView",
    "HookInput",
    "ParamLayout",
    "ParamSpec",
    "STEP_CHECK_HEADER_BYTES",
    "ShardGeometry",
    "ShardedParamView",
    "group_layout",
    "keeps_own_dtype",
    "layout_of",
    "pooled_sizes",
    "step_checks_on",
    "wire_row_bytes",
]


@dataclass(frozen=True, slots=True)
class ShardedParamView:
    """One sharded parameter of a live module."""

    layout: ParamLayout
    """Its geometry and offsets."""
    keys: tuple[str, ...]
    """Its state-dict keys relative to the module given to :func:`layout_of` (a tied
    parameter has several)."""
    param: nn.Parameter
    """The sharded parameter (a DTensor): what the optimizer and the state dict see."""
    shard_rank: int
    """This rank's index on the shard axis."""

    def local_shard(self) -> torch.Tensor:
        """This rank's unpadded shard, a detached view of the group's sharded buffer.

        A parameter with all-gather hooks keeps its own storage: this is then its local
        tensor subclass, detached. Read it; writing through it changes the parameter without
        autograd knowing.
        """
        local: torch.Tensor = self.param.to_local()  # type: ignore[attr-defined]  # DTensor
        return local.detach()


@dataclass(frozen=True, slots=True)
class GroupView:
    """One parameter group of a live module: its layout, mesh and parameters."""

    fqn: str
    """The group's module(s) relative to the module given to :func:`layout_of`
    (``'<root>'`` for that module itself)."""
    modules: tuple[nn.Module, ...]
    """The modules of the ``fully_shard`` call."""
    layout: GroupLayout
    """Its buffers."""
    mesh: DeviceMesh
    """The data-parallel mesh it is sharded on."""
    shard_rank: int
    """This rank's index on the shard axis."""
    params: tuple[ShardedParamView, ...]
    """Its parameters, in the layout's order."""
    _group: FSDPParamGroup = field(repr=False, compare=False)

    def flat_shard(self) -> torch.Tensor:
        """This rank's shards of every parameter as one 1-D tensor: the group's sharded buffer.

        Each parameter's local shard is a view of it (:meth:`local_views` says where), so
        writing into it changes the parameters, as an optimizer stepping it between steps
        should; alignment gaps and padding are zeros that nothing reads. It stays the
        storage until something moves the shards (``module.to(dtype)`` or a device move,
        ``load_state_dict(assign=True)``, a parameter taking up all-gather hooks): compare
        ``data_ptr()`` with a fresh call.

        Raises:
            ValueError: the group's parameters have different dtypes, or one is gathered
                through all-gather hooks (its shard is not in the buffer).
        """
        return self._group.sharded_buffer.view(self._flat_dtype())

    def local_views(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each parameter's unpadded local shard as a view of ``flat`` (in :attr:`params` order).

        Args:
            flat: a 1-D tensor laid out as :meth:`flat_shard` (that tensor itself, a
                gradient or an optimizer state of it).

        Raises:
            ValueError: ``flat`` is not laid out as :meth:`flat_shard`, or the group has no
                flat shard (see there).
        """
        dtype = self._flat_dtype()
        numel = self.layout.sharded_bytes // dtype.itemsize
        if flat.dim() != 1 or flat.numel() != numel:
            raise ValueError(
                f"FSDP module {self.fqn}: a flat tensor of the group has {numel} elements in "
                f"one dim, got shape {tuple(flat.shape)}"
            )
        views = []
        for param in self.layout.params:
            geo = param.geometry
            start = param.storage_offset // dtype.itemsize
            padded = flat[start : start + geo.shard_numel].view(geo.padded_shard_shape)
            views.append(padded.narrow(geo.dim, 0, geo.local_length(self.shard_rank)))
        return tuple(views)

    def reduce_into_flat_layout(self) -> None:
        """From the next backward on, reduce the group's gradients laid out as :meth:`flat_shard`.

        A reduction of every parameter's gradient then lands in one 1-D tensor of the
        parameters' dtype, laid out as the flat shard (gaps zeroed), and each sharded
        gradient is a view of it: :meth:`flat_grad_of` finds that tensor, so an adapter that
        keeps one flat gradient (FSDP1's flat parameters) takes it as it is instead of copying
        every gradient into one. The values are the same either way; the reduction carries the
        alignment gaps too (a few elements per parameter).

        Raises:
            ValueError: the group has no flat shard (see :meth:`flat_shard`).
        """
        self._flat_dtype()
        self._group.reduce_in_flat_layout()

    def flat_grad_of(self, index: int) -> torch.Tensor | None:
        """The flat gradient that parameter ``index``'s gradient is a view of, if it is one.

        That is: a 1-D tensor laid out as :meth:`flat_shard`, over the same memory, where
        :meth:`local_views` of it gives the gradient's slot for ``index`` at exactly that
        gradient. None where the gradient is missing or is not such a view (it was not
        reduced in the flat layout, see :meth:`reduce_into_flat_layout`, or is the user's).
        """
        dtype = self._flat_dtype()
        grad = self.params[index].param.grad
        if grad is None:
            return None
        local: torch.Tensor = grad.to_local() if isinstance(grad, DTensor) else grad
        numel = self.layout.sharded_bytes // dtype.itemsize
        storage = local.untyped_storage()
        param = self.layout.params[index]
        geo = param.geometry
        expected = torch.empty(geo.padded_shard_shape, device="meta").narrow(
            geo.dim, 0, geo.local_length(self.shard_rank)
        )
        if (
            local.dtype != dtype
            or storage.nbytes() != numel * dtype.itemsize
            or local.storage_offset() != param.storage_offset // dtype.itemsize
            or local.shape != expected.shape
            or any(
                size > 1 and a != b
                for size, a, b in zip(local.shape, local.stride(), expected.stride(), strict=True)
            )
        ):
            return None
        return local.new_empty(0).set_(storage, 0, (numel,), (1,))

    def reduce_accumulated_grads(self, enabled: bool) -> None:
        """Whether a gradient already on a parameter is reduced again with the next one.

        For FSDP1's ``NO_SHARD``, which lets a backward's gradient join the reduced one on the
        parameter before its all-reduce, and gives each parameter the result: the same mean
        as reducing the new gradient alone and adding it (torch's way, the default), rounded
        as FSDP1 rounds it, in the reduce dtype too.

        Raises:
            ValueError: the group has a shard axis of more than one rank (FSDP1 reduces a
                sharded gradient alone, as torch does).
        """
        if enabled and self._group.mesh_info.shard_size != 1:
            raise ValueError(
                f"FSDP module {self.fqn}: gradients already there are reduced again only "
                "without sharding (a mesh whose shard axis has one rank)"
            )
        self._group.options.reduce_accumulated_grads = enabled

    def end_at_last_grad(self, enabled: bool) -> None:
        """Whether the group's backward ends at its last gradient, as FSDP1's flat parameter's.

        True: at its count, even where missing gradients are reduced as zeros, with no watch
        on its forward inputs (FSDP1 adds no autograd node there, and one changes the order in
        which autograd sums the gradients of a tensor used in several places). False (the
        default): where every rank's backward ends it, whatever parameters the rank used
        ([Note: post-backward trigger]).
        """
        self._group.options.ends_at_last_grad = enabled

    def accumulate_unsynced_grads_in_param_dtype(self, enabled: bool) -> None:
        """Where gradients accumulate between backwards without gradient sync.

        True: in the dtype the forward computes in (mixed precision's ``param_dtype``), as
        autograd accumulates FSDP1's unsharded flat gradient, cast to the reduce dtype when
        a backward reduces them. False (torch's way, the default): in the reduce dtype.
        """
        self._group.accumulate_unsynced_in_param_dtype(enabled)

    def list_params(self, listed: bool) -> None:
        """Whether ``parameters()`` and ``state_dict()`` of the group's modules list its parameters.

        True (the default, as torch's ``fully_shard``): registered in ``_parameters``. False:
        held as plain attributes instead (``module.weight`` still reads them in a forward, the
        engine swaps sharded and unsharded ones as before), so an adapter can list a flat
        parameter in their place; ``module.to()`` on the group's module still moves them.
        Setting it back to True puts each at its old place in ``_parameters``.
        """
        self._group.list_params(listed)

    def _flat_dtype(self) -> torch.dtype:
        hooked = [p.fqn for p in self.layout.params if p.all_gather_hooks]
        if hooked:
            raise ValueError(
                f"FSDP module {self.fqn}: {', '.join(hooked)} is gathered through all-gather "
                "hooks, so its shard is not in the group's flat buffer"
            )
        dtypes = {p.dtype for p in self.layout.params}
        if len(dtypes) != 1:
            raise ValueError(
                f"FSDP module {self.fqn}: its parameters have different dtypes "
                f"({', '.join(sorted(str(d) for d in dtypes))}); a flat shard has one"
            )
        return dtypes.pop()


def layout_of(module: nn.Module) -> tuple[GroupView, ...]:
    """The parameter groups of every ``fully_shard`` call in ``module``'s tree, outermost first.

    Raises:
        TypeError: nothing in ``module``'s tree was sharded with shardkit's ``fully_shard``.
    """
    states = states_under(module)
    if not states:
        raise TypeError(
            f"{type(module).__name__}: no module in its tree is sharded with shardkit's fully_shard"
        )
    names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
    views: list[GroupView] = []
    for group in (g for s in states for g in s.groups):
        rank = group.mesh_info.shard_rank
        params = tuple(
            ShardedParamView(pl, _keys_of(p.slots, names), p.sharded_param, rank)
            for pl, p in zip(group.layout.params, group.params, strict=True)
        )
        fqn = ", ".join(names.get(id(m), "") or "<root>" for m in group.modules)
        views.append(
            GroupView(fqn, group.modules, group.layout, group.mesh_info.mesh, rank, params, group)
        )
    return tuple(views)


def _keys_of(slots: Iterable[ParamSlot], names: dict[int, str]) -> tuple[str, ...]:
    return tuple(
        f"{names[id(slot.module)]}.{slot.name}".lstrip(".")
        for slot in slots
        if id(slot.module) in names
    )


def wire_row_bytes(policy: ReducePrecision | None, numel: int, itemsize: int) -> int:
    """Bytes of one row of ``numel`` gradients in a reduction's messages under ``policy``.

    ``itemsize``: the reduce dtype's, the row's size without a wire format (None, or a policy
    that does not compress). See [Note: precision-aware reduction].
    """
    if policy is None or not isinstance(policy.wire_dtype, torch.dtype):
        return numel * itemsize
    fmt = WireFormat(policy.wire_dtype, policy.block_size, policy.stochastic_rounding)
    return fmt.row_bytes(numel)
