"""FSDP2's communication switches: the all-reduce hook, custom collectives, a separate
reduce-scatter group and more reductions in flight, each against torch's fully_shard."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from harness.pool import run_on_ranks
from tests.core.parity import Run, assert_parity, train
from tests.core.runtime.comm_support import AllReduceScatter, CountingAllGather, halve
from tests.core.torch_releases import torch_has

# The switches torch added after 2.10 (tests.core.torch_releases has their releases).
_SWITCHES = {
    "separate_group": "set_separate_reduce_scatter_group",
    "two_in_flight": "set_reduce_scatter_max_input_buffers",
}


def _body(rank: int, world_size: int, switch: str, hsdp: tuple[int, int] | None) -> Any:
    import tests.core.parity as parity

    counts: dict[str, int] = {}

    def configure(model: Any) -> None:
        if switch == "all_reduce_hook":
            model.set_all_reduce_hook(halve)
            for block in model.blocks:
                block.set_all_reduce_hook(halve)
        elif switch == "custom_comms":
            gather, scatter = CountingAllGather(), AllReduceScatter()
            counts["objects"] = id(gather)
            for module in (model, *model.blocks):
                module.set_custom_all_gather(gather)
                module.set_custom_reduce_scatter(scatter)
            counts_ref.append((gather, scatter))
        elif switch == "separate_group":
            model.set_separate_reduce_scatter_group(True)
        elif switch == "two_in_flight":
            model.set_reduce_scatter_max_input_buffers(2)
        elif switch == "process_group_memory":
            model.set_allocate_memory_from_process_group_for_comm(True)
        elif switch == "symm_mem":
            model.set_symm_mem_for_comm("NCCL")

    counts_ref: list[tuple[CountingAllGather, AllReduceScatter]] = []
    original = parity.apply

    def apply(impl: str, model: Any, mesh: Any, run: Run) -> None:
        original(impl, model, mesh, run)
        configure(model)

    parity.apply = apply
    try:
        # torch's symmetric memory needs NCCL: there ours is checked against the single process,
        # as where the installed torch lacks the switch (2.13 added the last two).
        torch_lacks = not torch_has(f"FSDPModule.{_SWITCHES.get(switch, '')}")
        peer = "local" if switch == "symm_mem" or torch_lacks else "torch"
        run = Run(model="mlp", hsdp=hsdp, impls=("shardkit", peer), steps=4)
        traces = {impl: train(impl, run, rank, world_size) for impl in run.impls}
    finally:
        parity.apply = original
    traces["calls"] = {
        "gather": [g.calls for g, _ in counts_ref],
        "scatter": [s.calls for _, s in counts_ref],
    }
    return traces


@pytest.mark.parametrize(
    ("switch", "world_size", "hsdp"),
    [
        ("all_reduce_hook", 2, None),
        ("all_reduce_hook", 4, (2, 2)),
        ("custom_comms", 2, None),
        ("separate_group", 2, None),
        ("two_in_flight", 2, None),
        ("process_group_memory", 2, None),
        ("symm_mem", 2, None),
    ],
)
def test_switch_matches_torch(switch: str, world_size: int, hsdp: tuple[int, int] | None) -> None:
    results = run_on_ranks(world_size, _body, switch=switch, hsdp=hsdp)
    calls = results[0].pop("calls")
    for result in results[1:]:
        result.pop("calls")
    assert_parity(results)
    if switch == "custom_comms":
        # Both engines ran the user's collectives: 4 steps, 4 groups, forward and backward.
        gathers, scatters = calls["gather"], calls["scatter"]
        assert len(gathers) == 2 and all(n >= 4 * 4 for n in gathers), gathers
        assert scatters == [4 * 4, 4 * 4], scatters


def test_bad_switch_values_are_refused() -> None:
    results = run_on_ranks(1, _refusals_body)
    assert results[0] == ["TypeError", "ValueError", "ValueError"]


def _refusals_body(rank: int, world_size: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    from shardkit.core import fully_shard
    from tests.core import models

    model: Any = models.build("mlp")
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    seen = []
    calls: list[Callable[[], None]] = [
        lambda: model.set_reduce_scatter_max_input_buffers(True),
        lambda: model.set_reduce_scatter_max_input_buffers(0),
        lambda: model.set_symm_mem_for_comm("NVSHMEM"),
    ]
    for call in calls:
        try:
            call()
        except (TypeError, ValueError) as error:
            seen.append(type(error).__name__)
    return seen


def _hook_stream_body(rank: int, world_size: int, hsdp: bool) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from tests.core import models
    from tests.core.parity import fully_shard_of

    device_module = torch.get_device_module("cpu")
    out: dict[str, Any] = {}
    for impl in ("torch", "shardkit"):
        fs = fully_shard_of(impl)
        if hsdp:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (world_size,))
        model: Any = models.build("mlp")
        fs(model, mesh=mesh)
        stream = device_module.Stream()
        seen: list[bool] = []

        def hook(reduced: Any, stream: Any = stream, seen: list[bool] = seen) -> None:
            # The mesh's device module (torch.cpu), not torch.get_device_module(): a CUDA
            # build of torch 2.15 answers torch.cuda there even with no GPU.
            seen.append(device_module.current_stream() is stream)
            reduced.mul_(0.5)

        try:
            model.set_all_reduce_hook(hook, stream=stream)
        except ValueError as error:
            out[impl] = {"message": str(error), "notes": getattr(error, "__notes__", [])}
            continue
        x, y = models.batch("mlp", 0, 2 * world_size)
        models.loss_of(
            "mlp", model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]
        ).backward()
        after = device_module.current_stream() is stream
        grads = [p.grad.full_tensor() for p in model.parameters()]
        out[impl] = {"seen": seen, "after": after, "grads": grads}
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_all_reduce_hook_runs_on_the_given_stream(world_size: int) -> None:
    for result in run_on_ranks(world_size, _hook_stream_body, hsdp=False):
        ours, torchs = result["shardkit"], result["torch"]
        assert torchs["seen"] == [True], torchs["seen"]  # torch's runs it under the stream
        assert ours["seen"] == torchs["seen"]
        assert ours["after"] is torchs["after"] is False  # the stream was current only inside
        for mine, theirs in zip(ours["grads"], torchs["grads"], strict=True):
            assert mine.equal(theirs)


def test_native_hsdp_refuses_a_hook_stream_with_torchs_message() -> None:
    for result in run_on_ranks(4, _hook_stream_body, hsdp=True):
        assert result["torch"]["message"] == "stream cannot be set when using native HSDP"
        # Word for word (torch's own test_custom_hook_custom_stream compares the whole text);
        # the module and its mesh in a note.
        assert result["shardkit"]["message"] == result["torch"]["message"]
        assert any("(replicate, shard) mesh" in note for note in result["shardkit"]["notes"])


def _allocation_after_custom_gather(rank: int, world_size: int, engine: str) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    from tests.core import models
    from tests.core.parity import fully_shard_of

    model: Any = models.build("mlp")
    fully_shard_of(engine)(model, mesh=init_device_mesh("cpu", (world_size,)))
    seen = []
    model.set_allocate_memory_from_process_group_for_comm(True)  # accepted before
    model.set_custom_all_gather(object())
    try:
        model.set_allocate_memory_from_process_group_for_comm(True)
    except AssertionError as error:
        seen.append(f"AssertionError: {error}")
    return seen


def test_process_group_allocation_after_a_custom_all_gather_is_refused_as_torch_refuses() -> None:
    # torch's contract (test_fully_shard_comm.py's test_exception_when_used_together_with_comm
    # _hooks): the switch after set_custom_all_gather raises AssertionError.
    theirs = run_on_ranks(1, _allocation_after_custom_gather, engine="torch")[0]
    ours = run_on_ranks(1, _allocation_after_custom_gather, engine="shardkit")[0]
    assert len(theirs) == len(ours) == 1, (theirs, ours)
    assert "set_allocate_memory_from_process_group_for_comm()" in ours[0], ours
    assert ours[0].startswith("AssertionError: FSDP"), ours  # the module named
