"""Shardkit's sharded modules are instances of torch's ``FSDPModule``, answering as shardkit.

Libraries check ``isinstance(module, torch.distributed.fsdp.FSDPModule)`` with torch's class,
imported before any patch (or with no patch at all): the check must pass, every method it
leads to must be shardkit's, and torch's private internals must fail by name, not deep in
torch. Torch's DCP state-dict helpers must give on a shardkit model what they give on torch's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import UnshardHandle as TorchUnshardHandle
from torch.distributed.tensor import DTensor, Shard

from harness.pool import run_on_ranks
from tests.core import models
from tests.core.ckpt_helpers import adamw, mesh_of, sharded_gpt, train

WORLD_SIZE = 2


def _where_defined(cls: type, name: str) -> type:
    """The class of ``cls``'s method resolution order whose body defines ``name``."""
    return next(c for c in cls.__mro__ if name in vars(c))


def _classes_body(rank: int, world_size: int) -> dict[str, Any]:
    from shardkit.core import FSDPModule, fully_shard

    model = models.build("mlp")
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(seq)
    handle = model.unshard(async_op=True)
    assert handle is not None
    handle.wait()
    model.reshard()
    cls = type(model)
    torch_names = [n for n in vars(TorchFSDPModule) if not n.startswith("__")]
    return {
        "instances": [isinstance(m, TorchFSDPModule) for m in (model, *model.blocks)],
        "ours": isinstance(model, FSDPModule),
        "torchs_own": [n for n in torch_names if _where_defined(cls, n) is TorchFSDPModule],
        "checked": len(torch_names),
        "original": cls.__mro__[cls._orig_cls_mro_index] is models.MLPNet,
        "handle": isinstance(handle, TorchUnshardHandle),
        # Slicing builds type(self)(...): a plain Sequential, not an FSDP class left stateless.
        "slice": type(seq[:1]).__name__,
    }


def test_sharded_modules_are_torch_fsdp_modules_with_shardkits_methods() -> None:
    for result in run_on_ranks(WORLD_SIZE, _classes_body):
        assert result["instances"] == [True] * 4
        assert result["ours"]
        # Every method and attribute torch's class defines is shadowed: none of torch's runs.
        assert result["torchs_own"] == []
        assert result["checked"] > 20  # 22 names on torch 2.10, more on later releases
        assert result["original"]
        assert result["handle"]
        assert result["slice"] == "Sequential"


def _inspect_model_body(rank: int, world_size: int) -> dict[str, Any]:
    """pytorch/examples' FSDP2 ``inspect_model``, with torch's class and shardkit's engine."""
    from shardkit.core import fully_shard

    model = models.build("gpt")
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    assert isinstance(model, models.TinyGPT), "the model's own class is kept"
    assert isinstance(model, TorchFSDPModule), "torch's isinstance check"
    params: list[torch.Tensor] = list(model.parameters())
    placements = {p.placements for p in params if isinstance(p, DTensor)}
    return {
        "dtensors": all(isinstance(p, DTensor) for p in params),
        "placements": placements == {(Shard(0),)},
        "dtypes": {p.dtype for p in params},
    }


def test_the_examples_inspect_model_passes() -> None:
    for result in run_on_ranks(WORLD_SIZE, _inspect_model_body):
        assert result == {"dtensors": True, "placements": True, "dtypes": {torch.float32}}


def _torch_internals_body(rank: int, world_size: int) -> dict[str, str]:
    from shardkit.core import fully_shard

    model = models.build("mlp")
    fully_shard(model)
    out: dict[str, str] = {}
    view: Any = model._get_fsdp_state()
    calls: list[tuple[str, Callable[[], object]]] = [
        ("state", lambda: view._training_state),
        ("async_bad", lambda: model._set_unshard_async_op(1)),
    ]
    for what, call in calls:
        try:
            call()
            out[what] = "no error"
        except (AttributeError, TypeError) as err:
            out[what] = f"{type(err).__name__}: {err}"
    model._set_unshard_async_op(True)  # torchtitan's knob: accepted
    return out


def test_torchs_private_internals_fail_by_name() -> None:
    for result in run_on_ranks(WORLD_SIZE, _torch_internals_body):
        assert result["state"].startswith(
            "AttributeError: TorchFacingState._training_state: shardkit"
        )
        assert "torch-facing view" in result["state"]
        assert result["async_bad"] == (
            "TypeError: FSDPMLPNet._set_unshard_async_op takes a bool, got int"
        )


def _full(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _dsd_body(rank: int, world_size: int, impl: str) -> dict[str, Any]:
    """Torch's DSD getters on a model of ``impl`` after 2 AdamW steps.

    The full form with ``cpu_offload`` is rank 0's only: other ranks get empty dicts.
    """
    model = sharded_gpt(impl, mesh_of(world_size))
    opt = adamw(model)
    train(model, opt, range(2), rank, world_size)
    out: dict[str, Any] = {}
    for form, options in [
        ("sharded", StateDictOptions()),
        ("full", StateDictOptions(full_state_dict=True, cpu_offload=True)),
    ]:
        msd = get_model_state_dict(model, options=options)
        osd: dict[str, Any] = dict(get_optimizer_state_dict(model, opt, options=options))
        out[form] = {
            "model": {k: (type(v).__name__, _full(v)) for k, v in msd.items()},
            "optim": {
                (fqn, key): (type(v).__name__, _full(v))
                for fqn, state in osd.get("state", {}).items()
                for key, v in state.items()
            },
            "groups": [dict(g) for g in osd.get("param_groups", [])],
        }
    return out


def test_torchs_state_dict_helpers_give_what_they_give_on_torchs_model() -> None:
    ours = run_on_ranks(WORLD_SIZE, _dsd_body, impl="shardkit")
    theirs = run_on_ranks(WORLD_SIZE, _dsd_body, impl="torch")
    for rank in range(WORLD_SIZE):
        for form in ("sharded", "full"):
            for part in ("model", "optim"):
                mine, other = ours[rank][form][part], theirs[rank][form][part]
                assert mine.keys() == other.keys(), (rank, form, part)
                differs = [
                    k
                    for k, (kind, value) in mine.items()
                    if kind != other[k][0] or not value.equal(other[k][1])
                ]
                assert differs == [], (rank, form, part, differs)
            assert ours[rank][form]["groups"] == theirs[rank][form]["groups"]
        assert ours[rank]["sharded"]["model"], "the sharded form is on every rank"
