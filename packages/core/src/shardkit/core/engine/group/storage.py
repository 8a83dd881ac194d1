"""A parameter group's memory: its buffers, their views, and the fused copies between them.

One :class:`GroupStorage` per group holds the sharded buffer (what the optimizer steps), the
unsharded buffer (the full parameters, between unshard and reshard), the staging copy of the
all-gather input (borrowed from the pool), and the plans that move bytes between them:

- copy-in: the shards into the all-gather input, cast or moved to the device: one copy for
  the group where the two layouts line up element for element (the layout arranges that for
  any group of one dtype), else one per parameter;
- copy-out: every rank's row into the full parameters (and into the all-gather outputs of
  parameters gathered through hooks): one ``split_with_sizes_copy`` per block of rows
  (``GatherSplit``), plus one copy per parameter sharded on a dim other than 0;
- a shard axis of one rank: the full parameters are the shards (no copy) or one copy of them.

So the copies a group launches per unshard do not grow with the world size or, where the
layouts line up, with its number of parameters. What they copy where is the group's plan
(``plan.GroupPlan``), made again, whole, when the group lays itself out anew (a dtype
change, all-gather hooks taken up): every method here is given it, and nothing here keeps a
copy of it. See [Note: flat group buffers] and [Note: unsharded storage].
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardkit.core.engine.group.plan import GroupPlan
from shardkit.core.engine.group.unsharded import UnshardedBuffer
from shardkit.core.engine.group_options import GroupOptions
from shardkit.core.engine.param import FSDPParam
from shardkit.core.runtime.buffers import ShardGeometry, rank_major_view
from shardkit.core.runtime.device import holds_no_memory, pin
from shardkit.core.runtime.gather_split import GatherSplit, SplitTarget
from shardkit.core.runtime.pool import BufferPool
from shardkit.core.runtime.protocol import CollectiveRuntime, RowBlock
from shardkit.core.runtime.watch.lifetimes import check_release
from shardkit.core.runtime.watch.progress import SETTINGS

__all__ = ["GroupStorage"]


@dataclass(frozen=True, slots=True)
class _CopyOut:
    """One row layout's copy-out: the split, then the copies the split cannot do itself."""

    split: GatherSplit
    fixups: tuple[Callable[[], None], ...]  # scratch into shards on a dim other than 0


class GroupStorage:
    """The buffers of one group and the copies between them (see the module docstring)."""

    def __init__(self, params: Sequence[FSDPParam]) -> None:
        """``params``: the group's, in its plans' order."""
        self.params = params
        self.sharded_buffer = torch.empty(0, dtype=torch.uint8)
        self.unsharded = UnshardedBuffer(params)
        self._staging: torch.Tensor | None = None  # borrowed from issue to copy-out
        self._staging_pooled = True  # False: it is a row of the receive buffer
        self._copy_outs: dict[bool, _CopyOut] = {}  # by "from the post-forward subgroup"

    def replanned(self, before: GroupPlan, after: GroupPlan) -> None:
        """The group's plan is ``after`` now; the buffers stay (see :meth:`refill`).

        The unsharded buffer stays too unless its layout or its parameters changed: the
        full parameters that view it are kept across a re-plan that does not move them.
        """
        if before.layout.unsharded != after.layout.unsharded or before.flat != after.flat:
            self.forget_unsharded()
        self._copy_outs.clear()  # built at the next copy-out, when hook outputs exist

    # --- the sharded buffer -----------------------------------------------------------------

    def init_sharded(self, plan: GroupPlan) -> None:
        """The first sharded buffer, from each parameter's source; the parameters view it."""
        shards = {i: self.params[i].padded_shard_of_source() for i in plan.flat}
        is_meta = any(s.is_meta for s in shards.values())
        device = torch.device("meta") if is_meta else plan.storage_device
        # Zeros: alignment gaps are part of a group's flat shard (layout.GroupView.flat_shard).
        buffer = torch.zeros(plan.layout.storage.nbytes, dtype=torch.uint8, device=device)
        if not is_meta:
            for i, shard in shards.items():
                plan.layout.storage.view(buffer, i).copy_(shard)
        self._adopt(plan, buffer)
        if plan.hooks is not None:
            plan.hooks.bind_own_storage(plan.storage_device)

    def refill(
        self, plan: GroupPlan, locals_: Sequence[torch.Tensor], device: torch.device
    ) -> None:
        """A new sharded buffer on ``device`` holding the flat parameters' ``locals_``.

        The parameters view it from now on; the unsharded buffer and copy plans are dropped
        (the next unshard makes them on the new device or layout).
        """
        storage = plan.layout.storage
        buffer = torch.zeros(storage.nbytes, dtype=torch.uint8, device=device)
        for i in plan.flat:
            self.params[i].local_view(storage.view(buffer, i)).copy_(locals_[i])
        self._adopt(plan, buffer)
        self.forget_unsharded()
        for p in self.params:
            p.unsharded_param = None  # rebuilt on the new device at the next unshard

    def holds(self, plan: GroupPlan, locals_: Sequence[torch.Tensor], device: torch.device) -> bool:
        """Whether the flat parameters' ``locals_`` view the sharded buffer, on ``device``.

        True unless something replaced them since it was made (``_apply``, an ``assign=True``
        load).
        """
        if self.sharded_buffer.device != device:
            return False
        if holds_no_memory(self.sharded_buffer):
            return True  # fake tensors have no addresses to compare, nor values to keep
        buffer = self.sharded_buffer.untyped_storage().data_ptr()
        return all(
            locals_[i].untyped_storage().data_ptr() == buffer
            for i in plan.flat
            if locals_[i].numel() > 0
        )

    def _adopt(self, plan: GroupPlan, buffer: torch.Tensor) -> None:
        if plan.pin_memory and not buffer.is_meta:
            buffer = pin(buffer)
        if SETTINGS.lifetime_checks:
            # The old buffer goes: no all-gather may still send from it.
            names = ", ".join(self.params[i].fqn for i in plan.flat)
            check_release(self.sharded_buffer, f"the sharded buffer of parameters {names}")
        self.sharded_buffer = buffer
        for i in plan.flat:
            self.params[i].bind_sharded(plan.layout.storage.view(buffer, i))

    def adopt_hooked(self, plan: GroupPlan, locals_: Sequence[torch.Tensor]) -> None:
        """Hooked parameters take up new local tensors: their outputs are made anew."""
        if plan.hooks is not None:
            plan.hooks.adopt(locals_)
            self._copy_outs.clear()

    def forget_unsharded(self) -> None:
        """Drop the unsharded buffer and its copy plans (a new device, layout or hooks)."""
        self.unsharded = UnshardedBuffer(self.params)
        self._copy_outs.clear()

    # --- copy-in ----------------------------------------------------------------------------

    def gather_input(
        self,
        plan: GroupPlan,
        runtime: CollectiveRuntime,
        group: dist.ProcessGroup,
        sent: dict[int, list[torch.Tensor]],
        *,
        in_place: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What this rank sends in the all-gather on ``group``, and the buffer it was staged in.

        What it sends: the sharded buffer or a staging copy; the buffer: the receive buffer the
        copy went into, if any (``all_gather``'s ``into``). ``sent``: what the pre-all-gather
        hooks returned, by parameter index. ``in_place``: stage into this rank's row of the
        receive buffer where the runtime gathers in place (torch's layout: no staging buffer
        of its own, 1/W of the group less in flight).
        """
        if not plan.needs_staging:
            return self.sharded_buffer, None
        assert self._staging is None, "the previous all-gather's staging was not returned"
        storage, comm = plan.layout.storage, plan.layout.comm
        into = runtime.gather_buffer(comm.nbytes, group, plan.device) if in_place else None
        if into is None:
            staging = runtime.pool.get(comm.nbytes, plan.device)
        else:
            start = group.rank() * comm.nbytes  # a slice: one view op, no kernel
            staging = into[start : start + comm.nbytes]
        self._staging = staging
        self._staging_pooled = into is None
        # Non-blocking from pinned memory: the host writes the shards again only in the
        # optimizer step, which the end of backward orders after every copy queued before.
        non_blocking = plan.pin_memory
        n = plan.one_copy_in
        if n is not None:
            source = self.sharded_buffer.view(storage.dtypes[0])[:n]
            staging.view(comm.dtypes[0])[:n].copy_(source, non_blocking=non_blocking)
        else:
            for i in plan.flat:
                shard = storage.view(self.sharded_buffer, i)
                comm.view(staging, i).copy_(shard, non_blocking=non_blocking)
        if plan.hooks is not None:
            plan.hooks.copy_in(sent, staging, plan.layout)
        return staging, into

    def return_staging(self, pool: BufferPool) -> None:
        """The staging copy is spent once the rows are copied out: back to the pool."""
        if self._staging is not None:
            if self._staging_pooled:  # else a row of the receive buffer, returned with it
                pool.put(self._staging)
            self._staging = None

    @property
    def holds_staging(self) -> bool:
        """Whether a staging copy is borrowed (an all-gather issued and not yet copied out)."""
        return self._staging is not None

    def abandon_staging(self) -> None:
        """Forget the staging copy without returning it (a peer may still write the rows)."""
        self._staging = None

    # --- copy-out ---------------------------------------------------------------------------

    def copy_out(
        self, plan: GroupPlan, blocks: Sequence[RowBlock], *, from_post_forward: bool
    ) -> None:
        """Write the gathered rows into the full parameters (and the hooks' outputs).

        ``from_post_forward``: the rows are the post-forward slices, gathered within the
        subgroup of ``reshard_after_forward=n`` (their layout is ``layout.post_forward``).
        """
        self.unsharded.allocate(plan)
        hook_writers = _hook_writers(plan)
        copy_out = self._copy_outs.get(from_post_forward)
        if copy_out is None:
            copy_out = self._plan_copy_out(plan, from_post_forward, hook_writers)
            self._copy_outs[from_post_forward] = copy_out
        copy_out.split.copy(blocks)
        for fixup in copy_out.fixups:
            fixup()
        if plan.hooks is not None and not from_post_forward:
            plan.hooks.finish_unshard()

    def _plan_copy_out(
        self, plan: GroupPlan, from_post_forward: bool, hook_writers: dict[int, list[torch.Tensor]]
    ) -> _CopyOut:
        layout = plan.layout
        buffer = self.unsharded.tensor
        assert buffer is not None
        pieces = _Pieces()
        if from_post_forward:
            pf = plan.post_forward
            assert pf is not None
            for i, geo in enumerate(pf.geometries):
                slot = layout.unsharded.view(buffer, i)[: geo.world * geo.shard_numel]
                pieces.add(pf.layout.offsets[i], slot, geo)
            row = pf.layout
        else:
            for i in plan.flat:
                geo = self.params[i].geometry
                slot = layout.unsharded.view(buffer, i)[: geo.world * geo.shard_numel]
                pieces.add(layout.comm.offsets[i], slot, geo)
            for i, writers in hook_writers.items():
                inputs = layout.params[i].all_gather_inputs
                hooks = self.params[i].hooks
                assert inputs is not None and hooks is not None
                for k, writer in enumerate(writers):
                    geo = hooks.output_geometry(k, inputs.numels[k], layout.shard_world)
                    pieces.add(layout.comm.offsets[i] + inputs.offsets[k], writer, geo)
            row = layout.comm
        world = layout.post_forward_world if from_post_forward else layout.shard_world
        assert world is not None
        return _CopyOut(GatherSplit(row.nbytes, pieces.targets, world), tuple(pieces.fixups))

    # --- a shard axis of one rank -----------------------------------------------------------

    def unshard_locally(self, plan: GroupPlan) -> None:
        """No collective: the full parameters view the shards, or are one copy of them."""
        if plan.aliases_shards:
            self.unsharded.alias(self.sharded_buffer, plan)
            return
        self.unsharded.allocate(plan)
        buffer = self.unsharded.tensor
        assert buffer is not None
        storage, unsharded = plan.layout.storage, plan.layout.unsharded
        n = plan.one_local_copy
        if n is not None:
            source = self.sharded_buffer.view(storage.dtypes[0])[:n]
            buffer.view(unsharded.dtypes[0])[:n].copy_(source, non_blocking=plan.pin_memory)
            return
        for i in plan.flat:
            shard = storage.view(self.sharded_buffer, i)
            target = unsharded.view(buffer, i)[: shard.numel()]
            target.copy_(shard, non_blocking=plan.pin_memory)

    def free_unsharded(self, plan: GroupPlan, options: GroupOptions) -> None:
        """Free the full parameters' memory and the hooks' outputs (resharding).

        Nothing is freed where ``options.keep_unsharded_storage``: the next unshard gathers
        into the same memory, at the same addresses.
        """
        if options.keep_unsharded_storage:
            return
        if not plan.aliases_shards:
            self.unsharded.free()
        if plan.hooks is not None:
            plan.hooks.free()


def _hook_writers(plan: GroupPlan) -> dict[int, list[torch.Tensor]]:
    """Each hooked parameter's all-gather outputs, with their memory (see AllGatherHooks)."""
    if plan.hooks is None:
        return {}
    writers: dict[int, list[torch.Tensor]] = {}
    layout = plan.layout
    for i, p in plan.hooks.params.items():
        inputs = layout.params[i].all_gather_inputs
        assert p.hooks is not None and inputs is not None, f"{p.fqn}: hooks not laid out"
        writers[i] = p.hooks.output_writers(layout.shard_world, inputs, plan.device)
    return writers


class _Pieces:
    """The split targets of one row layout, and the fixups of shards on another dim than 0."""

    def __init__(self) -> None:
        self.targets: list[SplitTarget] = []
        self.fixups: list[Callable[[], None]] = []

    def add(self, offset: int, full: torch.Tensor, geo: ShardGeometry) -> None:
        """Slot at byte ``offset`` of every row goes to ``full`` (1-D, padded, typed).

        On dim 0, rank r's padded shard is the r-th of ``full``'s W equal pieces: the split
        writes it there. On another dim it is strided inside ``full``: the split writes it
        to scratch and one copy per group moves it.
        """
        if not geo.shard_numel:
            return
        nbytes = geo.shard_numel * full.itemsize
        if geo.dim == 0:
            self.targets.append(SplitTarget(offset, full.view(torch.uint8).view(geo.world, -1)))
            return
        scratch = torch.empty(geo.world, nbytes, dtype=torch.uint8, device=full.device)
        self.targets.append(SplitTarget(offset, scratch))
        shards = scratch.view(full.dtype).view(geo.world, *geo.padded_shard_shape)
        target = rank_major_view(full, geo)

        def fixup() -> None:
            target.copy_(shards)

        self.fixups.append(fixup)
