"""Nothing outlives its last use: seen through the engine's observe events and its pool.

- A group that backward never reaches (a frozen bottom block) is not gathered in backward.
- A group with no gradients that backward passes through reshards right after its own
  backward, not at the end-of-backward callback.
- Under mixed precision, the all-gather's cast copy is borrowed only from issue to copy-out.
- On a shard axis of one rank, unsharding issues no collective and announces none.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from harness.pool import run_on_ranks
from shardkit.core import MixedPrecisionPolicy, fully_shard, observe
from shardkit.core.engine.state_registry import state_of
from tests.core import models, prepare


def _sharded_mlp(world_size: int, mp: MixedPrecisionPolicy | None = None) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    model = models.build("mlp")
    policy = mp or MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _step(model: Any, rank: int) -> None:
    torch.manual_seed(rank)
    loss = F.mse_loss(model(torch.randn(2, 7)).float(), torch.randn(2, 3))
    loss.backward()


def _backward_events(rank: int, world_size: int, freeze: str) -> list[tuple[str, str]]:
    torch.manual_seed(0)
    model = _sharded_mlp(world_size)
    getattr(prepare, freeze)(model)
    _step(model, rank)  # the first step learns the order that prefetch follows
    events: list[tuple[str, str]] = []

    def record(event: observe.Event) -> None:
        if isinstance(event, observe.StateTransitionEvent):
            events.append((event.module_fqn, event.what))

    unsubscribe = observe.subscribe(record)
    try:
        _step(model, rank)
    finally:
        unsubscribe()
    start = next(i for i, e in enumerate(events) if e[1] == "pre_backward")
    return events[start:]


def test_a_group_backward_never_reaches_is_not_prefetched() -> None:
    events = run_on_ranks(2, _backward_events, freeze="freeze_bottom")[0]
    assert ("blocks.1", "pre_backward") in events  # the block above it did run backward
    assert [e for e in events if e[0] == "blocks.0"] == []


def test_a_frozen_group_reshards_right_after_its_backward() -> None:
    events = run_on_ranks(2, _backward_events, freeze="freeze_middle_block")[0]
    reshard = events.index(("blocks.1", "reshard"))
    assert events.index(("blocks.1", "pre_backward")) < reshard
    # Before the backward of the block below it, not at the end of backward.
    assert reshard < events.index(("blocks.0", "pre_backward"))


def _borrowed_bytes(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _sharded_mlp(world_size, MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    _step(model, rank)
    groups = [g for g in (state_of(m).group for m in (*model.blocks, model)) if g is not None]
    pool = state_of(model).ctx.comm.pool  # type: ignore[union-attr]
    model.unshard()
    staging_held = [g.storage.holds_staging for g in groups]
    model.reshard()
    requested: list[int] = []
    get = pool.get

    def counting_get(nbytes: int, device: torch.device) -> torch.Tensor:
        requested.append(nbytes)
        return get(nbytes, device)

    pool.get = counting_get  # type: ignore[method-assign]
    _step(model, rank)
    return {
        "staging held after unshard": staging_held,
        "pool held after backward": pool.held_bytes,
        "registered": [sorted(g.comm_buffer_sizes()) for g in groups],
        "layout": [sorted(g.layout.pool_sizes(exchange=True)) for g in groups],
        "requested": sorted(set(requested)),
        "send buffers": sorted({g.layout.reduce_scatter_input_bytes for g in groups}),
    }


def test_the_cast_copy_is_borrowed_only_for_the_all_gather() -> None:
    result = run_on_ranks(2, _borrowed_bytes)[0]
    assert result["staging held after unshard"] == [False] * 4
    assert result["pool held after backward"] == 0


def test_the_pool_registers_what_the_backend_requests() -> None:
    result = run_on_ranks(2, _borrowed_bytes)[0]
    # gloo: each group registers the sizes the layout view predicts (W-1 received rows and
    # the cast copy, not W rows), and a step requests exactly those, besides the
    # reduce-scatter's send buffers (borrowed, but not registered: see comm_buffer_sizes).
    assert result["registered"] == result["layout"]
    registered = set().union(*map(set, result["registered"]))
    assert registered | set(result["send buffers"]) == set(result["requested"])


def _collective_events(rank: int, world_size: int, mp: bool) -> list[str]:
    torch.manual_seed(0)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mp else None
    model = _sharded_mlp(world_size, policy)
    kinds: list[str] = []

    def record(event: observe.Event) -> None:
        if isinstance(event, observe.CollectiveEvent | observe.CollectiveIssuedEvent):
            kinds.append(event.kind)

    unsubscribe = observe.subscribe(record)
    try:
        _step(model, rank)
        _step(model, rank)
    finally:
        unsubscribe()
    return kinds


def test_one_shard_rank_emits_no_collective_events() -> None:
    for mp in (False, True):
        assert run_on_ranks(1, _collective_events, mp=mp) == [[]]
    assert "all_gather" in run_on_ranks(2, _collective_events, mp=True)[0]  # the probe works


def _post_backward_order(rank: int, world_size: int) -> list[tuple[str, str]]:
    torch.manual_seed(0)
    model = _sharded_mlp(world_size)
    _step(model, rank)
    events: list[tuple[str, str]] = []

    def record(event: observe.Event) -> None:
        if isinstance(event, observe.StateTransitionEvent):
            events.append((event.module_fqn, event.what))
        elif isinstance(event, observe.CollectiveEvent) and event.kind == "reduce_scatter":
            events.append((event.module_fqn, "reduce_scatter"))

    unsubscribe = observe.subscribe(record)
    try:
        _step(model, rank)
    finally:
        unsubscribe()
    return events


def test_full_parameters_are_freed_before_the_reduction_allocates() -> None:
    # Once its gradients are taken, a group's full parameters are not needed: freed first,
    # they never coexist with the reduce-scatter's send buffer (backward's memory peak).
    events = run_on_ranks(2, _post_backward_order)[0]
    for block in ("blocks.0", "blocks.1", "blocks.2"):
        after = events[events.index((block, "post_backward")) :]
        assert after.index((block, "reshard")) < after.index((block, "reduce_scatter")), block
