"""FSDP1's state-dict scenarios (torch's test_fsdp_state_dict.py), torch's FSDP1 the oracle.

Shared modules and parameters (and a GPT whose embedding is its head); saving and loading
with gradients present, fp16 models, use_orig_params, rank0_only, a root that is no unit;
BatchNorm buffers under per-unit mixed precision; checkpoints of mixed-precision training.
Each body runs every case with both implementations in the same workers (same seeds, same
data) and returns what each saved and what each model holds after loading; the tests
compare the two and check the scenario's own claim (shared entries equal, loaded equals
saved, fp32 checkpoints of fp16 training).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from harness.pool import run_on_ranks
from tests.legacy.ckpt_support import fresh, load_into, plain_sgd, state_dict_of, train_steps
from tests.legacy.fsdp1_scenario_models import (
    BUILDERS,
    fp16,
    nested,
    shared_dummy,
    with_batch_norm,
)
from tests.legacy.legacy_parity import LegacyRun, wrap_model
from tests.legacy.optim_support import comparable
from tests.legacy.state_dict_scenarios import (
    ALL_MATCHED,
    IMPLS,
    KINDS,
    assert_same_as_fsdp1,
    everywhere,
    params,
    rank0_config,
    zero,
)

# --- shared modules and parameters --------------------------------------------------------


def _shared(impl: str, units: bool, kind: str) -> dict[str, Any]:
    model = shared_dummy(impl, seed=0, units=units)
    model(torch.rand(8, 8)).sum().backward()
    saved = state_dict_of(impl, model, kind)
    out: dict[str, Any] = {"saved": comparable(saved), "keys": list(saved)}
    target = shared_dummy(impl, seed=1, units=units)
    out["result"] = str(load_into(impl, target, kind, saved))
    out["loaded"], out["expected"] = params(impl, target), params(impl, model)
    out["output"] = target(torch.ones(2, 8)).detach()
    return out


def _tied(impl: str, kind: str, orig: bool) -> dict[str, Any]:
    """The GPT with its embedding as its head, blocks auto-wrapped: trained, saved, loaded."""
    run = LegacyRun(model="gpt_tied", extra={"use_orig_params": orig})
    model = wrap_model(impl, run)
    train_steps(model, plain_sgd(model), run, range(1))
    saved = state_dict_of(impl, model, kind)
    target = fresh(impl, run)
    out = {"saved": comparable(saved), "result": str(load_into(impl, target, kind, saved))}
    out["loaded"], out["expected"] = params(impl, target), params(impl, model)
    return out


def _shared_body(rank: int, world_size: int) -> dict[str, Any]:
    out = {
        f"{impl}/{units}/{kind}": _shared(impl, units, kind)
        for impl in IMPLS
        for units in (False, True)
        for kind in KINDS
    }
    for impl in IMPLS:
        for kind in KINDS:
            for orig in (False, True) if kind != "LOCAL_STATE_DICT" else (False,):
                out[f"{impl}/tied/{kind}/{orig}"] = _tied(impl, kind, orig)
    return out


def test_shared_modules_and_parameters_save_and_load_as_fsdp1s() -> None:
    # net3 is net2 (a unit itself with units=True); shared_parameter is random_parameter.
    results = run_on_ranks(2, _shared_body)
    assert_same_as_fsdp1(results)
    for out in results:
        for kind in KINDS:
            for orig in (False, True) if kind != "LOCAL_STATE_DICT" else (False,):
                got = out[f"shardkit/tied/{kind}/{orig}"]
                assert got["result"] == ALL_MATCHED, (kind, orig)
                torch.testing.assert_close(got["loaded"], got["expected"])
        tied = out["shardkit/tied/FULL_STATE_DICT/False"]["saved"]
        assert torch.equal(tied["tok.weight"], tied["head.weight"])
        for units in (False, True):
            for kind in KINDS:
                got = out[f"shardkit/{units}/{kind}"]
                assert got["result"] == ALL_MATCHED, (units, kind)
                torch.testing.assert_close(got["loaded"], got["expected"])
            full = out[f"shardkit/{units}/FULL_STATE_DICT"]["saved"]
            assert torch.equal(full["random_parameter"], full["shared_parameter"])
            for name in ("0.weight", "0.bias"):
                assert torch.equal(full[f"net2.{name}"], full[f"net3.{name}"]), name
        local_keys = out["shardkit/True/LOCAL_STATE_DICT"]["keys"]
        assert local_keys == ["_flat_param", "net1._flat_param", "net2._flat_param",
                              "net3._flat_param"]  # fmt: skip


# --- save and load, with gradients present ------------------------------------------------


def _basic(impl: str, name: str, kind: str, orig: bool, half: bool, rank0: bool) -> Any:
    generator = torch.Generator().manual_seed(3)
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = BUILDERS[name](impl, use_orig_params=orig)
        if half:
            model.half()
        x = torch.randn(3, 10, generator=generator)
        model(x.half() if half else x).sum().backward()  # gradients present when saving
        models.append(model)
    source, target = models
    saved = state_dict_of(impl, source, kind, rank0_config(impl, rank0))
    out = {"saved": comparable(saved), "dtypes": sorted({str(v.dtype) for v in saved.values()})}
    zero(impl, target)
    out["result"] = str(load_into(impl, target, kind, everywhere(saved) if rank0 else saved))
    out["loaded"], out["expected"] = params(impl, target), params(impl, source)
    out["param_dtypes"] = sorted({str(p.dtype) for p in target.parameters()})
    return out


def _basic_cases() -> list[tuple[str, str, bool, bool, bool]]:
    """(model, kind, use_orig_params, half, rank0_only): FSDP1's grid, pruned for time.

    fp16 models with flat parameters only, rank0_only with neither (each is independent of
    the others in both implementations' code); the one-unit model plainly.
    """
    cases = []
    for name in BUILDERS:
        for kind in KINDS:
            cases.append((name, kind, False, False, False))
            if name == "simple":  # one unit: its own case is the nested model's inner one
                continue
            cases.append((name, kind, False, True, False))
            if kind != "LOCAL_STATE_DICT":  # FSDP1: LOCAL needs flat parameters
                cases.append((name, kind, True, False, False))
            if kind == "FULL_STATE_DICT":
                cases.append((name, kind, False, False, True))
    return cases


def _basic_body(rank: int, world_size: int) -> dict[str, Any]:
    return {f"{impl}/{case}": _basic(impl, *case) for impl in IMPLS for case in _basic_cases()}


def test_save_and_load_with_gradients_fp16_and_a_plain_root_as_fsdp1s() -> None:
    results = run_on_ranks(2, _basic_body)
    assert_same_as_fsdp1(results)
    for rank, out in enumerate(results):
        for case in _basic_cases():
            got, half, rank0 = out[f"shardkit/{case}"], case[3], case[4]
            assert got["result"] == ALL_MATCHED, case
            torch.testing.assert_close(got["loaded"], got["expected"], msg=str(case))
            assert got["param_dtypes"] == (["torch.float16"] if half else ["torch.float32"])
            if rank0 and rank == 1 and case[0] != "plain_root":
                assert got["saved"] == {}, case


# --- buffers under per-unit mixed precision; checkpoints of mixed-precision training ------


def _buffers(impl: str, kind: str, orig: bool, mixed: bool, rank0: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    source = with_batch_norm(impl, mixed, use_orig_params=orig)
    with torch.no_grad():  # running statistics other than their initial values
        for buffer in source.buffers():
            buffer.add_(
                torch.rand(buffer.shape).to(buffer.dtype) if buffer.is_floating_point() else 3
            )
    saved = state_dict_of(impl, source, kind, rank0_config(impl, rank0))
    out = {"saved": comparable(saved)}
    torch.manual_seed(1)
    target = with_batch_norm(impl, mixed, use_orig_params=orig)
    zero(impl, target)
    out["result"] = str(load_into(impl, target, kind, everywhere(saved) if rank0 else saved))
    out["loaded"], out["expected"] = params(impl, target), params(impl, source)
    out["buffers"] = [b.clone() for b in target.buffers()]
    out["source_buffers"] = [b.clone() for b in source.buffers()]
    return out


def _trained(impl: str, kind: str, mixed: bool, rank0: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nested(impl, mixed_precision=fp16(impl) if mixed else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(2)
    loss_dtypes = set()
    for _ in range(6):
        loss = model(torch.randn(10, generator=generator)).sum()
        loss_dtypes.add(str(loss.dtype))
        loss.backward()
        opt.step()
    trained = params(impl, model)
    saved = copy.deepcopy(state_dict_of(impl, model, kind, rank0_config(impl, rank0)))
    out = {"saved": comparable(saved), "loss_dtypes": sorted(loss_dtypes)}
    out["dtypes"] = sorted({str(v.dtype) for v in saved.values()})
    zero(impl, model)
    out["result"] = str(load_into(impl, model, kind, everywhere(saved) if rank0 else saved))
    out["loaded"], out["trained"] = params(impl, model), trained
    return out


def _precision_body(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for impl in IMPLS:
        for kind in KINDS:
            # (use_orig_params, mixed, rank0_only): each switch once beside mixed precision
            cases = [(False, False, False), (False, True, False)]
            if kind != "LOCAL_STATE_DICT":  # FSDP1: LOCAL needs flat parameters
                cases.append((True, True, False))
            if kind == "FULL_STATE_DICT":
                cases.append((False, True, True))
            for orig, mixed, rank0 in cases:
                case = (kind, orig, mixed, rank0)
                out[f"{impl}/buffers/{case}"] = _buffers(impl, *case)
                if not orig:
                    out[f"{impl}/trained/{kind}/{mixed}/{rank0}"] = _trained(
                        impl, kind, mixed, rank0
                    )
    return out


def test_buffers_and_mixed_precision_checkpoints_as_fsdp1s() -> None:
    results = run_on_ranks(2, _precision_body)
    assert_same_as_fsdp1(results)
    for out in results:
        for key, got in out.items():
            if not key.startswith("shardkit/"):
                continue
            assert got["result"] == ALL_MATCHED, key
            if "/buffers/" in key:
                torch.testing.assert_close(got["loaded"], got["expected"], msg=key)
                torch.testing.assert_close(got["buffers"], got["source_buffers"], msg=key)
            else:  # fp16 training, fp32 checkpoints, loaded back exactly
                mixed = "/True/" in key
                assert got["loss_dtypes"] == ["torch.float16" if mixed else "torch.float32"]
                assert got["dtypes"] in ([], ["torch.float32"]), key
                torch.testing.assert_close(got["loaded"], got["trained"], msg=key)
