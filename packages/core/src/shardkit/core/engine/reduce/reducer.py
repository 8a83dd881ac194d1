"""Gradient reduction of one parameter group: pack, reduce-scatter, all-reduce, assign.

The full gradients of the group's trainable parameters are packed rank-major into one (W, S)
buffer (row r: rank r's padded shards; ``packing``), reduced with one collective, optionally
all-reduced across HSDP replicas, divided (``division``), and assigned as DTensor gradients
that view the result, or added to gradients already there (``assign``). Until it finishes, a
reduction in flight is a ``PendingReduce`` (or an ``AssignInPlace``), which keeps the group's
switches as they were when it was issued (``IssuedUnder``). See [Note: flat group buffers].

Next to split off: the all-reduce across HSDP replicas (``finish``'s replica half: the deferred
``partial`` and its packing check, the custom, compressed or runtime all-reduce, the all-reduce
hook on its stream), as a helper object the reducer holds, owning ``partial``, into
``reduce/replicas.py``: it is the sequence's third step, and reads only the ``IssuedUnder`` it
finishes with and the replicate group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardkit.core.engine.buffer_layout import GroupLayout
from shardkit.core.engine.comm_context import CommContext
from shardkit.core.engine.group_options import GroupOptions
from shardkit.core.engine.mesh_info import MeshInfo
from shardkit.core.engine.param import FSDPParam
from shardkit.core.engine.reduce.assign import assign_reduced, take_sharded_grad
from shardkit.core.engine.reduce.division import Division, plan_division
from shardkit.core.engine.reduce.packing import Packing
from shardkit.core.engine.reduce.precision import WireReducer
from shardkit.core.engine.reduce.unused import UnusedGrads
from shardkit.core.runtime.collectives import DoneHandle
from shardkit.core.runtime.device import on_stream, prefers_fused_packing
from shardkit.core.runtime.dtensors import accumulate_grads
from shardkit.core.runtime.protocol import CollectiveHandle
from shardkit.core.runtime.watch.progress import SETTINGS

__all__ = ["AssignInPlace", "GroupReducer", "IssuedUnder", "PendingReduce"]


@dataclass(frozen=True, slots=True)
class IssuedUnder:
    """The group's switches when a reduction was issued: the ones it finishes with.

    A reduction may stay in flight past the end of a backward that is not the last
    (``set_is_last_backward(False)``) and finish in the next one, after the user changed the
    switches for that one: OLMo-core calls ``set_requires_all_reduce(last)`` per micro-batch.
    torch's engine all-reduces, runs the hook and divides in the call that reduce-scatters,
    under that call's settings; so does this one, by reading them here and not from the
    group's options at finish. See [Note: post-backward trigger] (reductions in flight).
    """

    division: Division
    all_reduce: bool
    """HSDP: all-reduce across replicas (``set_requires_all_reduce``), else keep it partial."""
    custom_all_reduce: Callable[[torch.Tensor, dist.ProcessGroup], None] | None
    all_reduce_hook: Callable[[torch.Tensor], None] | None
    all_reduce_hook_stream: Any
    wire: WireReducer | None
    """The compressed all-reduce of ``set_reduce_precision``, or None (torch's)."""


@dataclass(slots=True)
class PendingReduce:
    """A gradient reduction in flight, finished by ``GroupReducer.finish``."""

    reducer: GroupReducer
    packing: Packing
    handle: CollectiveHandle
    output: torch.Tensor  # (S,) in the reduce dtype: this rank's reduced shard
    buffers: tuple[torch.Tensor, ...]  # pool buffers to return once the exchange is done
    issued: IssuedUnder

    def finish(self, comm: CommContext) -> None:
        """Wait, all-reduce across replicas, divide and assign the sharded gradients."""
        self.reducer.finish(self, comm)


@dataclass(slots=True)
class AssignInPlace:
    """One shard rank and nothing to change: the full gradients become the sharded ones.

    With a single rank on the shard axis and no replicas, a gradient's reduction is itself
    divided by one: packing it into a flat buffer would only copy it. Each full gradient is
    assigned as it is (it is this rank's whole shard), when the reduction would have been.
    """

    reducer: GroupReducer
    grads: tuple[tuple[FSDPParam, torch.Tensor], ...]

    def finish(self, comm: CommContext) -> None:
        """Assign each gradient to its sharded parameter."""
        accumulate_grads((p.sharded_param, grad) for p, grad in self.grads)


class GroupReducer:
    """Reduces the gradients of a group's parameters that have one.

    Which parameters those are can change from one backward to the next (``requires_grad``
    set by the user, a parameter unused in a forward), so the packing is chosen per reduction.
    A parameter used on some ranks only is reduced as zeros on the others (``unused``).
    """

    def __init__(
        self,
        reduce_dtype: torch.dtype,
        mesh_info: MeshInfo,
        options: GroupOptions,
        offload: tuple[bool, bool],
    ) -> None:
        self.label = ""  # the group's module, named in its collectives' events (see start)
        self.dtype = reduce_dtype
        self.mesh_info = mesh_info
        self.options = options  # shared with the group: set_* methods change it
        self.offload, self.pin_memory = offload
        self._packings: dict[tuple[int, ...], Packing] = {}
        # Set by flat_layout(): where each parameter's shard sits in the group's flat shard.
        self._flat_offsets: dict[int, int] | None = None
        self._flat_numel = 0
        # HSDP: reduced but not yet all-reduced, with the packing it was reduced in.
        self.partial: tuple[Packing, torch.Tensor] | None = None
        self._wire: WireReducer | None = None  # for options.reduce_precision, when it compresses
        self.unused = UnusedGrads()  # zeros reduced for parameters without a gradient here

    def _wire_reducer(self) -> WireReducer | None:
        """The compressed reductions of ``options.reduce_precision`` (None: torch's way).

        Kept while the policy is the same object: its noise and residuals go on from step to
        step; a new policy starts afresh.
        """
        policy = self.options.reduce_precision
        if policy is None or not policy.compresses:
            return None
        if self._wire is None or self._wire.policy is not policy:
            self._wire = WireReducer(policy)
        self._wire.label = self.label
        return self._wire

    def flat_layout(self, params: Sequence[FSDPParam], layout: GroupLayout) -> None:
        """Reduce every parameter's gradient at its slot of the group's flat shard.

        ``params`` are the group's, in ``layout``'s order; they have one dtype. A reduction
        that covers all of them then lands in one tensor laid out as the sharded buffer
        (alignment gaps zeroed, element offsets of the parameters' dtype), and the gradients
        assigned view it: an adapter's flat gradient can be that tensor itself, not a copy
        of it. A reduction of fewer parameters stays packed back to back.
        """
        itemsize = layout.params[0].dtype.itemsize
        self._flat_offsets = {
            id(p): pl.storage_offset // itemsize
            for p, pl in zip(params, layout.params, strict=True)
        }
        self._flat_numel = layout.sharded_bytes // itemsize
        self._packings.clear()

    def take_grads(
        self, trainable: Sequence[FSDPParam], *, ran_forward: bool = False
    ) -> list[tuple[FSDPParam, torch.Tensor | None]]:
        """The gradients to reduce, taken off the parameters (none if none is to be reduced).

        A parameter that took no part in this backward on this rank is reduced as zeros, and
        gets None back if no rank used it (``unused.UnusedGrads``); with
        ``set_reduce_scatter_unused_params(True)`` it keeps the zeros, as torch's switch does.
        ``ran_forward``: see ``UnusedGrads.choose``.
        """
        if self.options.reduce_scatter_unused_params:
            _check_zeros_have_a_dtype(trainable, self.label)
            grads = [(p, p.take_unsharded_grad()) for p in trainable]
            return grads if any(g is not None for _, g in grads) else []
        grads = [(p, p.take_unsharded_grad()) for p in trainable]
        world = self.mesh_info.shard_size * self.mesh_info.replicate_size
        return self.unused.choose(grads, world=world, ran_forward=ran_forward)

    def fills_missing(self, trainable: Sequence[FSDPParam]) -> bool:
        """Whether a parameter of ``trainable`` with no gradient here is reduced all the same.

        Then this rank's count of gradients cannot tell where the group's backward ends: a
        rank that did not use a parameter never completes a count that another rank does.
        The group must end where every rank's backward ends it (see
        [Note: post-backward trigger], "Parameters used on some ranks").
        """
        opts = self.options
        world = self.mesh_info.shard_size * self.mesh_info.replicate_size
        if not opts.reduce_grads or world == 1 or not trainable:
            return False
        return opts.reduce_scatter_unused_params or self.unused.fills(trainable, world)

    def reduces_zeros(self) -> bool:
        """Whether a group with no gradient on this rank still reduces (zeros) at backward's end."""
        opts = self.options
        world = self.mesh_info.shard_size * self.mesh_info.replicate_size
        automatic = SETTINGS.step_checks and not opts.reduce_scatter_unused_params
        return opts.reduce_grads and world > 1 and automatic

    def _packing_of(self, params: Sequence[FSDPParam]) -> Packing:
        key = tuple(id(p) for p in params)
        packing = self._packings.get(key)
        if packing is None:
            flat = self._flat_offsets
            if flat is not None and len(params) == len(flat) and all(id(p) in flat for p in params):
                packing = Packing.at(params, [flat[id(p)] for p in params], self._flat_numel)
            else:
                packing = Packing.of(params)
            self._packings[key] = packing
        return packing

    @property
    def division(self) -> Division:
        """Where this group's next reduction divides (see ``division``)."""
        opts = self.options
        return plan_division(
            self.dtype,
            self.mesh_info.shard_size,
            self.mesh_info.replicate_size,
            factor=opts.gradient_divide_factor,
            force_sum=opts.force_sum_reduction,
            device_type=self.mesh_info.device.type,
        )

    def _issued_under(self, wire: WireReducer | None) -> IssuedUnder:
        opts = self.options
        return IssuedUnder(
            division=self.division,
            all_reduce=opts.all_reduce_grads,
            custom_all_reduce=opts.custom_all_reduce,
            all_reduce_hook=opts.all_reduce_hook,
            all_reduce_hook_stream=opts.all_reduce_hook_stream,
            wire=wire,
        )

    def start(
        self,
        grads: list[tuple[FSDPParam, torch.Tensor | None]],
        comm: CommContext,
        label: str = "",
        *,
        assign_now: bool = False,
    ) -> None:
        """Pack the full gradients (None: zeros) and issue one reduction for them.

        ``grads`` is emptied once packed: the full gradients are freed (if nothing else holds
        them) before the output is allocated, so the three never peak together.
        ``label`` names the group's module to observers (known only after lazy init).
        ``assign_now``: gradients that are their own reduction (see AssignInPlace) are
        assigned at once rather than when the reduction would have finished.
        """
        self.label = label
        world = self.mesh_info.shard_size
        if world == 1 and self._assigns_in_place(grads):
            owned = tuple((p, g) for p, g in grads if g is not None)
            grads.clear()
            assigned = AssignInPlace(self, owned)
            if assign_now:
                assigned.finish(comm)
            else:
                comm.pending_reduces.append(assigned)
            return
        packing = self._packing_of([p for p, _ in grads])
        full = [g for _, g in grads]
        grads.clear()
        device = self.mesh_info.device
        custom = self.options.custom_reduce_scatter
        fused = prefers_fused_packing(self.mesh_info.device)
        wire = self._wire_reducer()
        issued = self._issued_under(wire)
        division = issued.division
        if world == 1:
            if self.options.reduce_accumulated_grads:
                full = _with_accumulated(packing.params, full)
            # Nothing to scatter: pack straight into the output, and divide as the
            # reduce-scatter of one rank would have (only a factor of the user's does).
            output = self._allocate_output(packing.numel)
            packing.pack(full, output.view(1, -1), fused=fused)
            if division.pre != 1:
                output.div_(division.pre)
            division.reduce_scatter.finish_sum(output, 1)
            done = PendingReduce(self, packing, DoneHandle(), output, (), issued)
            comm.pending_reduces.append(done)
            return
        nbytes = world * packing.numel * self.dtype.itemsize
        if custom is not None:
            send = custom.allocate((nbytes,), dtype=torch.uint8, device=device)
            pooled: tuple[torch.Tensor, ...] = ()  # the user's memory: not ours to pool
        else:
            send = comm.pool.get(nbytes, device)
            pooled = (send,)
        rows = send.view(self.dtype).view(world, packing.numel)  # (W, S)
        packing.pack(full, rows, fused=fused)
        full.clear()  # packed: the full gradients go before the output comes
        if division.pre != 1:
            rows.div_(division.pre)
        output = self._allocate_output(packing.numel)
        group = self.options.reduce_scatter_group or self.mesh_info.shard_group
        handle: CollectiveHandle
        if wire is not None:
            key = tuple(id(p) for p in packing.params)
            handle = wire.reduce_scatter(
                rows, output, group, comm, key=key, op=division.reduce_scatter
            )
        else:
            handle = comm.runtime.reduce_scatter(
                output, rows, group, label=self.label, custom=custom, op=division.reduce_scatter
            )
        pending = PendingReduce(self, packing, handle, output, pooled, issued)
        comm.pending_reduces.append(pending)

    def _allocate_output(self, numel: int) -> torch.Tensor:
        """This rank's reduced shard (S,): the user's memory with a custom reduce-scatter."""
        custom = self.options.custom_reduce_scatter
        if custom is not None:
            output: torch.Tensor = custom.allocate(
                (numel,), dtype=self.dtype, device=self.mesh_info.device
            )
            return output
        return torch.empty(numel, dtype=self.dtype, device=self.mesh_info.device)

    def _assigns_in_place(self, grads: Sequence[tuple[FSDPParam, torch.Tensor | None]]) -> bool:
        """Whether the full gradients are already the reduced shards (see AssignInPlace)."""
        opts = self.options
        if (
            self.mesh_info.replicate_group is not None
            or self.mesh_info.dp_size != 1
            or self.offload
            or opts.custom_reduce_scatter is not None
            or opts.all_reduce_hook is not None
            or (opts.gradient_divide_factor or 1) != 1
        ):
            return False
        # A missing gradient would be sent as zeros: only the packing path makes those.
        return all(
            g is not None
            and g.dtype == self.dtype == (p.sharded_grad_dtype or g.dtype)
            and g.shape == p.geometry.shape
            and g.is_contiguous()
            and type(g) is torch.Tensor
            for p, g in grads
        )

    def finish(self, pending: PendingReduce, comm: CommContext) -> None:
        """Wait for a reduction, all-reduce across replicas, divide, assign sharded grads."""
        pending.handle.wait()
        for buffer in pending.buffers:
            comm.pool.put(buffer)
        reduced = pending.output
        issued = pending.issued
        if self.mesh_info.replicate_group is not None:
            if self.partial is not None:
                packing, partial = self.partial
                if packing is not pending.packing:
                    raise RuntimeError(
                        f"FSDP module {self.label or '<root>'}: the parameters with gradients "
                        "changed between backwards that deferred the all-reduce across "
                        "replicas (set_requires_all_reduce(False)); keep requires_grad and "
                        "the parameters used fixed until the backward that all-reduces"
                    )
                reduced.add_(partial)
                self.partial = None
                self.unused.fold()
            if not issued.all_reduce:
                self.partial = (pending.packing, reduced)
                self.unused.defer(pending.packing.params)
                return
            replicas = self.mesh_info.replicate_group
            division = issued.division
            if issued.custom_all_reduce is not None:
                # The user's collective sums; the engine's mean or scaled sum ends here.
                issued.custom_all_reduce(reduced, replicas)
                division.all_reduce.finish_sum(reduced, self.mesh_info.replicate_size)
            elif issued.wire is not None:
                issued.wire.all_reduce(reduced, replicas, comm, op=division.all_reduce)
            else:
                comm.runtime.all_reduce(
                    reduced, replicas, label=self.label, op=division.all_reduce
                ).wait()
        if issued.all_reduce_hook is not None:
            # Replicate only (no shard axis) runs the hook where its all-reduce ran, as
            # torch's does with the stream given: that is the current stream here.
            stream = issued.all_reduce_hook_stream
            if self.mesh_info.replicate_group is not None:
                stream = None
            with on_stream(stream, self.mesh_info.device):
                issued.all_reduce_hook(reduced)  # divided by the collectives, not yet by ``post``
        if issued.division.post != 1:
            reduced.div_(issued.division.post)
        assign_reduced(
            reduced, pending.packing, comm, offload=self.offload, pin_memory=self.pin_memory
        )


def _with_accumulated(
    params: Sequence[FSDPParam], full: list[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """Each full gradient plus the gradient already on its parameter, which is taken off.

    FSDP1's ``NO_SHARD`` lets autograd add a backward's gradient to the reduced one already
    there (in that one's dtype) and reduces the sum again: the replicas hold the same old
    gradient, so the mean keeps it, but its rounding is FSDP1's only this way. See
    [Note: FSDP1's gradient accumulation].
    """
    summed: list[torch.Tensor | None] = []
    for p, grad in zip(params, full, strict=True):
        old = take_sharded_grad(p)
        if old is not None and grad is not None:
            old = old.to(grad.device) + grad  # an offloaded gradient comes back first
        summed.append(grad if old is None else old)
    return summed


def _check_zeros_have_a_dtype(trainable: Sequence[FSDPParam], label: str) -> None:
    """Zeros for unused parameters need one dtype on every rank, which grad_dtype=None lacks.

    Checked on the configuration, not on which gradients came: every rank raises alike.
    """
    for p in trainable:
        if p.grad_accumulation.any_dtype:
            raise ValueError(
                f"FSDP module {label or '<root>'}: reducing unused parameters with "
                "grad_dtype=None requires an explicit MixedPrecisionPolicy.reduce_dtype, so "
                f"that every rank makes zeros of one dtype for {p.fqn}: set reduce_dtype to "
                "the dtype its gradients have"
            )
