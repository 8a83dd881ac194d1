"""Off-thread state dicts in a tight loop against training steps: never a gathered parameter.

Issue 64: a background thread calling ``model.state_dict()`` in a loop (torchft's quorum thread
does) while two ranks train the tiny LM got, about once a run, a root parameter as the plain
full tensor its forward had registered. The calls in flight when the training thread's first
forward began took the training thread's path (no forward had named that thread yet) and read
``_parameters`` while the forward swapped the full parameters in.

Each trial here builds the model afresh (so every trial has a first forward), starts the
background loop before it, and trains a few steps; every value of every snapshot must be a
DTensor with the parameter's mesh, placements and local shape (the shard, never the full
tensor), and the training thread must not fail. Both ``reshard_after_forward`` settings; the
root (embeddings, final norm, head) has parameters of its own. The default run takes a few
thousand snapshots; ``make soak`` runs the slow test, which takes at least 100,000.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from shardkit.core import fully_shard
from tests.core.models import TinyGPT, batch, loss_of

STEPS_PER_TRIAL = 3
Spec = tuple[tuple[int, ...], tuple[Any, ...], DeviceMesh]
"""A shard's local shape, placements and mesh."""


def _build(mesh: DeviceMesh, reshard: bool) -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def _specs(state_dict: dict[str, Any]) -> dict[str, Spec]:
    """Each managed parameter's shard spec (buffers and the like are not DTensors)."""
    return {
        name: (tuple(v.to_local().shape), tuple(v.placements), v.device_mesh)
        for name, v in state_dict.items()
        if isinstance(v, DTensor)
    }


def _paused_call_body(rank: int, world_size: int, reshard: bool) -> dict[str, Any]:
    """A call that begins before the first forward and reads on while that forward runs.

    The background call pauses at ``blocks.0`` (after the root's pre-hook chose the training
    thread's path); the training thread's forward then registers the full parameters of the
    root and blocks 0 and 1, and waits in block 1 for the call to end.
    """
    model = _build(init_device_mesh("cpu", (world_size,)), reshard)
    initial = {
        n: v.to_local().clone() for n, v in model.state_dict().items() if isinstance(v, DTensor)
    }
    paused, resumed = threading.Event(), threading.Event()

    def pause(*_: Any) -> None:
        paused.set()
        assert resumed.wait(timeout=60)

    hook = model.blocks[0].register_state_dict_pre_hook(pause)  # after fully_shard's own
    got: dict[str, Any] = {}
    call = threading.Thread(target=lambda: got.update(model.state_dict()), daemon=True)
    call.start()
    assert paused.wait(timeout=60)
    hook.remove()

    def in_block_1(*_: Any) -> None:
        resumed.set()
        call.join(timeout=60)

    model.blocks[1].register_forward_pre_hook(in_block_1)
    loss_of("gpt", model(batch("gpt", 0, 2)[0]), batch("gpt", 0, 2)[1]).backward()
    return {
        "not shards": sorted(n for n in initial if not isinstance(got.get(n), DTensor)),
        "not of step 0": sorted(
            n
            for n in initial
            if isinstance(got.get(n), DTensor) and not got[n].to_local().equal(initial[n])
        ),
    }


@pytest.mark.parametrize("reshard", [False, True])
def test_a_call_the_first_forward_overtakes_gets_copies_of_the_shards(reshard: bool) -> None:
    for seen in run_on_ranks(2, _paused_call_body, reshard=reshard):
        assert seen == {"not shards": [], "not of step 0": []}, seen


class _Snapshots:
    """The background thread: ``model.state_dict()`` in a loop, each value checked."""

    def __init__(self, model: TinyGPT, specs: dict[str, Spec]) -> None:
        self.model, self.specs = model, specs
        self.taken = 0
        self.wrong: list[str] = []  # what each wrong value was, by name
        self.first = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        try:
            while not self.stop.is_set():
                self._check(self.model.state_dict())
                self.taken += 1
                self.first.set()
        except BaseException as e:  # reported by the training thread
            self.wrong.append(f"the state dict raised {type(e).__name__}: {e}")
            self.first.set()

    def _check(self, state_dict: dict[str, Any]) -> None:
        for name, spec in self.specs.items():
            value = state_dict[name]
            if not isinstance(value, DTensor):
                self.wrong.append(f"{name}: {type(value).__name__} {tuple(value.shape)}")
            elif _specs({name: value})[name] != spec:
                self.wrong.append(f"{name}: a DTensor of another spec")

    def __enter__(self) -> _Snapshots:
        self.thread.start()
        assert self.first.wait(timeout=60), "no background state dict returned"
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


def _trial(mesh: DeviceMesh, reshard: bool) -> tuple[int, list[str]]:
    """One fresh model trained a few steps under the snapshots: how many, what was wrong."""
    model = _build(mesh, reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    specs = _specs(model.state_dict())  # the training thread's: the shards themselves
    with _Snapshots(model, specs) as snapshots:  # started before the first forward
        try:
            for step in range(STEPS_PER_TRIAL):
                x, y = batch("gpt", step, 2)
                loss_of("gpt", model(x), y).backward()
                opt.step()
                opt.zero_grad()
        except Exception as e:
            snapshots.wrong.append(f"the training thread raised {type(e).__name__}: {e}")
    return snapshots.taken, snapshots.wrong


def _stress_body(
    rank: int, world_size: int, reshard: bool, min_trials: int, min_snapshots: int
) -> dict[str, Any]:
    """Trials until this setting has ``min_trials`` and ``min_snapshots`` on every rank."""
    mesh = init_device_mesh("cpu", (world_size,))
    trials = taken = 0
    wrong: list[str] = []
    while True:
        n, problems = _trial(mesh, reshard)
        trials, taken = trials + 1, taken + n
        wrong += problems
        fewest = torch.tensor([taken])
        dist.all_reduce(fewest, op=dist.ReduceOp.MIN)  # every rank runs the same trials
        if trials >= min_trials and int(fewest) >= min_snapshots:
            return {"trials": trials, "snapshots": taken, "wrong": len(wrong), "first": wrong[:5]}


def _run(min_trials: int, min_snapshots: int, timeout_s: float) -> list[dict[str, Any]]:
    results = [
        r | {"reshard": reshard}
        for reshard in (False, True)
        for r in run_on_ranks(
            2,
            _stress_body,
            reshard=reshard,
            min_trials=min_trials,
            min_snapshots=min_snapshots,
            timeout_s=timeout_s,
        )
    ]
    print(
        "off-thread snapshots: "
        + ", ".join(
            f"reshard={r['reshard']} rank {i % 2}: {r['wrong']} wrong of {r['snapshots']} "
            f"({r['trials']} trials)"
            for i, r in enumerate(results)
        )
    )
    return results


def test_offthread_snapshots_are_shards_from_the_first_forward_on() -> None:
    results = _run(min_trials=6, min_snapshots=600, timeout_s=120)
    assert [r["wrong"] for r in results] == [0, 0, 0, 0], [r["first"] for r in results]


@pytest.mark.slow
def test_offthread_snapshots_are_shards_in_100k_snapshots() -> None:
    results = _run(min_trials=100, min_snapshots=25_000, timeout_s=600)
    assert sum(r["snapshots"] for r in results) >= 100_000
    assert [r["wrong"] for r in results] == [0, 0, 0, 0], [r["first"] for r in results]
