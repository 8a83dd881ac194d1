"""StateDictCache: torch's get_state_dict(model, optimizer), with the FQNs learned once.

The oracle is torch's ``get_state_dict`` itself, called beside the cache at every point: the
same keys in the same order, tensors with the same values that share the live storage (what
DCP and a memory snapshot read, and what a load writes into), every other value equal. Two
gloo ranks, the test GPT under shardkit's ``fully_shard``.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.pool import run_on_ranks
from tests.core.checkpoint.checkpoint_app import build_app, train_app


def _differences(ours: Any, theirs: Any, where: str = "") -> list[str]:
    """Where two state dicts differ ([] if nowhere)."""
    from torch.distributed.tensor import DTensor

    if isinstance(theirs, torch.Tensor):
        if type(ours) is not type(theirs):
            return [f"{where}: {type(ours).__name__} vs {type(theirs).__name__}"]
        mine = ours.to_local() if isinstance(ours, DTensor) else ours
        real = theirs.to_local() if isinstance(theirs, DTensor) else theirs
        same = mine.data_ptr() == real.data_ptr() and mine.shape == real.shape
        return [] if same and mine.equal(real) else [f"{where}: another tensor"]
    if isinstance(theirs, dict):
        if list(ours) != list(theirs):
            return [f"{where}: keys {list(ours)[:4]}... vs {list(theirs)[:4]}..."]
        return [d for k in theirs for d in _differences(ours[k], theirs[k], f"{where}/{k}")]
    if isinstance(theirs, list | tuple):
        if type(ours) is not type(theirs) or len(ours) != len(theirs):
            return [f"{where}: {len(ours)} items vs {len(theirs)}"]
        return [d for i, t in enumerate(theirs) for d in _differences(ours[i], t, f"{where}/{i}")]
    if isinstance(ours, torch.Tensor) or type(ours) is not type(theirs):
        return [f"{where}: {type(ours).__name__} vs {type(theirs).__name__}"]
    return [] if ours == theirs else [f"{where}: {ours!r} vs {theirs!r}"]


def _compare(cache: Any, app: Any) -> list[str]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    theirs = get_state_dict(app.model, app.optimizer)
    return _differences(cache(), theirs)


def _through_changes(rank: int, world_size: int) -> dict[str, Any]:
    from shardkit.core import StateDictCache
    from shardkit.core.state_dict import cache as state_dict_cache

    learned: list[int] = []
    original = getattr(state_dict_cache, "get_state_dict")  # noqa: B009 (not exported)

    def counted(*args: Any, **kwargs: Any) -> Any:
        learned.append(1)
        return original(*args, **kwargs)

    setattr(state_dict_cache, "get_state_dict", counted)  # noqa: B010
    try:
        app = build_app(world_size)
        cache = StateDictCache(app.model, app.optimizer)
        out: dict[str, Any] = {"before any step": _compare(cache, app)}
        train_app(app, 2, rank, world_size)  # the optimizer's state appears: learned again
        out["after steps"] = _compare(cache, app)
        learned.clear()
        train_app(app, 4, rank, world_size)
        out["steady"] = [_compare(cache, app) for _ in range(3)]
        out["learned while steady"] = len(learned)
        app.optimizer.param_groups[0]["lr"] = 0.5  # a scheduler's change: read, not learned
        out["new lr"] = _compare(cache, app)
        out["lr in the cached dict"] = cache()[1]["param_groups"][0]["lr"]
        app.optimizer.load_state_dict(app.optimizer.state_dict())  # new state tensors
        out["after the optimizer's load"] = _compare(cache, app)
        app.model.register_buffer("extra_scale", torch.ones(3))  # a new key
        out["new buffer"] = _compare(cache, app)
        out["has the new key"] = "extra_scale" in cache()[0]
        out["learned after changes"] = len(learned)
    finally:
        setattr(state_dict_cache, "get_state_dict", original)  # noqa: B010
    return out


def test_the_cache_returns_torchs_state_dicts_and_learns_again_when_they_change() -> None:
    for out in run_on_ranks(2, _through_changes):
        for point in ("before any step", "after steps", "new lr"):
            assert out[point] == [], (point, out[point])
        assert out["steady"] == [[], [], []]
        assert out["learned while steady"] == 0  # the FQNs were not looked up again
        assert out["lr in the cached dict"] == 0.5
        assert out["after the optimizer's load"] == []
        assert out["new buffer"] == []
        assert out["has the new key"]
        assert out["learned after changes"] >= 1  # the new key was learned


def _local(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def _keeping_vars(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """keep_vars=True: torch's keys and storage, the parameters themselves as the values; a
    memory snapshot of it restores in place."""
    from shardkit.core import MemorySnapshots, StateDictCache

    app = build_app(world_size)
    cache = StateDictCache(app.model, app.optimizer, keep_vars=True)
    out: dict[str, Any] = {"first": _compare(cache, app)}  # learned here
    train_app(app, 2, rank, world_size)
    out["steady"] = [_compare(cache, app) for _ in range(2)]
    model_sd = cache()[0]
    params = dict(app.model.named_parameters())
    out["parameters themselves"] = all(model_sd[name] is p for name, p in params.items())

    class Train:
        def state_dict(self) -> dict[str, Any]:
            model_sd, optim_sd = cache()
            return {"model": model_sd, "optim": optim_sd}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            pass  # restored in place: nothing else to load

    options: dict[str, Any] = {"directory": f"{root}/node{rank}", "ranks_per_node": 1}
    with MemorySnapshots("keep-vars", **options) as snaps:
        snaps.snapshot(2, {"train": Train()})
        snaps.wait()
        want = {k: _local(v).clone() for k, v in app.model.state_dict().items()}
        train_app(app, 3, rank, world_size)  # the live state moves on
        point = MemorySnapshots("keep-vars", **options).restore({"train": Train()})
        got = {k: _local(v) for k, v in app.model.state_dict().items()}
        out["restored"] = point.step == 2 and all(torch.equal(want[k], got[k]) for k in want)
    return out


def test_keep_vars_gives_the_parameters_themselves_and_snapshots_restore_through_it(
    tmp_path: Any,
) -> None:
    for out in run_on_ranks(2, _keeping_vars, root=str(tmp_path)):
        assert out["first"] == [] and out["steady"] == [[], []]
        assert out["parameters themselves"]
        assert out["restored"]


def _wrapped(rank: int, world_size: int) -> list[str]:
    """A block behind torch's checkpoint wrapper: torch's FQNs drop the wrapper's prefix."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh

    from shardkit.core import StateDictCache, fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        checkpoint_wrapper(torch.nn.Linear(8, 8)), torch.nn.ReLU(), torch.nn.Linear(8, 2)
    )
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    cache = StateDictCache(model, optimizer)
    cache()
    keys = list(cache()[0])
    assert not any("_checkpoint_wrapped_module" in key for key in keys), keys

    class App:
        pass

    app = App()
    app.model, app.optimizer = model, optimizer  # type: ignore[attr-defined]
    return _compare(cache, app)


def test_wrapper_prefixes_are_removed_as_torch_removes_them() -> None:
    assert run_on_ranks(2, _wrapped) == [[], []]
