"""What running torch's own FSDP1 tests against shardkit.legacy found, against torch's FSDP1.

Each scenario here is one that torch's ``test_fsdp_optim_state.py`` / ``test_fsdp_state_dict.py``
(run on CPU, gloo, two ranks, with shardkit.legacy swapped in) passed on torch's FSDP1 and
failed on ours, retold with this project's own models. The oracle is torch's FSDP1 in the same
workers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from harness.pool import run_on_ranks
from tests.legacy.fsdp1_scenario_models import quiet
from tests.legacy.legacy_parity import lib
from tests.legacy.nested_optim_support import Nested, cloned, setup, train, wrapped
from tests.legacy.optim_support import call

IMPLS = ("shardkit", "torch")
FLAT_SCALAR_ERROR = (
    "All unflattened parameters comprising a single flat parameter must have scalar state "
    "with the same value and dtype"
)


# --- a parameter the saved state does not know, inside a unit of flat parameters ---------------


def _extra_in(impl: str, root_unit: bool) -> nn.Module:
    """The nested model with one more parameter in unit ``stack.2``, with flat parameters."""
    model = Nested()
    model.stack[2].register_parameter("extra", nn.Parameter(torch.randn(5, 5)))
    inner: nn.Module = wrapped(impl, model, use_orig_params=False)
    if not root_unit:
        return inner
    with quiet():  # the optimizer then holds flat parameters on both sides
        outer: nn.Module = lib(impl).FSDP(inner, device_id=torch.device("cpu"))
    return outer


def _unknown_in_unit_body(rank: int, world_size: int, root_unit: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for impl in IMPLS:
        source, source_opt, _ = setup(impl, two_groups=False, use_orig_params=False)
        train(source, source_opt, 1)
        saved = {
            "full": call(impl, "full_optim_state_dict", source, source_opt, rank0_only=False),
            "sharded": call(impl, "sharded_optim_state_dict", source, source_opt),
        }
        for way, api, form in (
            ("shard_full", "shard_full_optim_state_dict", "full"),
            ("flatten", "flatten_sharded_optim_state_dict", "sharded"),
        ):
            model = _extra_in(impl, root_unit)
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
            try:
                call(impl, api, saved[form], model, optim=opt)
                out[f"{impl}/{way}"] = "loaded"
            except ValueError as error:  # the outcome, compared with FSDP1's
                out[f"{impl}/{way}"] = ("ValueError", str(error)[: len(FLAT_SCALAR_ERROR)])
    return out


@pytest.mark.parametrize("root_unit", [True, False])
def test_a_flat_units_parameter_the_saved_state_lacks_is_refused_as_fsdp1(root_unit: bool) -> None:
    # The unit's one flat parameter would get one `step` for some of its parameters only:
    # FSDP1 raises ValueError, and so do we, whether the root is a unit or a plain module
    # (its optimizer holds the flat parameters either way).
    for out in run_on_ranks(2, _unknown_in_unit_body, root_unit=root_unit):
        for way in ("shard_full", "flatten"):
            theirs = out[f"torch/{way}"]
            assert theirs == ("ValueError", FLAT_SCALAR_ERROR), (way, theirs)
            assert out[f"shardkit/{way}"] == theirs, way


class _Unused(nn.Module):
    """A unit whose second layer never runs: no gradient, no optimizer state of its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.used(x)
        return out


def _unused_body(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for impl in IMPLS:
        with quiet():
            model = nn.Sequential(lib(impl).FSDP(_Unused(), device_id=torch.device("cpu")))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        full = call(impl, "full_optim_state_dict", model, opt, rank0_only=False)
        ready = call(impl, "shard_full_optim_state_dict", full, model, optim=opt)
        opt.load_state_dict(ready)
        out[impl] = "loaded"
    return out


def test_a_flat_unit_with_an_unused_parameter_saves_and_loads_its_optimizer_state() -> None:
    # Under a plain root the optimizer holds the unit's sharded parameters and the unused one
    # gets no state: loading that state back must not take it for a missing one.
    for out in run_on_ranks(2, _unused_body):
        assert out == {"shardkit": "loaded", "torch": "loaded"}


# --- FSDP1's private state-dict attributes, read by code written for it -------------------------


def _private_settings(impl: str) -> list[Any]:
    ns = lib(impl)
    with quiet():  # units inside units, under a root unit
        model = ns.FSDP(wrapped(impl), device_id=torch.device("cpu"))
    seen: list[Any] = []

    def read() -> None:
        for unit in ns.FSDP.fsdp_modules(model):
            seen.append(
                (
                    unit._state_dict_type.name,
                    type(unit._state_dict_config).__name__,
                    type(unit._optim_state_dict_config).__name__,
                )
            )

    read()
    with quiet(), ns.FSDP.state_dict_type(model, ns.StateDictType.SHARDED_STATE_DICT):
        read()
    read()  # the type before the block again, on every unit
    return seen


def _private_settings_body(rank: int, world_size: int) -> dict[str, Any]:
    return {impl: _private_settings(impl) for impl in IMPLS}


def test_private_state_dict_attributes_follow_state_dict_type_as_fsdp1s() -> None:
    for out in run_on_ranks(2, _private_settings_body):
        assert out["shardkit"] == out["torch"]
        assert (
            "SHARDED_STATE_DICT",
            "ShardedStateDictConfig",
            "ShardedOptimStateDictConfig",
        ) in out["torch"]


# --- a rank missing state the first rank has: FSDP1's words ------------------------------------

MISSING_STATE_ERROR = (
    "FSDP currently requires each rank to have at least the optimizer states needed by rank "
    "0's optimizer but some ranks are missing some of those states"
)


def _missing_words_body(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for impl in IMPLS:
        model = wrapped(impl, use_orig_params=False)
        params = list(model.parameters())
        opt = torch.optim.Adam(params[:-1] if rank == 1 else params, lr=0.01)
        train(model, opt, 1)
        try:
            call(impl, "full_optim_state_dict", model, opt)
            out[impl] = "no error"
        except RuntimeError as error:  # the words, compared with FSDP1's
            out[impl] = str(error)[: len(MISSING_STATE_ERROR)]
    return out


def test_a_rank_missing_the_first_ranks_state_raises_with_fsdp1s_words() -> None:
    for out in run_on_ranks(2, _missing_words_body):
        assert out["torch"] == MISSING_STATE_ERROR
        assert out["shardkit"] == out["torch"]


# --- a plain root holding units of flat parameters: the optimizer's own state ------------------


def _same_as_local(loaded: dict[str, Any], local: dict[str, Any]) -> bool:
    """``loaded`` is what ``optim.state_dict()`` holds: the same keys, groups and plain tensors."""
    if loaded["param_groups"] != local["param_groups"] or set(loaded["state"]) != set(
        local["state"]
    ):
        return False
    for key, state in local["state"].items():
        other = loaded["state"][key]
        if set(other) != set(state):
            return False
        for name, value in state.items():
            mine = other[name]
            if type(mine) is not type(value):  # a DTensor is not the optimizer's tensor
                return False
            if isinstance(value, torch.Tensor) and not torch.equal(mine, value):
                return False
    return True


def _plain_root_body(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for impl in IMPLS:
        ns = lib(impl)
        model = wrapped(impl, use_orig_params=False)
        out[f"{impl}/listed"] = [
            (name, type(p).__name__, p.dim()) for name, p in model.named_parameters()
        ]
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        out[f"{impl}/losses"] = train(model, opt, 2)
        local = opt.state_dict()
        full = call(impl, "full_optim_state_dict", model, opt, rank0_only=False)
        out[f"{impl}/full"] = cloned(full["state"])  # FSDP1 hands out live `step`s
        # The same model unwrapped, trained alike, its state keyed by names (FSDP1's recipe
        # for moving a single-process optimizer state onto a wrapped model).
        plain = Nested()
        plain_opt = torch.optim.Adam(plain.parameters(), lr=0.01)
        train(plain, plain_opt, 2)
        named = call(
            impl,
            "rekey_optim_state_dict",
            plain_opt.state_dict(),
            ns.OptimStateKeyType.PARAM_NAME,
            plain,
            optim=plain_opt,
        )
        out[f"{impl}/names"] = sorted(named["state"])
        sharded = call(impl, "sharded_optim_state_dict", model, opt)
        with quiet(), ns.FSDP.state_dict_type(model, ns.StateDictType.FULL_STATE_DICT):
            osd = ns.FSDP.optim_state_dict(model, opt)
            to_load = ns.FSDP.optim_state_dict_to_load(model, opt, osd)
        loaded = {
            "shard_full": call(impl, "shard_full_optim_state_dict", full, model, optim=opt),
            "rekeyed": call(impl, "shard_full_optim_state_dict", named, model, optim=opt),
            "scatter": call(
                impl,
                "scatter_full_optim_state_dict",
                full if rank == 0 else None,
                model,
                optim=opt,
            ),
            "flatten": call(impl, "flatten_sharded_optim_state_dict", sharded, model, optim=opt),
            "to_load": to_load,
        }
        out[f"{impl}/same"] = {way: _same_as_local(d, local) for way, d in loaded.items()}
        opt.load_state_dict(loaded["flatten"])
        out[f"{impl}/after"] = train(model, opt, 1)
    return out


def test_a_plain_roots_optimizer_holds_flat_parameters_and_loads_its_own_state_as_fsdp1s() -> None:
    # A plain root holding units of flat parameters lists the flat parameters (plain 1-D
    # tensors, FSDP1's names), so an optimizer built from model.parameters() holds them; every
    # optimizer-state API gives back exactly what that optimizer holds (torch's own test).
    for out in run_on_ranks(2, _plain_root_body):
        assert out["shardkit/listed"] == out["torch/listed"]
        assert any(name.endswith("._flat_param") for name, _, _ in out["torch/listed"])
        assert out["torch/same"] == dict.fromkeys(out["torch/same"], True), out["torch/same"]
        assert out["shardkit/same"] == out["torch/same"]
        assert out["shardkit/names"] == out["torch/names"]
        assert out["shardkit/losses"] == out["torch/losses"]
        assert out["shardkit/after"] == out["torch/after"]
        ours, theirs = out["shardkit/full"], out["torch/full"]
        assert ours.keys() == theirs.keys()
        for key, state in theirs.items():
            assert ours[key].keys() == state.keys(), key
            for name, value in state.items():
                assert torch.equal(ours[key][name], value), (key, name)


def _frozen_body(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for impl in IMPLS:
        model = wrapped(impl, use_orig_params=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = train(model, opt, 1)
        model.requires_grad_(False)  # through the flat parameters, then one unit again
        model.stack[2].requires_grad_(True)
        losses += train(model, opt, 2)
        out[f"{impl}/losses"] = losses
        out[f"{impl}/trains"] = [(n, p.requires_grad) for n, p in model.named_parameters()]
        with quiet(), lib(impl).FSDP.summon_full_params(model):
            out[f"{impl}/params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def test_freezing_flat_parameters_freezes_their_units_as_fsdp1() -> None:
    for out in run_on_ranks(2, _frozen_body):
        assert out["shardkit/losses"] == out["torch/losses"]
        assert out["shardkit/trains"] == out["torch/trains"]
        assert out["shardkit/params"].keys() == out["torch/params"].keys()
        for name, value in out["torch/params"].items():
            assert torch.equal(out["shardkit/params"][name], value), name
