"""Parameters gathered through their tensor subclass's all-gather hooks (Float8, NF4).

A tensor-subclass parameter may define ``fsdp_pre_all_gather`` and ``fsdp_post_all_gather``,
torch's ``fully_shard`` protocol for gathering something other than the parameter's own
values: before each all-gather the engine asks the sharded local tensor (still the subclass)
for the tensors to send (int8 data and scales, say), and after it hands the gathered tensors
to the post hook, which builds the unsharded parameter. :class:`AllGatherHooks` calls both
hooks for one parameter and owns what they produce from one unshard to the next. A group's
part of each unshard and reshard for such parameters is ``group/hooked_params``'s
(``GroupHooks``). See [Note: all-gather extensions].
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardkit.core.engine.param_layout import HookInput
from shardkit.core.errors import AllGatherHookError, AllGatherInputError
from shardkit.core.policies import MixedPrecisionPolicy
from shardkit.core.runtime.buffers import FlatLayout, ShardGeometry, shard_geometry
from shardkit.core.runtime.dtensors import contiguous_strides
from shardkit.core.runtime.watch.lifetimes import check_release
from shardkit.core.runtime.watch.progress import SETTINGS

__all__ = [
    "AllGatherHooks",
    "HookCall",
    "has_all_gather_hooks",
    "releases_outputs_after_post",
]

_PRE = "fsdp_pre_all_gather"
_POST = "fsdp_post_all_gather"
# torch 2.15's third, optional hook: the subclass says its post hook's result does not view
# the all-gather outputs, so their memory can go as soon as the post hook has run.
_RELEASE = "fsdp_should_release_all_gather_outputs_after_post_all_gather"


def has_all_gather_hooks(tensor: torch.Tensor, fqn: str) -> bool:
    """Whether ``tensor`` (the parameter named ``fqn``) is gathered through its hooks.

    Raises:
        AllGatherHookError: it defines one hook without the other.
    """
    pre, post = hasattr(tensor, _PRE), hasattr(tensor, _POST)
    if pre != post:
        have, lack = (_PRE, _POST) if pre else (_POST, _PRE)
        raise AllGatherHookError(
            f"Both {_PRE} and {_POST} should be defined if using all-gather extensions: "
            f"parameter {fqn} ({type(tensor).__name__}) defines {have} but not {lack}; define "
            "both, or neither to be gathered as a plain tensor"
        )
    if hasattr(tensor, _RELEASE) and not post:
        raise AllGatherHookError(
            f"{_RELEASE} requires {_PRE} and {_POST} to be defined: parameter {fqn} "
            f"({type(tensor).__name__}) defines it without them"
        )
    return pre


def releases_outputs_after_post(tensor: torch.Tensor, fqn: str) -> bool:
    """Whether the all-gather outputs of ``tensor`` (parameter ``fqn``) go after its post hook.

    As its ``fsdp_should_release_all_gather_outputs_after_post_all_gather`` answers (asked
    once, at ``fully_shard``, as torch asks; False without the hook).

    Freeing them early lowers the peak by one gathered copy per such parameter while it stays
    unsharded (``reshard_after_forward=False``, or between forward and backward); the next
    unshard allocates them again. Only the subclass knows that its post hook's tensors do not
    view them (MXFP8's do not, a plain dequantized view would), so the default keeps them.

    Raises:
        AllGatherHookError: the hook returns something other than a bool.
    """
    hook = getattr(tensor, _RELEASE, None)
    if hook is None:
        return False
    answer = hook()
    if not isinstance(answer, bool):
        raise AllGatherHookError(
            f"{_RELEASE} must return a bool, got {type(answer)} (parameter {fqn}, "
            f"{type(tensor).__name__})"
        )
    return answer


@dataclass(frozen=True, slots=True)
class HookCall:
    """What ``fsdp_pre_all_gather`` is given besides the tensor (its five-argument form)."""

    mesh: DeviceMesh
    """The mesh of the shard axis (1-D; the shard sub-mesh under HSDP)."""
    module: nn.Module
    """The module that holds the parameter."""
    mp_policy: MixedPrecisionPolicy
    """The group's mixed precision policy."""
    device: torch.device | None
    """Where the local tensor is moved before the hook (CPU offloading), or None."""


class AllGatherHooks:
    """One parameter's all-gather hooks, and what they produce from unshard to reshard.

    The all-gather outputs are allocated at the first unshard and kept: reshard frees their
    memory and unshard re-allocates it (storage resizing), as for the tensors the post hook
    returned, so the objects stay the same. Subclasses rely on that: the post hook's ``out=``
    form finds its earlier outputs (NF4 checks they are the same storage), and autograd may
    have saved the unsharded parameter that views them.
    """

    def __init__(
        self, fqn: str, geometry: ShardGeometry, *, release_after_post: bool = False
    ) -> None:
        self.fqn = fqn
        self.geometry = geometry
        self.release_after_post = release_after_post
        """The outputs' memory goes right after the post hook (see releases_outputs_after_post)."""
        self.inputs: tuple[HookInput, ...] | None = None
        """Numel and dtype of each tensor the pre hook returns; learnt at its first call."""
        self._sizes: tuple[torch.Size, ...] = ()  # of the pre hook's tensors (post hook views)
        self._metadata: Any = None  # from the pre hook, for the next post hook
        self._long_form: bool | None = None  # the pre hook takes five arguments
        self._outputs: list[torch.Tensor] = []  # 1D, W times each input: what the hook sees
        self._writers: list[torch.Tensor] = []  # the outputs' storage, own version counters
        self._inner: tuple[torch.Tensor, ...] = ()  # the post hook's tensors to free

    def pre_all_gather(
        self, local: torch.Tensor, call: HookCall, module_fqn: str
    ) -> list[torch.Tensor]:
        """Call ``fsdp_pre_all_gather`` on the sharded local tensor; its tensors, flat.

        ``module_fqn`` names the group's module in errors.

        Raises:
            AllGatherHookError: the hook takes neither one nor five arguments.
            AllGatherInputError: its tensors cannot be gathered (see ``_check``).
        """
        if call.device is not None:
            local = local.to(call.device, non_blocking=True)
        hook = getattr(local, _PRE)
        name = f"{self.fqn} of FSDP module {module_fqn or '<root>'}"
        if self._long_form is None:
            self._long_form = _takes_five_arguments(hook, name)
        shape = self.geometry.shape
        if self._long_form:
            stride = contiguous_strides(shape)
            tensors, self._metadata = hook(call.mesh, shape, stride, call.module, call.mp_policy)
        else:
            tensors, self._metadata = hook(call.mesh)
        self._check(tensors, name)
        self._sizes = tuple(t.size() for t in tensors)
        return [t.view(-1) for t in tensors]

    def _check(self, tensors: Sequence[torch.Tensor], name: str) -> None:
        geo = self.geometry
        sizes = [t.size() for t in tensors]
        if not geo.is_even and any(size != geo.padded_shard_shape for size in sizes):
            # torch checks this on the ranks with a short shard only, and the others then wait
            # in the all-gather; every rank checks here, so all of them raise.
            raise AllGatherInputError(
                "When a parameter is unevenly sharded by FSDP (orig size="
                f"{geo.shape}, FSDP world size={geo.world}), fsdp_pre_all_gather must return "
                f"all-gather inputs with the padded sharded size {geo.padded_shard_shape} but "
                f"got {sizes} (parameter {name}: pad the shard's tensors to that size)"
            )
        if geo.dim != 0 and any(t.numel() != geo.shard_numel for t in tensors):
            raise AllGatherInputError(
                f"parameter {name} is sharded on dim {geo.dim}: fsdp_pre_all_gather must "
                f"return tensors of the shard's size {geo.padded_shard_shape} (torch's "
                f"fully_shard puts them back together along that dim too), got {sizes}"
            )
        found = tuple(HookInput(t.numel(), t.dtype) for t in tensors)
        if self.inputs is None:
            self.inputs = found
        elif found != self.inputs:
            raise AllGatherInputError(
                f"fsdp_pre_all_gather of parameter {name} returned {found}, but "
                f"{self.inputs} at the first unshard: the group's all-gather is laid out once, "
                "so the hook must return the same sizes and dtypes every time"
            )

    @staticmethod
    def copy_in(flat: Sequence[torch.Tensor], slot: torch.Tensor, layout: FlatLayout) -> None:
        """Write the pre hook's tensors into this parameter's slot (bytes) of the gather input."""
        for k, tensor in enumerate(flat):
            layout.view(slot, k).copy_(tensor)

    def output_writers(
        self, world: int, layout: FlatLayout, device: torch.device
    ) -> list[torch.Tensor]:
        """The all-gather outputs, with their memory, as 1-D tensors to write the rows into.

        Output k holds ``world`` times the pre hook's tensor k (``layout`` says where those lie
        in this parameter's slot of a row), rank after rank along the shard dim. Made at the
        first unshard, their memory re-allocated at later ones; the writers alias them (see
        ``_alias``) and stay the same objects until :meth:`reset`.
        """
        if not self._outputs:
            self._outputs = [
                torch.empty(world * n, dtype=dtype, device=device)
                for n, dtype in zip(layout.numels, layout.dtypes, strict=True)
            ]
            self._writers = [_alias(t) for t in self._outputs]
        else:
            for tensor in self._outputs:
                _allocate(tensor)
        return self._writers

    def output_geometry(self, k: int, numel: int, world: int) -> ShardGeometry:
        """How output ``k`` (``numel`` elements per rank) is cut among ``world`` ranks.

        On dim 0 the ranks' tensors follow each other; on another dim each has the shard's
        size (checked) and they go back together along that dim, as torch does.
        """
        if self.geometry.dim == 0:
            return shard_geometry(torch.Size([world * numel]), 0, world)
        return self.geometry

    def outputs(self) -> tuple[torch.Tensor, ...]:
        """The filled outputs as the post hook expects them.

        Output k is viewed as ``(-1, *size_k[1:])``, ``size_k`` the size of the pre hook's
        tensor k.
        """
        return tuple(
            t.view(-1, *size[1:]) for t, size in zip(self._outputs, self._sizes, strict=True)
        )

    def post_all_gather(
        self,
        local: torch.Tensor,
        outputs: tuple[torch.Tensor, ...],
        dtype: torch.dtype,
        out: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Call ``fsdp_post_all_gather``: the first time for a new tensor, later ``out=``.

        Returns:
            The tensor it built (first call), or None (it wrote into ``out``).
        """
        hook = getattr(local, _POST)
        metadata, self._metadata = self._metadata, None
        if out is None:
            tensor, inner = hook(outputs, metadata, dtype)
            self._inner = tuple(inner)
            self._release_outputs_if_declared()
            return tensor  # type: ignore[no-any-return]  # the hook's protocol
        for tensor in self._inner:
            _allocate(tensor)
        hook(outputs, metadata, dtype, out=out)
        self._release_outputs_if_declared()
        return None

    def _release_outputs_if_declared(self) -> None:
        if self.release_after_post:
            _free_all(self._outputs, self.fqn)

    def free(self) -> None:
        """Free the memory of the outputs and of the post hook's tensors (on reshard)."""
        _free_all(chain(self._outputs, self._inner), self.fqn)

    def reset(self, *, inputs: bool) -> None:
        """Drop the outputs and the post hook's tensors (the parameter's storage changed).

        Args:
            inputs: also forget the pre hook's tensor sizes (its dtype changed, so they may).
        """
        if inputs:
            self.inputs = None
        self._sizes = ()
        self._metadata = None
        self._outputs, self._writers, self._inner = [], [], ()


def _takes_five_arguments(hook: Any, fqn: str) -> bool:
    signature = inspect.signature(hook)
    count = len(signature.parameters)
    if count not in (1, 5):
        raise AllGatherHookError(
            f"Invalid fsdp_pre_all_gather: {signature}\nExpects fsdp_pre_all_gather(self, "
            "mesh: DeviceMesh, outer_size: torch.Size, outer_stride: tuple[int, ...], "
            f"module: nn.Module, mp_policy: MixedPrecisionPolicy) (parameter {fqn}; the older "
            "fsdp_pre_all_gather(self, mesh) works too)"
        )
    return count == 5


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor on ``tensor``'s storage: writing through it leaves ``tensor``'s version.

    The copy-out writes each gather into the outputs; if the post hook's tensor views them
    and autograd saved it in forward, a version bump would fail backward.
    """
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    alias.set_(tensor.untyped_storage(), 0, tensor.shape, (1,))
    return alias


def _free_all(tensors: Iterable[torch.Tensor], fqn: str) -> None:
    """Free the memory of ``tensors`` (parameter ``fqn``'s hook tensors) that still have it."""
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.size() != 0:
            if SETTINGS.lifetime_checks:
                check_release(tensor, f"an all-gather output of parameter {fqn}")
            storage.resize_(0)


def _allocate(tensor: torch.Tensor) -> None:
    """Give a tensor whose memory was freed by ``free`` its memory back."""
    nbytes = tensor.numel() * tensor.itemsize
    storage = tensor.untyped_storage()
    if storage.size() != nbytes:
        storage.resize_(nbytes)
