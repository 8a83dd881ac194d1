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
from tests.legacy.nested_optim_support import Nested, setup, train, wrapped
from tests.legacy.optim_support import call

IMPLS = ("shardkit", "torch")
FLAT_SCALAR_ERROR = (
    "All unflattened parameters comprising a single flat parameter must have scalar state "
    "with the same value and dtype"
)


# --- a parameter the saved state does not know, inside a unit of flat parameters ---------------


def _extra_in(impl: str, holder: str) -> nn.Module:
    """The nested model with one more parameter on ``holder``, wrapped with flat parameters."""
    model = Nested()
    model.get_submodule(holder).register_parameter("extra", nn.Parameter(torch.randn(5, 5)))
    return wrapped(impl, model, use_orig_params=False)  # type: ignore[no-any-return]


def _unknown_in_unit_body(rank: int, world_size: int, holder: str) -> dict[str, Any]:
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
            model = _extra_in(impl, holder)
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
            try:
                ready = call(impl, api, saved[form], model, optim=opt)
                out[f"{impl}/{way}"] = sorted(ready["state"])
            except ValueError as error:  # the outcome, compared with FSDP1's
                out[f"{impl}/{way}"] = ("ValueError", str(error)[: len(FLAT_SCALAR_ERROR)])
    return out


@pytest.mark.parametrize("holder", ["stack.2", ""])
def test_a_unit_parameter_the_saved_state_lacks_is_refused_as_fsdp1_with_flat_params(
    holder: str,
) -> None:
    # In a unit ("stack.2"): the unit's one flat parameter would get one `step` for some of
    # its parameters only, and FSDP1 raises ValueError. On the root, which no unit holds
    # (model parallelism), it is left out for the caller to add, on both.
    for out in run_on_ranks(2, _unknown_in_unit_body, holder=holder):
        for way in ("shard_full", "flatten"):
            ours, theirs = out[f"shardkit/{way}"], out[f"torch/{way}"]
            if holder:
                assert theirs == ("ValueError", FLAT_SCALAR_ERROR), (way, theirs)
                assert ours == theirs, way
            else:
                # Positions differ: FSDP1's optimizer holds flat parameters, ours (under a
                # plain root) the sharded ones (README, "What differs").
                assert isinstance(theirs, list) and isinstance(ours, list), (way, ours, theirs)


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
