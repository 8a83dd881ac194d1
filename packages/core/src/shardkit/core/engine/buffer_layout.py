"""The layout arithmetic of a parameter group, from parameter shapes alone.

:func:`group_layout` computes where each parameter lives in its group's flat buffers and how
big they are, with no process group and no allocation. The engine builds its buffers from
it, and the planner in ``shardkit.tools`` calls it (through :mod:`shardkit.core.layout`) for
a model it has never run, so their sizes cannot drift apart. See [Note: flat group buffers].

The per-parameter values it reads and makes, ``ParamSpec`` (with the ``HookInput`` tensors of
all-gather hooks) and ``ParamLayout``, are ``param_layout``'s: the engine's parameters describe
themselves in them, and :mod:`shardkit.core.layout` publishes them beside this arithmetic.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from shardkit.core.engine.param_layout import ParamLayout, ParamSpec
from shardkit.core.runtime.buffers import FlatLayout, ShardGeometry, shard_geometry
from shardkit.core.torch_release import REDUCES_IN_PARAM_DTYPE

__all__ = ["GroupLayout", "group_layout", "pooled_sizes"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupLayout:
    """The buffers of one parameter group: one ``fully_shard`` call."""

    params: tuple[ParamLayout, ...]
    """Its parameters, in the order the engine packs them."""
    shard_world: int
    """Ranks of the shard axis."""
    replicate_world: int
    """Ranks of the replicate axis (HSDP), 1 without one."""
    reduce_dtype: torch.dtype
    """The dtype gradients are reduced in."""
    storage: FlatLayout
    """The sharded buffer: each padded shard in its own dtype."""
    comm: FlatLayout
    """One rank's all-gather input: each padded shard in its ``comm_dtype`` (a parameter
    gathered through hooks: its inputs' bytes, as uint8)."""
    unsharded: FlatLayout
    """The unsharded buffer: each padded full tensor in its ``comm_dtype``."""
    post_forward: FlatLayout | None = None
    """With ``reshard_after_forward=n``: the 1/n slices kept from forward to backward, each
    padded for n shards in its ``comm_dtype`` (every parameter, hooked ones included); the
    backward all-gather within the subgroup of n ranks sends it. None otherwise."""
    post_forward_world: int | None = None
    """n of ``reshard_after_forward=n``; None without it."""

    @property
    def hooks_pending(self) -> tuple[str, ...]:
        """Parameters gathered through all-gather hooks whose inputs are not known yet.

        Their all-gather bytes are known only once the hook has run (the engine plans the
        group's layout again at its first unshard); until then they count as 0 bytes in
        ``comm`` and every all-gather size.
        """
        return tuple(
            p.fqn for p in self.params if p.all_gather_hooks and p.all_gather_inputs is None
        )

    @property
    def sharded_bytes(self) -> int:
        """Bytes of the sharded buffer (alignment gaps included)."""
        return self.storage.nbytes

    @property
    def all_gather_input_bytes(self) -> int:
        """Bytes one rank contributes to the all-gather."""
        return self.comm.nbytes

    @property
    def unsharded_bytes(self) -> int:
        """Bytes of the unsharded buffer."""
        return self.unsharded.nbytes

    @property
    def unsharded_views_storage(self) -> bool:
        """Whether the unsharded parameters view the sharded buffer itself: no second copy.

        So it is on a shard axis of one rank (one process, HSDP or ``dp_mesh_dims`` with a
        shard axis of size 1, replicate only): each shard is its whole parameter, and the two
        buffers have one layout. A cast to ``param_dtype`` or all-gather hooks need a buffer
        of their own; so does CPU offloading, which the engine adds to this.
        """
        return self.shard_world == 1 and all(
            p.comm_dtype == p.dtype and not p.all_gather_hooks for p in self.params
        )

    @property
    def trainable(self) -> tuple[ParamLayout, ...]:
        """The parameters whose gradients are reduced."""
        return tuple(p for p in self.params if p.requires_grad)

    @property
    def reduce_scatter_output_numel(self) -> int:
        """Elements of one rank's reduced gradient: its padded shards, back to back."""
        return sum(p.shard_numel for p in self.trainable)

    @property
    def reduce_scatter_output_bytes(self) -> int:
        """Bytes of one rank's reduced gradient."""
        return self.reduce_scatter_output_numel * self.reduce_dtype.itemsize

    @property
    def reduce_scatter_input_bytes(self) -> int:
        """Bytes of the (W, S) buffer a reduction sends from."""
        return self.shard_world * self.reduce_scatter_output_bytes

    def all_gather_receive_bytes(self, *, exchange: bool) -> int:
        """Bytes of the all-gather's receive buffer.

        Args:
            exchange: True for the direct exchange on gloo, where this rank's own row stays
                in place ((W-1) rows); False for a native all-gather (W rows).
        """
        rows = self.shard_world - 1 if exchange else self.shard_world
        return rows * self.all_gather_input_bytes

    @property
    def casts_or_hooks(self) -> bool:
        """Whether what the all-gather sends differs from the sharded buffer's bytes.

        A cast to ``param_dtype`` or all-gather hooks: the engine then stages the all-gather
        input in a buffer of its own (so does CPU offloading, which the engine adds to this).
        """
        return any(p.comm_dtype != p.dtype or p.all_gather_hooks for p in self.params)

    def stages_gather_input(self, *, offload: bool = False, exchange: bool = True) -> bool:
        """Whether the engine borrows a staging buffer (``comm`` bytes) for each all-gather.

        It is taken from the pool when the all-gather is issued and returned once the rows
        are copied out. On a shard axis of one rank nothing is sent: a cast or a move goes
        straight into the unsharded buffer, and only all-gather hooks still need one. A
        native all-gather (``exchange`` False) stages into this rank's row of its receive
        buffer instead (in place, as torch's): no buffer of its own.
        """
        if self.shard_world == 1:
            return any(p.all_gather_hooks for p in self.params)
        return exchange and (offload or self.casts_or_hooks)

    def post_forward_receive_bytes(self, *, exchange: bool) -> int:
        """Bytes of backward's receive buffer within the post-forward subgroup (0: none)."""
        n = self.post_forward_world
        if self.post_forward is None or n is None or n == 1:
            return 0
        return (n - 1 if exchange else n) * self.post_forward.nbytes

    def pool_sizes(self, *, exchange: bool, offload: bool = False) -> frozenset[int]:
        """The buffer sizes this group borrows from the engine's pool: what it will request.

        Args:
            exchange: whether the backend gathers by direct exchange (gloo: W-1 received
                rows) rather than a native all-gather (W rows); see
                :meth:`all_gather_receive_bytes`.
            offload: whether the parameters are offloaded to the CPU (then the all-gather
                input is staged on the device).

        A shard axis of one rank gathers nothing, so it receives into no buffer.
        """
        sizes = {self.post_forward_receive_bytes(exchange=exchange)}
        if self.shard_world > 1:
            sizes.add(self.all_gather_receive_bytes(exchange=exchange))
        if self.stages_gather_input(offload=offload, exchange=exchange):
            sizes.add(self.all_gather_input_bytes)
        return frozenset(sizes - {0})


def _hook_inputs(spec: ParamSpec) -> FlatLayout | None:
    """Where the pre-all-gather hook's tensors lie in the parameter's all-gather slot."""
    if spec.all_gather_inputs is None:
        return None
    inputs = spec.all_gather_inputs
    return FlatLayout.build([i.numel for i in inputs], [i.dtype for i in inputs])


def _comm_dtype(spec: ParamSpec, param_dtype: torch.dtype | None) -> torch.dtype:
    # Mixed precision casts floating-point parameters only; integer ones keep their dtype, as
    # do those the policy's param_dtype_override_fn keeps in theirs.
    if param_dtype is not None and spec.dtype.is_floating_point and not spec.keeps_own_dtype:
        return param_dtype
    return spec.dtype


def _reduce_dtype(
    specs: Sequence[ParamSpec], comm_dtypes: Sequence[torch.dtype], reduce_dtype: torch.dtype | None
) -> torch.dtype:
    if reduce_dtype is not None:
        return reduce_dtype
    computed = comm_dtypes
    if REDUCES_IN_PARAM_DTYPE:
        # As torch's reduce_dtype=None does from 2.15 on: gradients reduce in their
        # parameters' own dtype (fp32 parameters computed in bf16 reduce in fp32).
        comm_dtypes = [s.dtype for s in specs]
    trained = {d for s, d in zip(specs, comm_dtypes, strict=True) if s.requires_grad}
    if len(trained) > 1:
        names = ", ".join(
            f"{s.fqn}: {d}" for s, d in zip(specs, comm_dtypes, strict=True) if s.requires_grad
        )
        raise ValueError(
            "fully_shard needs one dtype for the trainable parameters of a group so that "
            f"their gradients reduce together; got {names}. Set "
            "MixedPrecisionPolicy(param_dtype=...) (with param_dtype_override_fn, "
            "reduce_dtype=...) or shard them in separate calls."
        )
    if not trained:
        return torch.float32
    # Each gradient's dtype: the one its user set (None: any, so the computed one), else the
    # parameter's. The group reduces in the widest of them.
    wanted = [
        (s.grad_dtype_policy[1] or made) if s.grad_dtype_policy[0] else own
        for s, own, made in zip(specs, comm_dtypes, computed, strict=True)
        if s.requires_grad
    ]
    return functools.reduce(torch.promote_types, wanted)


def group_layout(
    params: Sequence[ParamSpec],
    *,
    shard_world: int,
    replicate_world: int = 1,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    post_forward_world: int | None = None,
) -> GroupLayout:
    """The layout of a group of parameters sharded over ``shard_world`` ranks.

    Args:
        params: the group's parameters in packing order.
        shard_world: ranks of the shard axis.
        replicate_world: ranks of the replicate axis (HSDP).
        param_dtype: ``MixedPrecisionPolicy.param_dtype``.
        reduce_dtype: ``MixedPrecisionPolicy.reduce_dtype``.
        post_forward_world: n of ``reshard_after_forward=n`` (the unsharded buffer must also
            hold a copy-out from n shards, whose padding differs).

    Raises:
        ValueError: trainable parameters of different dtypes and no ``reduce_dtype``.
    """
    geometries = [shard_geometry(torch.Size(s.shape), s.shard_dim, shard_world) for s in params]
    comm_dtypes = [_comm_dtype(s, param_dtype) for s in params]
    numels = [g.shard_numel for g in geometries]
    # A parameter gathered through hooks has no slot in the flat sharded and unsharded
    # buffers, and sends its hook's tensors as bytes. See [Note: all-gather extensions].
    hooked = [s.all_gather_hooks for s in params]
    hook_inputs = [_hook_inputs(s) for s in params]
    flat_numels = [0 if h else n for n, h in zip(numels, hooked, strict=True)]
    storage = FlatLayout.build(flat_numels, [s.dtype for s in params])
    if not any(hooked) and len(set(storage.dtypes)) == 1 and len(set(comm_dtypes)) == 1:
        # One dtype on each side: the all-gather input takes the shards' element offsets, so
        # the copy-in (a cast, a move to the device) is one copy for the whole group.
        comm = storage.retyped(comm_dtypes[0])
    else:
        sizes = zip(flat_numels, hook_inputs, strict=True)
        comm = FlatLayout.build(
            [i.nbytes if i is not None else n for n, i in sizes],
            [torch.uint8 if h else c for c, h in zip(comm_dtypes, hooked, strict=True)],
        )
    unsharded_numels = [n * shard_world for n in flat_numels]
    if post_forward_world is not None:
        unsharded_numels = [
            max(
                u,
                post_forward_world * shard_geometry(g.shape, g.dim, post_forward_world).shard_numel,
            )
            for u, g in zip(unsharded_numels, geometries, strict=True)
        ]
    unsharded = FlatLayout.build(unsharded_numels, comm_dtypes)
    layouts = tuple(
        ParamLayout(
            fqn=s.fqn,
            geometry=g,
            dtype=s.dtype,
            comm_dtype=c,
            requires_grad=s.requires_grad,
            storage_offset=storage.offsets[i],
            comm_offset=comm.offsets[i],
            unsharded_offset=unsharded.offsets[i],
            all_gather_hooks=s.all_gather_hooks,
            all_gather_inputs=hook_inputs[i],
        )
        for i, (s, g, c) in enumerate(zip(params, geometries, comm_dtypes, strict=True))
    )
    return GroupLayout(
        params=layouts,
        shard_world=shard_world,
        replicate_world=replicate_world,
        reduce_dtype=_reduce_dtype(params, comm_dtypes, reduce_dtype),
        storage=storage,
        comm=comm,
        unsharded=unsharded,
        post_forward=_post_forward_layout(geometries, comm_dtypes, post_forward_world),
        post_forward_world=post_forward_world,
    )


def _post_forward_layout(
    geometries: Sequence[ShardGeometry], dtypes: Sequence[torch.dtype], world: int | None
) -> FlatLayout | None:
    """The 1/``world`` slices a group keeps between forward and backward."""
    if world is None:
        return None
    numels = [shard_geometry(g.shape, g.dim, world).shard_numel for g in geometries]
    return FlatLayout.build(numels, list(dtypes))


def pooled_sizes(
    layouts: Iterable[GroupLayout], *, exchange: bool, offload: bool = False
) -> frozenset[int]:
    """The buffer sizes the engine's pool keeps a buffer for: those of two groups or more.

    A size that one group alone uses would sit idle from one of its collectives to the next,
    so the pool hands such buffers back to the allocator (see ``runtime/pool.py``).
    ``exchange`` and ``offload`` as for :meth:`GroupLayout.pool_sizes`.
    """
    users = Counter(
        size for layout in layouts for size in layout.pool_sizes(exchange=exchange, offload=offload)
    )
    return frozenset(size for size, count in users.items() if count >= 2)
