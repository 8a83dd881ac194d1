"""FSDPParam: the sharded and unsharded views of one parameter.

A parameter has two lives. Sharded: an ``nn.Parameter`` wrapping a DTensor whose local tensor
is a view into its group's flat sharded buffer; this object is what the optimizer and the
state dict see, and it never changes identity. Unsharded: a plain ``nn.Parameter`` viewing the
group's unsharded buffer, registered on the module only between unshard and reshard. Both
buffers belong to the group (see [Note: flat group buffers]); this class holds the views.

A tensor subclass with all-gather hooks is the exception: its local tensor is the subclass,
with storage of its own, and its unsharded parameter is what its post-all-gather hook builds
(see [Note: all-gather extensions]).

The dtype its full gradients accumulate in inside autograd (torch 2.15 on) is held in
``grad_accumulation``, the ``grad_dtype`` its user set in ``grad_policy``: both are
``grad_dtype_policy``'s.

Next to split off: the unsharded gradient across no-sync backwards
(``take_unsharded_grad``, ``stash_unsharded_grad``, ``_accumulate``), as functions taking the
FSDPParam, into ``param_grads.py``: they read only ``unsharded_param``, ``accumulated_grad``,
``grad_accumulation`` and the extension, and their callers (``group/unsynced``, ``reduce/``) are
outside this module already.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardkit.core.engine.gather_hooks import (
    AllGatherHooks,
    has_all_gather_hooks,
    releases_outputs_after_post,
)
from shardkit.core.engine.grad_dtype_policy import (
    GradAccumulation,
    GradDtypePolicy,
    take_grad_policy,
)
from shardkit.core.engine.local_step import allow_local_step
from shardkit.core.engine.mesh_info import MeshInfo
from shardkit.core.engine.param_layout import ParamSpec
from shardkit.core.engine.param_listing import ParamSlot, read_slot, write_slot
from shardkit.core.engine.weak_hooks import weak_grad_hook
from shardkit.core.errors import UnsupportedWithHooksError
from shardkit.core.extensions import DataParallelSharding, ParamShardingSpec, ShardingExtension
from shardkit.core.runtime.buffers import ShardGeometry, shard_geometry
from shardkit.core.runtime.dtensors import contiguous_strides, local_of, set_local

__all__ = ["FSDPParam", "ParamSlot", "Sharding"]


@dataclass(frozen=True, slots=True)
class Sharding:
    """How a parameter is sharded: the extension that handles it and its description."""

    extension: ShardingExtension
    spec: ParamShardingSpec


_PRE_HOOK = "fsdp_pre_all_gather"


class FSDPParam:
    """Sharded and unsharded views of one parameter, and where it is registered."""

    fqn: str
    slots: tuple[ParamSlot, ...]  # a tied parameter has several
    geometry: ShardGeometry
    orig_dtype: torch.dtype
    comm_dtype: torch.dtype  # dtype of the unsharded parameter (param_dtype or original)
    keeps_own_dtype: bool  # param_dtype_override_fn keeps it out of param_dtype
    sharded_param: nn.Parameter  # wraps a DTensor; its identity never changes
    unsharded_param: nn.Parameter | None  # created at the first unshard
    accumulated_grad: torch.Tensor | None  # no-sync accumulation in the reduce dtype (<2.15)
    grad_accumulation: GradAccumulation  # torch 2.15 on: the unsharded param's grad_dtype
    grad_policy: GradDtypePolicy  # the grad_dtype its user set (torch 2.15 on)
    hooks: AllGatherHooks | None  # a subclass gathered through its all-gather hooks

    def __init__(
        self,
        param: nn.Parameter,
        fqn: str,
        slots: tuple[ParamSlot, ...],
        sharding: Sharding,
        mesh_info: MeshInfo,
    ) -> None:
        self.fqn = fqn
        self.slots = slots
        self.mesh_info = mesh_info
        self.extension = sharding.extension
        self.sharding_spec = sharding.spec
        local = sharding.spec.local
        self.geometry = shard_geometry(local.shape, sharding.spec.shard_dim, mesh_info.shard_size)
        self.orig_dtype = local.dtype
        self.comm_dtype = local.dtype
        self.keeps_own_dtype = False  # set by fully_shard from param_dtype_override_fn
        self.hooks = self._hooks_of(local, sharding.extension)
        self._grad_hook_added = False  # on the unsharded parameter, once it needs one
        self.unsharded_param = None
        self.accumulated_grad = None
        self.grad_accumulation = GradAccumulation()  # set with comm_dtype by the group's plan
        self.grad_policy = GradDtypePolicy.of(param)
        # The tensor dp shards, until the group has copied this rank's shard of it.
        self._source: torch.Tensor | None = local
        # Weak: users elsewhere may still hold the original (a tie across groups is an error).
        self.original_ref = weakref.ref(param)
        self.sharded_param = param  # replaced by bind_sharded() before anyone sees it
        self._own: torch.Tensor | None = None  # a hooked parameter's local tensor, as bound
        # False: registered as plain attributes, not in _parameters (see param_listing).
        self.listed = True

    def _hooks_of(self, local: torch.Tensor, extension: ShardingExtension) -> AllGatherHooks | None:
        if not has_all_gather_hooks(local, self.fqn):
            return None
        if not isinstance(extension, DataParallelSharding):
            raise UnsupportedWithHooksError(
                f"parameter {self.fqn}: all-gather hooks (fsdp_pre_all_gather) on a parameter "
                f"that {type(extension).__name__} shards (tensor parallelism) are not "
                "supported yet"
            )
        release = releases_outputs_after_post(local, self.fqn)
        return AllGatherHooks(self.fqn, self.geometry, release_after_post=release)

    def retype(self, dtype: torch.dtype) -> None:
        """The parameter now has ``dtype`` (a module ``.to(dtype)``); unshard anew."""
        self.orig_dtype = dtype
        self.comm_dtype = dtype  # the group applies param_dtype again
        self.unsharded_param = None
        self._grad_hook_added = False
        if self.hooks is not None:
            self.hooks.reset(inputs=True)  # the hook may send other tensors now

    def follow_plan_dtypes(
        self, comm_dtype: torch.dtype, reduce_dtype: torch.dtype, *, any_dtype: bool = False
    ) -> None:
        """Take the group plan's dtypes: the unsharded parameter's, and its gradient's.

        ``reduce_dtype``: the one full gradients accumulate in (the plan's reduce dtype, or
        ``comm_dtype`` where the group accumulates as FSDP1 does). From torch 2.15 on,
        gradients accumulate in it inside autograd, through the unsharded parameter's
        ``grad_dtype`` (``any_dtype``: None there, as its user set). See [Note: post-backward
        trigger].
        """
        self.comm_dtype = comm_dtype
        accumulation = self.grad_accumulation  # see grad_dtype_policy.GradAccumulation.follow
        accumulation.follow(self.sharding_spec, comm_dtype, reduce_dtype, any_dtype=any_dtype)
        param = self.unsharded_param
        if param is not None and param.grad is None:
            accumulation.set_on(param)

    @property
    def requires_grad(self) -> bool:
        """Whether the parameter trains now: the user may change it at any time."""
        return self.sharded_param.requires_grad

    @property
    def sharded_grad_dtype(self) -> torch.dtype | None:
        """The sharded gradient's dtype (None: the reduction's, as its user allowed)."""
        return self.grad_policy.sharded_grad_dtype(self.orig_dtype)

    @property
    def spec(self) -> ParamSpec:
        """What the layout needs of this parameter."""
        geo = self.geometry
        return ParamSpec(
            fqn=self.fqn,
            shape=tuple(geo.shape),
            dtype=self.orig_dtype,
            requires_grad=self.requires_grad,
            shard_dim=geo.dim,
            all_gather_hooks=self.hooks is not None,
            all_gather_inputs=self.hooks.inputs if self.hooks is not None else None,
            keeps_own_dtype=self.keeps_own_dtype,
            grad_dtype_policy=(self.grad_policy.explicit, self.grad_policy.dtype),
        )

    # --- sharded side ---------------------------------------------------------------------

    def padded_shard_of_source(self) -> torch.Tensor:
        """This rank's padded shard of the original parameter, flat (for the first copy-in)."""
        assert self._source is not None, f"{self.fqn}: the source was already copied"
        source = self._source.detach()
        if source.is_meta:
            return torch.empty(self.geometry.shard_numel, dtype=self.orig_dtype, device="meta")
        return self.geometry.padded_shard(source, self.mesh_info.shard_rank)

    def local_view(self, flat: torch.Tensor) -> torch.Tensor:
        """The unpadded local shard as a view of this parameter's slot in the flat buffer."""
        geo = self.geometry
        rank = self.mesh_info.shard_rank
        padded = flat.view(geo.padded_shard_shape)
        return padded.narrow(geo.dim, 0, geo.local_length(rank))

    def local_at(self, flat: torch.Tensor, offset: int) -> torch.Tensor:
        """As :meth:`local_view`, of the padded shard at element ``offset`` of 1-D ``flat``.

        One ``as_strided`` where slicing and viewing would take three operations: the
        reduction assigns every gradient of every step this way.
        """
        geo = self.geometry
        return flat.as_strided(
            geo.local_shape(self.mesh_info.shard_rank),
            contiguous_strides(geo.padded_shard_shape),
            flat.storage_offset() + offset,
        )

    def bind_sharded(self, flat: torch.Tensor) -> None:
        """Make the sharded DTensor parameter view ``flat`` (this param's padded shard)."""
        self._bind_local(self.local_view(flat))

    def bind_own_storage(self, device: torch.device) -> None:
        """Give a parameter with all-gather hooks its shard in storage of its own.

        The shard stays the subclass (its hooks run on it, the optimizer steps it), which a
        view of the group's byte buffer cannot be. As torch does, the subclass's own
        operators zero-pad the shard, and the local tensor is its unpadded part.
        """
        assert self._source is not None, f"{self.fqn}: the source was already copied"
        shard = self.geometry.local_shard(self._source.detach(), self.mesh_info.shard_rank)
        self._bind_local(self._padded_own(shard, device))

    def adopt_own_local(self, local: torch.Tensor) -> None:
        """A hooked parameter's new local tensor (after ``_apply`` or an ``assign=True`` load).

        Raises:
            TypeError: the new local tensor has no all-gather hooks.
        """
        if local is self._own or local.is_meta:
            return
        if not has_all_gather_hooks(local, self.fqn):
            raise TypeError(
                f"parameter {self.fqn} is gathered through all-gather hooks, but its new "
                f"local tensor ({type(local).__name__}) has none: load or convert it as the "
                "same tensor subclass"
            )
        with torch.no_grad():
            self._bind_local(self._padded_own(local, local.device))
        self.unsharded_param = None
        assert self.hooks is not None
        self.hooks.reset(inputs=False)

    def gained_hooks(self) -> bool:
        """Whether the local tensor has all-gather hooks now, where it had none before.

        Hooks may be attached after ``fully_shard`` (to the local tensor itself, or to its
        class); torch's ``fully_shard`` looks for them at every all-gather, and so does the
        group. See [Note: all-gather extensions].
        """
        # The pre hook alone, as torch looks at each all-gather (one hasattr: this runs for
        # every flat parameter at every root forward); take_up_hooks checks both.
        return self.hooks is None and hasattr(local_of(self.sharded_param), _PRE_HOOK)

    def take_up_hooks(self) -> None:
        """Gather this parameter through the hooks its local tensor has gained.

        Its shard moves out of the group's flat buffer into storage of its own (padded),
        and the local tensor object stays the same: hooks set on the instance go with it.
        """
        local = local_of(self.sharded_param)
        self.hooks = self._hooks_of(local, self.extension)
        shard = self._padded_own(local.detach(), local.device)
        with torch.no_grad():
            local.set_(
                shard.untyped_storage(), shard.storage_offset(), shard.size(), shard.stride()
            )
        self._own = local
        self.unsharded_param = None
        self._grad_hook_added = False

    def _padded_own(self, shard: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``shard`` (this rank's, unpadded) zero padded in new storage; its unpadded part."""
        geo = self.geometry
        length = shard.shape[geo.dim]
        padded = shard.new_zeros(
            geo.padded_shard_shape, device=shard.device if shard.is_meta else device
        )
        if not shard.is_meta:
            padded.narrow(geo.dim, 0, length).copy_(shard)
        self._own = padded.narrow(geo.dim, 0, length)
        return self._own

    def _bind_local(self, local: torch.Tensor) -> None:
        if self._source is None:
            # Keep the Parameter object (optimizers and the state dict hold it); re-point it.
            set_local(self.sharded_param, local)
            return
        dtensor = self.extension.make_sharded(local, self.sharding_spec)
        self.sharded_param = nn.Parameter(dtensor, requires_grad=self.requires_grad)
        self.grad_policy.put_on(self.sharded_param)
        self._allow_local_step()
        # The group's buffer now holds the only copy we keep: let the original go.
        self._source = None
        spec = self.sharding_spec
        self.sharding_spec = replace(spec, local=torch.empty_like(spec.local, device="meta"))

    def _allow_local_step(self) -> None:
        # A subclass local tensor (all-gather hooks) keeps its own dispatch: step it as is.
        if self.hooks is None:
            allow_local_step(self)

    def current_local(self) -> torch.Tensor:
        """The local tensor that the registered sharded parameter holds right now."""
        param = read_slot(self.slots[0])
        if isinstance(param, DTensor) and param is not self.sharded_param:
            # load_state_dict(assign=True) or _apply put a new object in place: adopt it.
            take_grad_policy(self)  # a grad_dtype set on the one it replaces, then its own
            self.grad_policy.take_from(param)
            self.sharded_param = param
            self._allow_local_step()
            self.grad_policy.put_on(param)
        return local_of(self.sharded_param)

    # --- unsharded side -------------------------------------------------------------------

    def bind_unsharded(self, padded_flat: torch.Tensor) -> None:
        """Create the unsharded Parameter once, viewing ``padded_flat`` (W * shard_numel)."""
        numel = self.geometry.shape.numel()
        view = padded_flat[:numel].view(self.geometry.shape)
        unsharded = self.extension.make_unsharded(view, self.sharding_spec)
        param = nn.Parameter(unsharded, requires_grad=self.requires_grad)
        self.grad_accumulation.set_on(param)
        self.unsharded_param = param
        self._grad_hook_added = False  # a new Parameter: its gradient hook is still to add

    def finish_hooked_unshard(self) -> None:
        """Build or refresh the unsharded parameter from the filled hook outputs."""
        hooks = self.hooks
        assert hooks is not None, f"{self.fqn}: no all-gather hooks"
        outputs = hooks.outputs()
        local = local_of(self.sharded_param)
        if self.unsharded_param is not None:
            hooks.post_all_gather(local, outputs, self.comm_dtype, out=self.unsharded_param)
            return
        tensor = hooks.post_all_gather(local, outputs, self.comm_dtype, out=None)
        assert tensor is not None
        shape = self.geometry.shape
        # Padding rows past the full size (an uneven dim 0) are cut off here, as torch does.
        full = torch.as_strided(tensor, shape, contiguous_strides(shape), 0)
        self.unsharded_param = nn.Parameter(full, requires_grad=self.requires_grad)
        self.grad_accumulation.set_on(self.unsharded_param)
        self._grad_hook_added = False

    def follow_requires_grad(self, on_grad_ready: Callable[[torch.Tensor], None]) -> None:
        """Give the unsharded parameter the sharded one's ``requires_grad``, as it is now.

        Users freeze and unfreeze parameters between steps (fine-tuning schedules) on the
        parameters they see, the sharded ones; the engine follows at each unshard. A trainable
        parameter's gradient hook calls ``on_grad_ready`` (added once, on first need; a bound
        method, held weakly: see ``weak_grad_hook``).
        """
        param = self.unsharded_param
        assert param is not None, f"{self.fqn}: unsharded parameter used before creation"
        wanted = self.sharded_param.requires_grad
        if param.requires_grad != wanted:
            param.requires_grad_(wanted)
        if wanted and not self._grad_hook_added:
            param.register_post_accumulate_grad_hook(weak_grad_hook(on_grad_ready))
            self._grad_hook_added = True

    def register(self, unsharded: bool) -> None:
        """Put the sharded or the unsharded Parameter on every module slot."""
        param = self.unsharded_param if unsharded else self.sharded_param
        assert param is not None, f"{self.fqn}: unsharded parameter used before creation"
        for slot in self.slots:
            write_slot(slot, param, self.listed)

    def take_unsharded_grad(self) -> torch.Tensor | None:
        """The full gradient accumulated so far (no-sync steps included), local; clears it.

        The sum over backwards comes before TP settles it (``grad_local``), as in
        :meth:`stash_unsharded_grad`.
        """
        param = self.unsharded_param
        grad = param.grad if param is not None else None
        if param is not None:
            param.grad = None
            self.grad_accumulation.upcast_held(param)  # none is held: autograd's cast is back on
        acc = self.accumulated_grad
        self.accumulated_grad = None
        if acc is not None:
            grad = acc if grad is None else self._accumulate(acc, grad)
        if grad is None:
            return None
        return self.extension.grad_local(grad, self.sharding_spec)

    def stash_unsharded_grad(self, reduce_dtype: torch.dtype) -> None:
        """Between no-sync backwards: keep the full gradient, accumulated in ``reduce_dtype``.

        Before torch 2.15, in a copy of its own; from 2.15 on (as torch does), in ``.grad``,
        where autograd adds the next backward's gradient in that dtype. A gradient TP has not
        settled yet (a sequence-parallel norm's, ``Partial`` over tp) is kept as it is: the
        backwards' sum is settled once, in the reduce dtype, where the reduction takes it, as
        torch's engine does; settled per backward, TP would sum each in the compute dtype
        (bf16), and in another order (pipeline stages with TP differed from torch's there).
        """
        if self.grad_accumulation.dtype is not None and self.accumulated_grad is None:
            self.grad_accumulation.upcast_held(self.unsharded_param)
            return
        param = self.unsharded_param
        if param is None or param.grad is None:
            return
        if param.grad.dtype == reduce_dtype and self.accumulated_grad is None:
            return  # autograd keeps accumulating into .grad in this dtype
        grad, param.grad = param.grad, None
        if self.accumulated_grad is None:
            self.accumulated_grad = grad.to(reduce_dtype)
        else:
            self._accumulate(self.accumulated_grad, grad)

    def _accumulate(self, acc: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """``acc += grad``, in ``acc``'s dtype.

        TP settles ``grad`` first where ``acc`` is local: FSDP1's ``NO_SHARD`` puts a reduced,
        local gradient there (``unsynced``).
        """
        if isinstance(grad, DTensor) and not isinstance(acc, DTensor):
            grad = self.extension.grad_local(grad, self.sharding_spec)
        return acc.add_(grad)

    def __repr__(self) -> str:
        return f"FSDPParam({self.fqn}, shape={tuple(self.geometry.shape)})"
