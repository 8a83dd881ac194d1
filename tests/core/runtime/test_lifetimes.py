"""Lifetime checks (SHARDKIT_DEBUG_LIFETIMES): no buffer is released under a collective in flight.

Each collective the runtime issues is recorded with the bytes it reads and writes until its
wait; a release of those bytes before it (a buffer given back to the pool, an unsharded
buffer's ``resize_(0)``) raises, naming the buffer, the collective, its module and its group,
and a wait whose memory was freed meanwhile raises too. Off, nothing is recorded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from harness.pool import run_on_ranks
from tests.core.runtime.flights import baseline, since


@contextmanager
def _lifetime_checks(enabled: bool) -> Iterator[None]:
    from shardkit.core.runtime.watch.progress import SETTINGS

    before = SETTINGS.lifetime_checks
    SETTINGS.lifetime_checks = enabled
    try:
        yield
    finally:
        SETTINGS.lifetime_checks = before


def _early_return_body(rank: int, world_size: int) -> dict[str, str]:
    from shardkit.core.errors import BufferLifetimeError
    from shardkit.core.runtime.collectives import ProcessGroupRuntime

    runtime = ProcessGroupRuntime()
    group = dist.group.WORLD
    assert group is not None
    rows = torch.full((64,), rank, dtype=torch.uint8)
    before = baseline()
    with _lifetime_checks(True):
        handle = runtime.all_gather(rows, group, label="blocks.3")
        assert handle.buffer is not None and len(since(before)) == 1
        try:
            runtime.pool.put(handle.buffer)  # before the wait: the receive buffer is in use
        except BufferLifetimeError as error:
            message = str(error)
        else:
            message = ""
        blocks = handle.wait()
        assert not since(before), since(before)
        gathered = torch.cat([b.rows for b in blocks]).view(world_size, 64)[:, 0].tolist()
        handle.release()  # after the wait: allowed
    return {"message": message, "gathered": str(gathered)}


def test_a_receive_buffer_returned_to_the_pool_before_the_wait_is_named() -> None:
    results = run_on_ranks(2, _early_return_body)
    for result in results:
        message = result["message"]
        assert "a pool buffer of 64 bytes, given back to the pool" in message, message
        assert "all-gather of blocks.3 in " in message, message
        assert "the process group of ranks [0, 1] (gloo)" in message, message
        assert "its output (64 bytes" in message, message
        assert result["gathered"] == "[0, 1]"


def _freed_before_wait_body(rank: int, world_size: int) -> str:
    from shardkit.core.errors import BufferLifetimeError
    from shardkit.core.runtime.collectives import ProcessGroupRuntime
    from shardkit.core.runtime.handles import WorkHandle

    runtime = ProcessGroupRuntime()
    group = dist.group.WORLD
    assert group is not None
    tensor = torch.ones(32)
    before = baseline()
    with _lifetime_checks(True):
        handle = runtime.all_reduce(tensor, group, label="head")
        assert isinstance(handle, WorkHandle) and handle.work is not None
        handle.work.wait()  # done, behind the handle's back: the resize below is harmless
        tensor.untyped_storage().resize_(0)  # as code that does not ask the checks would
        try:
            handle.wait()
        except BufferLifetimeError as error:
            message = str(error)
        else:
            message = ""
        [flight] = since(before)  # still recorded: its wait did not return
        flight.landed()
    return message


def test_a_wait_whose_buffer_was_freed_meanwhile_is_named() -> None:
    for message in run_on_ranks(2, _freed_before_wait_body):
        assert message.startswith("all-reduce of head in "), message
        assert "its input and output (128 bytes" in message, message
        assert "was released before the collective was waited for" in message, message


def _unsharded_release_body(rank: int, world_size: int) -> str:
    """The unsharded buffer's resize_(0) asks first: here it is the target of an all-reduce."""
    from shardkit.core import fully_shard
    from shardkit.core.engine.state_registry import state_of
    from shardkit.core.errors import BufferLifetimeError
    from shardkit.core.runtime.collectives import ProcessGroupRuntime

    model = torch.nn.Linear(4, 4)
    fully_shard(model)
    model.unshard()  # type: ignore[operator]
    group = state_of(model).groups[0]
    assert group is not None
    buffer = group._storage.unsharded.tensor
    world = dist.group.WORLD
    assert buffer is not None and world is not None
    with _lifetime_checks(True):
        handle = ProcessGroupRuntime().all_reduce(buffer, world, label="shared")
        try:
            model.reshard()  # type: ignore[operator]
        except BufferLifetimeError as error:
            message = str(error)
        else:
            message = ""
        handle.wait()
        model.reshard()  # type: ignore[operator]
    return message


def test_resharding_under_a_collective_in_flight_is_named() -> None:
    for message in run_on_ranks(2, _unsharded_release_body):
        assert message.startswith("the unsharded buffer of parameters weight, bias"), message
        assert "all-reduce of shared" in message, message


def _off_body(rank: int, world_size: int) -> tuple[bool, int]:
    from shardkit.core.runtime.collectives import ProcessGroupRuntime

    group = dist.group.WORLD
    assert group is not None
    before = baseline()
    with _lifetime_checks(False):
        handle = ProcessGroupRuntime().all_gather(torch.zeros(8, dtype=torch.uint8), group)
        recorded = len(since(before))
        handle.wait()
    return handle.flight is None, recorded


def test_off_nothing_is_recorded() -> None:
    assert run_on_ranks(2, _off_body) == [(True, 0), (True, 0)]
