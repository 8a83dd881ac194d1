"""FSDP1's state-dict flows (torch's test_fsdp_state_dict.py), torch's FSDP1 the oracle.

Train, save and load into a blank model; the keys of each type; FULL and SHARDED state dicts
gathered into the plain model; a module left out of every unit; the type set by
``state_dict_type`` undone on leaving; a rank whose LOCAL shard is empty; ``torch.save`` and
``torch.load(weights_only=True)`` of LOCAL state dicts; non-strict loads' key names; a world
of one; SHARDED set for good on a group named by backend; rank 0's checkpoint spread by
``sync_module_states``; LOCAL state dicts of 4 ranks resharded by hand for 2.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._state_dict_utils import _gather_state_dict

from harness.pool import run_on_ranks
from tests.legacy import state_dict_scenarios as steps
from tests.legacy.ckpt_support import load_into, state_dict_of
from tests.legacy.fsdp1_scenario_models import (
    PlainRoot,
    TwiceInner,
    fsdp,
    nested,
    quiet,
    skip_model,
    twice_inner,
)
from tests.legacy.legacy_parity import LegacyRun, lib, wrap_model
from tests.legacy.optim_support import assert_same, comparable
from tests.legacy.state_dict_scenarios import ALL_MATCHED, IMPLS, KINDS


def _flow(impl: str, kind: str) -> dict[str, Any]:
    """Train three steps, load into a blank model: its parameters are the trained ones."""
    model = twice_inner(impl)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.rand(64, 4, generator=torch.Generator().manual_seed(4))
    for _ in range(3):
        model(data).sum().backward()
        opt.step()
        opt.zero_grad()
    blank = twice_inner(impl)
    steps.zero(impl, blank)
    saved = state_dict_of(impl, model, kind)
    out: dict[str, Any] = {"result": str(load_into(impl, blank, kind, saved))}
    out["loaded"], out["trained"] = steps.params(impl, blank), steps.params(impl, model)
    out["keys"] = list(saved)
    out["plain_keys"] = list(twice_inner(None).state_dict())
    return out


def _into_plain(impl: str, kind: str, fsdp_root: bool, rank0: bool) -> dict[str, Any]:
    """FSDP1's FULL or SHARDED state dict, gathered, loads into the plain model."""
    torch.manual_seed(0)
    model = twice_inner(impl, buffers=True) if fsdp_root else PlainRoot(impl)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.rand(64, 4) if fsdp_root else torch.randn(1, 10)
    for _ in range(3):
        model(data).sum().backward()
        opt.step()
        opt.zero_grad()
    trained = steps.params(impl, model)
    saved = state_dict_of(impl, model, kind, steps.rank0_config(impl, rank0))
    with quiet():
        saved = _gather_state_dict(saved)
    if rank0:
        saved = steps.everywhere(saved)
    torch.manual_seed(1)
    plain = twice_inner(None, buffers=True) if fsdp_root else _plain_of_plain_root()
    with torch.no_grad():
        for param in plain.parameters():
            param.zero_()
    result = str(plain.load_state_dict(saved))
    return {"result": result, "loaded": [p.clone() for p in plain.parameters()], "trained": trained}


def _plain_of_plain_root() -> nn.Module:
    return nn.ModuleDict(
        {
            "non_fsdp_lin": nn.Linear(10, 10, bias=False),
            "fsdp_1": nn.Sequential(nn.Linear(10, 10, bias=False), nn.Linear(10, 10, bias=False)),
            "fsdp_2": nn.Sequential(nn.Linear(10, 10, bias=False), nn.Linear(10, 10, bias=False)),
        }
    )


def _skip(impl: str, kind: str) -> dict[str, Any]:
    model = skip_model(impl)
    model(torch.randn(1, 10)).sum().backward()
    saved = state_dict_of(impl, model, kind)
    out: dict[str, Any] = {"keys": list(saved), "saved": comparable(saved)}
    target = skip_model(impl)
    steps.zero(impl, target)
    copied = saved if kind == "LOCAL_STATE_DICT" else copy.deepcopy(saved)
    out["result"] = str(load_into(impl, target, kind, copied))
    out["loaded"], out["expected"] = steps.params(impl, target), steps.params(impl, model)
    if kind != "LOCAL_STATE_DICT":
        plain = skip_model(None)
        with quiet():
            gathered = _gather_state_dict(saved)
        out["plain"] = str(plain.load_state_dict(gathered))
        out["plain_keys"] = sorted(plain.state_dict())
        out["plain_values"] = {k: v.clone() for k, v in plain.state_dict().items()}
        out["gathered"] = {k: v.clone() for k, v in gathered.items()}
    return out


def _misc(impl: str) -> dict[str, Any]:
    ns = lib(impl)
    out: dict[str, Any] = {}
    # The type set inside state_dict_type is undone on leaving it, on every unit.
    model = skip_model(impl)
    with quiet():
        with ns.FSDP.state_dict_type(model, ns.StateDictType.LOCAL_STATE_DICT):
            pass
        out["restored"] = [
            ns.FSDP.get_state_dict_type(m).state_dict_type.name for m in ns.FSDP.fsdp_modules(model)
        ]
    # A one-element parameter: rank 1's LOCAL shard is empty; a deep copy loads back.
    one: Any = _one_element(impl)
    with quiet(), ns.FSDP.state_dict_type(one, ns.StateDictType.LOCAL_STATE_DICT):
        one(None).backward()
        saved = copy.deepcopy(one.state_dict())
        with torch.no_grad(), ns.FSDP.summon_full_params(one):
            one.my_parameter.copy_(torch.full((1,), 1.75))
        out["one_element_result"] = str(one.load_state_dict(saved))
        with ns.FSDP.summon_full_params(one):
            out["one_element"] = one.my_parameter.item()
    # torch.save and torch.load(weights_only=True) of a LOCAL state dict.
    model = twice_inner(impl)
    local = state_dict_of(impl, model, "LOCAL_STATE_DICT")
    buffer = io.BytesIO()
    torch.save(local, buffer)
    buffer.seek(0)
    with quiet(), torch.serialization.safe_globals(_sharded_tensor_globals()):
        back = torch.load(buffer, weights_only=True)
    out["torch_load"] = (comparable(back), comparable(local))
    # Missing and unexpected keys of a non-strict FULL load carry no FSDP1 prefix.
    model = nested(impl)
    full = dict(model.state_dict())
    full.pop(next(iter(full)))
    full["unexpected"] = torch.ones(1)
    result = model.load_state_dict(full, strict=False)
    out["non_strict"] = (list(result.missing_keys), list(result.unexpected_keys))
    return out


def _sharded_tensor_globals() -> list[Any]:
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        MEM_FORMAT_ENCODING,
        ShardedTensorMetadata,
        TensorProperties,
    )
    from torch.distributed._shard.sharded_tensor.shard import Shard
    from torch.distributed._shard.sharding_spec.chunk_sharding_spec import ChunkShardingSpec
    from torch.distributed.remote_device import _remote_device

    return [
        Shard, ShardMetadata, ShardedTensor, ShardedTensorMetadata, TensorProperties,
        MEM_FORMAT_ENCODING, _remote_device, getattr, ShardedTensor.ProcessGroupState,
        ChunkShardingSpec,
    ]  # fmt: skip


class _OneElement(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.my_parameter = nn.Parameter(torch.full((1,), 3.1415926))

    def forward(self, x: Any) -> torch.Tensor:
        return self.my_parameter


def _one_element(impl: str) -> nn.Module:
    return fsdp(impl, _OneElement())


def _world_of_one(impl: str) -> dict[str, Any]:
    """Each rank its own group of one: SHARDED saved and loaded back."""
    groups = [dist.new_group(ranks=[r]) for r in range(dist.get_world_size())]
    mine = groups[dist.get_rank()]
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    seq[0] = fsdp(impl, seq[0], process_group=mine)
    model = fsdp(impl, seq, process_group=mine)
    saved = state_dict_of(impl, model, "SHARDED_STATE_DICT")
    steps.zero(impl, model)
    return {
        "strategies": [m.sharding_strategy.name for m in lib(impl).FSDP.fsdp_modules(model)],
        "saved": comparable(saved),
        "result": str(load_into(impl, model, "SHARDED_STATE_DICT", saved)),
        "loaded": steps.params(impl, model),
    }


def _sync_from_rank0(orig: bool) -> dict[str, Any]:
    """FSDP1's rank-0 flow: torch's FSDP1 saves a FULL state dict on rank 0 only; rank 0
    loads it into a plain model, and ``sync_module_states`` gives it to every rank.

    shardkit does the second half (torch's FSDP1 refuses ``sync_module_states`` for CPU
    modules); torch's FSDP1 model is the oracle for the values.
    """
    torch.manual_seed(0)
    source = twice_inner("torch", buffers=True)
    with quiet(), lib("torch").FSDP.summon_full_params(source), torch.no_grad():
        for tensor in [*source.parameters(), *source.buffers()]:
            tensor.add_(1.0)  # other values than a fresh model's
    saved = state_dict_of("torch", source, "FULL_STATE_DICT", steps.rank0_config("torch", True))
    torch.manual_seed(1)
    plain = twice_inner(None, buffers=True)
    with torch.no_grad():
        for tensor in [*plain.parameters(), *plain.buffers()]:
            tensor.zero_()
    if dist.get_rank() == 0:
        plain.load_state_dict(saved)
    synced = fsdp("shardkit", plain, sync_module_states=True, use_orig_params=orig)
    return {
        "params": steps.params("shardkit", synced),
        "expected": steps.params("torch", source),
        "buffers": _persistent_buffers(synced),
        "expected_buffers": _persistent_buffers(source),
    }


def _persistent_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The buffers a state dict holds (non-persistent ones are neither saved nor loaded)."""
    return [b.clone() for n, b in model.named_buffers() if "non_persistent" not in n]


def _flows_body(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for impl in IMPLS:
        for kind in KINDS:
            out[f"{impl}/flow/{kind}"] = _flow(impl, kind)
            out[f"{impl}/skip/{kind}"] = _skip(impl, kind)
            if kind == "LOCAL_STATE_DICT":
                continue
            for fsdp_root in (False, True):
                for rank0 in (False, True) if kind == "FULL_STATE_DICT" else (False,):
                    key = f"{impl}/plain/{kind}/{fsdp_root}/{rank0}"
                    out[key] = _into_plain(impl, kind, fsdp_root, rank0)
        out[f"{impl}/misc"] = _misc(impl)
    return out


def test_save_load_flows_keys_plain_models_and_skipped_modules_as_fsdp1s() -> None:
    results = run_on_ranks(2, _flows_body)
    steps.assert_same_as_fsdp1(results)
    for out in results:
        for kind in KINDS:
            flow = out[f"shardkit/flow/{kind}"]
            assert flow["result"] == ALL_MATCHED, kind
            torch.testing.assert_close(flow["loaded"], flow["trained"], msg=kind)
            if kind == "LOCAL_STATE_DICT":
                assert flow["keys"] == ["_flat_param", "inner._flat_param"]
            else:
                assert flow["keys"] == flow["plain_keys"], kind
            skip = out[f"shardkit/skip/{kind}"]
            assert skip["result"] == ALL_MATCHED, kind
            torch.testing.assert_close(skip["loaded"], skip["expected"], msg=kind)
            assert "linear_skip.lin.weight" in skip["keys"], kind
            if kind != "LOCAL_STATE_DICT":
                assert sorted(skip["keys"]) == skip["plain_keys"], kind
                assert skip["plain"] == ALL_MATCHED, kind
                assert_same(skip["plain_values"], skip["gathered"], kind)
        for key, got in out.items():
            if key.startswith("shardkit/plain/"):
                assert got["result"] == ALL_MATCHED, key
                torch.testing.assert_close(got["loaded"], got["trained"], msg=key)
        misc = out["shardkit/misc"]
        assert set(misc["restored"]) == {"FULL_STATE_DICT"}
        assert misc["one_element_result"] == ALL_MATCHED
        assert misc["one_element"] == torch.tensor(3.1415926).item()
        assert_same(misc["torch_load"][0], misc["torch_load"][1], "torch.load of LOCAL")
        (missing,), (unexpected,) = misc["non_strict"]  # FSDP1's prefix cleaned
        assert "_fsdp_wrapped_module" not in missing + unexpected, misc["non_strict"]


def _set_type_on_a_backend_group(impl: str) -> dict[str, Any]:
    """A model on a group named by backend ("cpu:gloo"), SHARDED set for good with
    ``set_state_dict_type``: its parameters zeroed in place, then loaded back."""
    ns = lib(impl)
    group = dist.new_group(backend="cpu:gloo")
    run = LegacyRun(model="gpt_tied", extra={"use_orig_params": True, "process_group": group})
    model = wrap_model(impl, run)
    with quiet():
        ns.FSDP.set_state_dict_type(model, ns.StateDictType.SHARDED_STATE_DICT)
        sharded = model.state_dict()
    before = steps.params(impl, model)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    with quiet():
        result = str(model.load_state_dict(sharded))
    return {"result": result, "before": before, "after": steps.params(impl, model)}


def _one_and_sync_body(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {f"{impl}/one": _world_of_one(impl) for impl in IMPLS}
    for impl in IMPLS:
        out[f"{impl}/set_type"] = _set_type_on_a_backend_group(impl)
    for orig in (False, True):
        out[f"sync/{orig}"] = _sync_from_rank0(orig)
    return out


def test_a_world_of_one_a_backend_group_and_rank0s_checkpoint_spread_by_sync() -> None:
    for out in run_on_ranks(2, _one_and_sync_body):
        ours, theirs = out["shardkit/one"], out["torch/one"]
        assert ours["result"] == theirs["result"] == ALL_MATCHED
        torch.testing.assert_close(ours["loaded"], theirs["loaded"])
        # Both turn a group of one into NO_SHARD, whose SHARDED state dict holds plain
        # tensors (FULL's, with a warning).
        assert ours["strategies"] == theirs["strategies"] == ["NO_SHARD", "NO_SHARD"]
        assert_same(ours["saved"], theirs["saved"], "a group of one's SHARDED state dict")
        assert all(isinstance(value, torch.Tensor) for value in ours["saved"].values())
        ours, theirs = out["shardkit/set_type"], out["torch/set_type"]
        assert_same(ours, theirs, "set_state_dict_type on a cpu:gloo group")
        assert ours["result"] == ALL_MATCHED and not ours["before"][0].eq(0).all()
        torch.testing.assert_close(ours["after"], ours["before"])
        for orig in (False, True):
            got = out[f"sync/{orig}"]
            torch.testing.assert_close(got["params"], got["expected"])
            torch.testing.assert_close(got["buffers"], got["expected_buffers"])


def _reshard(impl: str) -> dict[str, Any]:
    """LOCAL state dicts at 4 ranks, resharded by hand into a model on ranks 0 and 1."""
    from torch.distributed._shard.sharded_tensor import init_from_local_shards
    from torch.distributed._shard.sharded_tensor.shard import Shard
    from torch.distributed._state_dict_utils import _all_gather_sharded_tensor

    rank = dist.get_rank()
    pair = dist.new_group(ranks=[0, 1])
    model = twice_inner(impl)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 4, generator=torch.Generator().manual_seed(6))).sum().backward()
    opt.step()
    local = state_dict_of(impl, model, "LOCAL_STATE_DICT")
    resharded: dict[str, Any] = {}
    for key, value in local.items():
        if type(value).__name__ != "ShardedTensor":
            resharded[key] = value
            continue
        with quiet(), torch.no_grad():  # the shards require grad, as FSDP1's do
            flat = _all_gather_sharded_tensor(value)
        if rank < 2:
            chunks = flat.chunk(2)
            offset = 0 if rank == 0 else chunks[0].numel()
            shard = Shard.from_tensor_and_offsets(chunks[rank], [offset], rank)
            with quiet():
                resharded[key] = init_from_local_shards([shard], flat.size(), process_group=pair)
    full = state_dict_of(impl, model, "FULL_STATE_DICT")
    if rank >= 2:
        return {}
    torch.manual_seed(0)
    inner: Any = TwiceInner(None)
    inner.inner = fsdp(impl, inner.inner, process_group=pair)
    target = fsdp(impl, inner, process_group=pair)
    result = str(load_into(impl, target, "LOCAL_STATE_DICT", resharded))
    return {"result": result, "full": comparable(state_dict_of(impl, target, "FULL_STATE_DICT")),
            "expected": comparable(full)}  # fmt: skip


def _reshard_body(rank: int, world_size: int) -> dict[str, Any]:
    return {impl: _reshard(impl) for impl in IMPLS}


def test_local_state_dicts_resharded_by_hand_to_half_the_ranks_load_as_fsdp1s() -> None:
    for rank, out in enumerate(run_on_ranks(4, _reshard_body)):
        if rank >= 2:
            assert out == {"shardkit": {}, "torch": {}}
            continue
        assert_same(out["shardkit"], out["torch"], f"rank {rank}")
        assert out["shardkit"]["result"] == ALL_MATCHED
        assert_same(out["shardkit"]["full"], out["shardkit"]["expected"], f"rank {rank}")
