"""A group's parameters gathered through all-gather hooks: their part of each unshard.

A parameter whose tensor subclass defines ``fsdp_pre_all_gather`` and
``fsdp_post_all_gather`` (Float8, NF4) joins its group's one all-gather with what its pre hook
returns, and builds its unsharded parameter from what came back. One parameter's hooks are
``engine/gather_hooks``'s (``AllGatherHooks``); :class:`GroupHooks` does the group's part for
all such parameters of one group: it asks each pre hook, copies what they return into the
gather input, and has each parameter finish, bind, adopt or free what its hooks made. See
[Note: all-gather extensions].
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from shardkit.core.engine.buffer_layout import GroupLayout
from shardkit.core.engine.gather_hooks import AllGatherHooks, HookCall
from shardkit.core.engine.param import FSDPParam
from shardkit.core.policies import MixedPrecisionPolicy, resolved
from shardkit.core.runtime.dtensors import local_of

__all__ = ["GroupHooks"]


class GroupHooks:
    """A group's parameters with all-gather hooks: their part of its unshards and reshards.

    They join the group's one all-gather: each sends its pre hook's tensors in its slot of
    the group's (byte) gather input, and builds its unsharded parameter from its slot of
    every rank's row.
    """

    def __init__(self, params: Mapping[int, FSDPParam], calls: Mapping[int, HookCall]) -> None:
        self.params = dict(params)  # by index in the group
        self.calls = dict(calls)

    @staticmethod
    def of(
        params: Sequence[FSDPParam],
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy,
        device: torch.device | None,
    ) -> GroupHooks | None:
        """The hooked parameters among a group's ``params`` (None if there is none).

        Args:
            params: the group's parameters.
            mesh: the shard axis's mesh.
            mp_policy: the group's mixed precision policy.
            device: where local tensors move before the pre hook (offloading), or None.
        """
        hooked = {i: p for i, p in enumerate(params) if p.hooks is not None}
        if not hooked:
            return None
        calls = {
            i: HookCall(
                mesh,
                p.slots[0].module,
                resolved(mp_policy, p.orig_dtype if p.keeps_own_dtype else None),
                device,
            )
            for i, p in hooked.items()
        }
        return GroupHooks(hooked, calls)

    def pre_all_gather(self, module_fqn: str) -> dict[int, list[torch.Tensor]]:
        """What each pre hook sends, flat, by parameter index (``module_fqn``: for errors)."""
        sent: dict[int, list[torch.Tensor]] = {}
        for i, p in self.params.items():
            assert p.hooks is not None
            local = local_of(p.sharded_param)
            sent[i] = p.hooks.pre_all_gather(local, self.calls[i], module_fqn)
        return sent

    def copy_in(
        self, sent: Mapping[int, list[torch.Tensor]], staging: torch.Tensor, layout: GroupLayout
    ) -> None:
        """Write what the pre hooks returned into their slots of the gather input."""
        for i, tensors in sent.items():
            inputs = layout.params[i].all_gather_inputs
            assert inputs is not None, f"{self.params[i].fqn}: hook inputs not laid out"
            AllGatherHooks.copy_in(tensors, layout.comm.view(staging, i), inputs)

    def finish_unshard(self) -> None:
        """Build or refresh each unsharded parameter from its filled all-gather outputs."""
        for p in self.params.values():
            p.finish_hooked_unshard()

    def bind_own_storage(self, device: torch.device) -> None:
        """Give each parameter its shard in storage of its own, on ``device``."""
        for p in self.params.values():
            p.bind_own_storage(device)

    def adopt(self, locals_: Sequence[torch.Tensor]) -> None:
        """Take up new local tensors (``_apply``, ``assign=True`` loads), by group index."""
        for i, p in self.params.items():
            p.adopt_own_local(locals_[i])

    def free(self) -> None:
        """Free the hooks' outputs and unsharded tensors (reshard)."""
        for p in self.params.values():
            assert p.hooks is not None
            p.hooks.free()
