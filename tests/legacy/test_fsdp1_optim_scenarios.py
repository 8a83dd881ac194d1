"""More of FSDP1's optimizer-state scenarios (torch's test_fsdp_optim_state.py).

Those ``test_optim_scenarios.py`` leaves: state saved from one wrapping and loaded into
another (FSDP1's ``wrap_alt``) through every loading API, with flat parameters and with
``use_orig_params``, at the same world size and on half the ranks; a GPT whose embedding is
its head (FSDP1's transformer scenario) through every API; the interface's arguments
(``optim_state_dict=``, ``load_directly``, each form's value types, rank0_only); entries of
the user's own beside no tensor state. torch's FSDP1 in the same workers is the oracle, and
what each to-load dict holds is compared with what the optimizer itself holds, as FSDP1's
own tests do.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._state_dict_utils import _gather_state_dict

from harness.pool import run_on_ranks
from tests.legacy.ckpt_support import train_steps
from tests.legacy.fsdp1_scenario_models import fsdp, quiet
from tests.legacy.legacy_parity import LegacyRun, lib, wrap_model
from tests.legacy.nested_optim_support import Nested as _Nested
from tests.legacy.nested_optim_support import cloned as _cloned
from tests.legacy.nested_optim_support import optim_input as _optim_input
from tests.legacy.nested_optim_support import root_model as _root_model
from tests.legacy.nested_optim_support import setup as _setup
from tests.legacy.nested_optim_support import train as _train
from tests.legacy.optim_support import assert_same, call, comparable, with_type

IMPLS = ("shardkit", "torch")


def _alt(impl: str, **kwargs: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    """FSDP1's other wrapping of the model: block0's first shift, then block0; two groups,
    listed in reverse on odd ranks."""
    model: Any = _Nested()
    model.block0.shift0 = fsdp(impl, model.block0.shift0, **kwargs)
    model.block0 = fsdp(impl, model.block0, **kwargs)
    optim_input = _optim_input(model, True, dist.get_rank() % 2 == 1)
    return model, torch.optim.Adam(optim_input, lr=0.01)


def _loads(impl: str, model: nn.Module, opt: Any, saved: dict[str, Any]) -> dict[str, Any]:
    """What every loading API gives ``opt`` from ``saved``'s forms."""
    ns, first = lib(impl), dist.get_rank() == 0
    full, sharded = saved["full"], saved["sharded"]
    out = {
        "shard_full": call(impl, "shard_full_optim_state_dict", full, model, optim=opt),
        "scatter": call(
            impl, "scatter_full_optim_state_dict", full if first else None, model, optim=opt
        ),
        "flatten": call(impl, "flatten_sharded_optim_state_dict", sharded, model, opt),
    }
    with with_type(impl, model, "FULL_STATE_DICT"):
        out["to_load"] = call(impl, "optim_state_dict_to_load", model, opt, full)
    config = ns.FullOptimStateDictConfig(rank0_only=True)
    with with_type(impl, model, "FULL_STATE_DICT", config):
        given = full if first else {}
        out["to_load_rank0"] = call(impl, "optim_state_dict_to_load", model, opt, given)
    with with_type(impl, model, "SHARDED_STATE_DICT"):
        out["to_load_sharded"] = call(impl, "optim_state_dict_to_load", model, opt, sharded)
    return out


def _unmanaged_full(value: Any) -> Any:
    """ShardedTensors made full, as FSDP1's tests read a to-load dict.

    Loaded into a wrapping where no unit holds a parameter (block1 here), both FSDP1 and
    shardkit hand the saved ShardedTensor on for it; FSDP1's tests gather it before comparing.
    """
    if isinstance(value, dict):
        return {k: _unmanaged_full(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unmanaged_full(v) for v in value]
    if type(value).__name__ == "ShardedTensor":
        return _gather_state_dict({"value": value})["value"]
    return value


def _saved(impl: str, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    saved = {
        "full": call(impl, "full_optim_state_dict", model, opt, rank0_only=False),
        "sharded": call(impl, "sharded_optim_state_dict", model, opt),
    }
    return dict(_cloned(saved))


def _sharded_entries(ready: dict[str, dict[str, Any]]) -> dict[str, tuple[int, list[str]]]:
    """For each way: how many parameters' state holds ShardedTensors, under which names.

    Counted, not listed by id: the ids follow each optimizer's own parameters, which with
    flat parameters FSDP1 holds fewer of (one per unit).
    """
    found = {}
    for way, osd in ready.items():
        entries = [
            (key, name)
            for key, entry in osd["state"].items()
            for name, value in entry.items()
            if type(value).__name__ == "ShardedTensor"
        ]
        found[way] = (len({key for key, _ in entries}), sorted({name for _, name in entries}))
    return found


def _other_wrapping_body(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    fsdp1_source, fsdp1_opt, _ = _setup("torch")
    _train(fsdp1_source, fsdp1_opt)
    fsdp1_saved = _saved("torch", fsdp1_source, fsdp1_opt)
    full: dict[str, Any] = {}
    for impl in IMPLS:
        source, source_opt, _ = _setup(impl)
        _train(source, source_opt)
        saved = _saved(impl, source, source_opt)
        full[impl] = saved["full"]
        model, opt = _alt(impl)
        _train(model, opt)  # as the source trained: the same state
        out[f"{impl}/holds"] = comparable(opt.state_dict())
        for origin, state in (("own", saved), ("fsdp1s", fsdp1_saved)):
            ready = _loads(impl, model, opt, state)
            out[f"{impl}/{origin}"] = {
                way: comparable(_unmanaged_full(d)) for way, d in ready.items()
            }
            out[f"{impl}/{origin}/sharded"] = _sharded_entries(ready)
        opt.load_state_dict(_loads(impl, model, opt, fsdp1_saved)["scatter"])
        out[f"{impl}/after"] = _train(model, opt, 2)
    # use_orig_params=True: shardkit only; torch 2.13's FSDP1 gives exp_avg_sq's values for
    # exp_avg there (see test_optim_scenarios.py), so the optimizer's own state is the oracle.
    source, source_opt, _ = _setup("shardkit", use_orig_params=True)
    _train(source, source_opt)
    model, opt = _alt("shardkit", use_orig_params=True)
    _train(model, opt)
    out["orig/holds"] = comparable(opt.state_dict())
    orig_saved = _saved("shardkit", source, source_opt)
    ready = _loads("shardkit", model, opt, orig_saved)
    out["orig/loads"] = {way: comparable(_unmanaged_full(d)) for way, d in ready.items()}
    # The same full states into the other wrapping on half the ranks (even ones).
    half = dist.new_group(ranks=list(range(0, world_size, 2)))
    full["orig"] = orig_saved["full"]
    for name, state in full.items():
        if rank % 2 == 0:
            out[f"half/{name}"] = _halved(name, state, half)
    return out


def _halved(name: str, full: dict[str, Any], half: dist.ProcessGroup) -> dict[str, Any]:
    """``full`` loaded through the full-state APIs into the other wrapping on ``half``."""
    impl = "shardkit" if name == "orig" else name
    model, opt = _alt(impl, process_group=half, use_orig_params=name == "orig")
    _train(model, opt)
    return _full_loads_on(impl, model, opt, full, half)


def _full_loads_on(
    impl: str, model: nn.Module, opt: Any, full: dict[str, Any], group: dist.ProcessGroup
) -> dict[str, Any]:
    """What ``opt`` holds, and what each full-state API gives it from ``full`` on ``group``."""
    first = dist.get_rank() == 0
    scatter = call(
        impl, "scatter_full_optim_state_dict", full if first else None, model, optim=opt,
        group=group,
    )  # fmt: skip
    with with_type(impl, model, "FULL_STATE_DICT"):
        to_load = call(impl, "optim_state_dict_to_load", model, opt, full, group=group)
    ready = {
        "shard_full": call(impl, "shard_full_optim_state_dict", full, model, optim=opt),
        "scatter": scatter,
        "to_load": to_load,
    }
    out = {"holds": comparable(opt.state_dict())}
    out.update({way: comparable(d) for way, d in ready.items()})
    return out


def test_state_loads_into_another_wrapping_through_every_api_as_fsdp1() -> None:
    for rank, out in enumerate(run_on_ranks(2, _other_wrapping_body)):
        for impl in IMPLS:
            for origin in ("own", "fsdp1s"):
                for way, ready in out[f"{impl}/{origin}"].items():
                    where = f"rank {rank} {impl} {origin} {way}"
                    assert_same(ready, out[f"{impl}/holds"], where)
                ours, theirs = out[f"shardkit/{origin}/sharded"], out[f"torch/{origin}/sharded"]
                assert ours == theirs and ours["flatten"][0] > 0, (rank, origin, ours, theirs)
        halved = [k for k in out if k.startswith("half/")]
        assert len(halved) == (3 if rank % 2 == 0 else 0), halved
        for key in halved:
            got = out[key]
            for way in ("shard_full", "scatter", "to_load"):
                assert_same(got[way], got["holds"], f"rank {rank} {key} {way}")
        for way, ready in out["orig/loads"].items():
            assert_same(ready, out["orig/holds"], f"rank {rank} use_orig_params {way}")
        torch.testing.assert_close(out["shardkit/after"], out["torch/after"])


# --- the interface's arguments; entries of the user's own beside no tensor state ----------


def _types(osd: dict[str, Any]) -> list[str]:
    """The type of every non-scalar state value."""
    return sorted(
        {
            type(v).__name__
            for entry in osd.get("state", {}).values()
            for v in entry.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        }
    )


def _interface(impl: str) -> dict[str, Any]:
    ns = lib(impl)
    model = _root_model(impl)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, opt, 1)
    original = copy.deepcopy(opt.state_dict())
    given = call(impl, "optim_state_dict", model, opt, optim_state_dict=original)
    out: dict[str, Any] = {"given": comparable(given)}
    out["default"] = comparable(call(impl, "optim_state_dict", model, opt))
    out["full_types"] = _types(given)
    _train(model, opt, 1)
    call(impl, "optim_state_dict_to_load", model, opt, given, load_directly=True)
    out["loaded"], out["original"] = comparable(opt.state_dict()), comparable(original)
    config = ns.ShardedOptimStateDictConfig(offload_to_cpu=False)
    with with_type(impl, model, "SHARDED_STATE_DICT", config):
        sharded = call(impl, "optim_state_dict", model, opt, optim_state_dict=original)
    out["sharded_types"] = _types(sharded)
    config = ns.FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with with_type(impl, model, "FULL_STATE_DICT", config):
        rank0 = call(impl, "optim_state_dict", model, opt, optim_state_dict=original)
    out["rank0"] = comparable(rank0)
    return out


def _own_values(impl: str, orig: bool, adam: bool) -> list[tuple[Any, Any]]:
    with quiet():
        model = _root_model(impl, use_orig_params=orig)
    params = model.parameters()
    opt = torch.optim.Adam(params, lr=0.01) if adam else torch.optim.SGD(params, lr=0.01)
    _train(model, opt, 1)
    original = copy.deepcopy(opt.state_dict())
    for entry in original["state"].values():
        entry.update(value1=2.74, value2=None)
    saved = call(impl, "optim_state_dict", model, opt, optim_state_dict=original)
    ready = call(impl, "optim_state_dict_to_load", model, opt, saved)
    return sorted({(e["value1"], e["value2"]) for e in ready["state"].values()})


def _tied(impl: str) -> dict[str, Any]:
    """FSDP1's transformer scenario: the GPT with its embedding as its head, every API."""
    run = LegacyRun(model="gpt_tied")
    model = wrap_model(impl, run)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train_steps(model, opt, run, range(2))
    out: dict[str, Any] = {"holds": comparable(opt.state_dict())}
    saved = _saved(impl, model, opt)
    ready = _loads(impl, model, opt, saved)
    out["loads"] = {way: comparable(d) for way, d in ready.items()}
    half = dist.new_group(ranks=list(range(0, dist.get_world_size(), 2)))
    if dist.get_rank() % 2 == 0:
        out["half"] = _tied_on_half(impl, saved["full"], half)
    opt.load_state_dict(ready["scatter"])
    out["after"] = train_steps(model, opt, run, range(2, 4))
    return out


def _tied_on_half(impl: str, full: dict[str, Any], half: dist.ProcessGroup) -> dict[str, Any]:
    """The tied GPT on half the ranks, trained on the same global batches: the full state
    saved on every rank loads through each full-state API as its optimizer holds it."""
    from tests.core import models

    run = LegacyRun(model="gpt_tied", extra={"process_group": half})
    model = wrap_model(impl, run)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(2):  # each rank of ``half`` takes its part of the whole batch
        x, y = models.batch(run.model, step, 2 * dist.get_world_size())
        x, y = x.chunk(half.size())[half.rank()], y.chunk(half.size())[half.rank()]
        models.loss_of(run.model, model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return _full_loads_on(impl, model, opt, full, half)


def _no_shard_orig(impl: str) -> tuple[Any, Any]:
    """NO_SHARD with use_orig_params: saved and loaded back, what the optimizer held."""
    ns = lib(impl)
    model = _root_model(impl, sharding_strategy=ns.ShardingStrategy.NO_SHARD, use_orig_params=True)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, opt, 1)
    held = comparable(opt.state_dict())
    saved = _cloned(call(impl, "optim_state_dict", model, opt))
    opt.load_state_dict(call(impl, "optim_state_dict_to_load", model, opt, saved))
    return held, comparable(opt.state_dict())


def _interface_body(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for impl in IMPLS:
        out[f"{impl}/interface"] = _interface(impl)
        out[f"{impl}/tied"] = _tied(impl)
        out[f"{impl}/no_shard_orig"] = _no_shard_orig(impl)
        for orig in (False, True):
            for adam in (False, True):
                out[f"{impl}/own/{orig}/{adam}"] = _own_values(impl, orig, adam)
    return out


def test_interface_arguments_tied_parameters_and_the_users_own_entries_as_fsdp1() -> None:
    for rank, out in enumerate(run_on_ranks(2, _interface_body)):
        ours, theirs = out["shardkit/interface"], out["torch/interface"]
        for key in ("given", "default", "full_types", "sharded_types", "rank0"):
            assert_same(ours[key], theirs[key], f"rank {rank} {key}")
        assert_same(ours["given"], ours["default"], f"rank {rank}: optim_state_dict= is the same")
        assert_same(ours["loaded"], ours["original"], f"rank {rank}: load_directly")
        assert ours["full_types"] == ["Tensor"] and ours["sharded_types"] == ["ShardedTensor"]
        assert (ours["rank0"] == {}) == (rank == 1)
        for impl in IMPLS:
            tied = out[f"{impl}/tied"]
            for way, ready in tied["loads"].items():
                assert_same(ready, tied["holds"], f"rank {rank} {impl} tied {way}")
            assert ("half" in tied) == (rank % 2 == 0), (rank, impl)
            for way in ("shard_full", "scatter", "to_load") if "half" in tied else ():
                where = f"rank {rank} {impl} tied on half the ranks {way}"
                assert_same(tied["half"][way], tied["half"]["holds"], where)
        for impl in IMPLS:  # (torch's exp_avg mix-up with use_orig_params spares NO_SHARD)
            held, loaded = out[f"{impl}/no_shard_orig"]
            assert_same(loaded, held, f"rank {rank} {impl} NO_SHARD use_orig_params")
        ours, theirs = out["shardkit/tied"]["after"], out["torch/tied"]["after"]
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        for orig in (False, True):
            for adam in (False, True):
                key = f"own/{orig}/{adam}"
                # SGD without momentum holds no state: nothing to carry the entries.
                expected = [(2.74, None)] if adam else []
                assert out[f"shardkit/{key}"] == out[f"torch/{key}"] == expected, key
