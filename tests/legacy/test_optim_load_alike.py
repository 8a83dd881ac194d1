"""Optimizer state that is bad on one rank only is refused by every rank, with one error.

FSDP1's loading APIs read a dict per rank (or rank 0's, sent to the others). A dict that is
bad on one rank must not leave the other ranks converting alone, waiting in a collective
the failed rank never enters: every rank raises the first failed rank's error, nothing is
loaded, and a good dict loads afterwards and training goes on. (FSDP1 has no oracle here:
it leaves the other ranks waiting.)
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from harness.pool import run_on_ranks
from tests.legacy.ckpt_support import train_steps
from tests.legacy.legacy_parity import LegacyRun, wrap_model
from tests.legacy.optim_support import adamw, call, with_type

SHARD, SCATTER = "shard_full_optim_state_dict", "scatter_full_optim_state_dict"
ORIG = LegacyRun(model="gpt", extra={"use_orig_params": True})


def _refused(api: str, *args: Any, **kwargs: Any) -> str:
    """What ``FSDP.<api>(...)`` raised on this rank, as ``"Type: message"``."""
    try:
        call("shardkit", api, *args, **kwargs)
    except (KeyError, ValueError, TypeError, RuntimeError) as error:
        words = error.args[0] if isinstance(error, KeyError) else str(error)
        return f"{type(error).__name__}: {words}"
    return "loaded"


def _trained(run: LegacyRun) -> tuple[Any, torch.optim.Optimizer]:
    model = wrap_model("shardkit", run)
    opt = adamw(model)
    train_steps(model, opt, run, range(2))
    return model, opt


def _body(rank: int, world_size: int) -> dict[str, str]:
    out: dict[str, str] = {}
    last = rank == world_size - 1
    for run in (LegacyRun(model="gpt"), ORIG):
        kind = "orig" if run is ORIG else "flat"
        model, opt = _trained(run)
        full = call("shardkit", "full_optim_state_dict", model, opt, rank0_only=False)

        first = rank == 0
        out[f"{kind} scatter nothing"] = _refused(SCATTER, None, model, optim=opt)
        out[f"{kind} scatter a list"] = _refused(
            SCATTER, [1, 2] if first else None, model, optim=opt
        )
        named = copy.deepcopy(full)
        if last:
            named["param_groups"][0]["params"].append("no.such.weight")
        out[f"{kind} unknown name"] = _refused(SHARD, named, model, optim=opt)
        broken = copy.deepcopy(full)
        if last:
            broken["state"][sorted(broken["state"])[0]] = [1.0]
        out[f"{kind} entry not a mapping"] = _refused(SHARD, broken, model, optim=opt)
        steps = copy.deepcopy(full)
        if last:  # one flat parameter's originals disagree on `step` (FSDP1 refuses it)
            name = sorted(n for n in steps["state"] if n.startswith("blocks.0."))[0]
            steps["state"][name]["step"] = steps["state"][name]["step"] + 1
        out[f"{kind} steps differ"] = _refused(SHARD, steps, model, optim=opt)
        if run is ORIG:
            out["orig layout differs"] = _refused(
                SHARD, _laid_out_otherwise(model, full, last), model, optim=opt
            )
            sharded = call("shardkit", "sharded_optim_state_dict", model, opt)
            bad = copy.deepcopy(sharded)
            if last:
                bad.pop("state")
            with with_type("shardkit", model, "SHARDED_STATE_DICT"):
                out["orig sharded without state"] = _refused(
                    "optim_state_dict_to_load", model, opt, bad
                )
        # Nothing was left half-done: a good dict loads and every rank trains on.
        before = {k: copy.deepcopy(v) for k, v in opt.state_dict()["state"].items()}
        opt.load_state_dict(
            call(
                "shardkit",
                "scatter_full_optim_state_dict",
                full if first else None,
                model,
                optim=opt,
            )
        )
        after = opt.state_dict()["state"]
        out[f"{kind} reloads"] = str(
            all(
                torch.equal(_local(before[k][s]), _local(after[k][s]))
                for k in before
                for s in before[k]
            )
        )
        train_steps(model, opt, run, range(2, 3))
        dist.barrier()
        out[f"{kind} trains on"] = "yes"
    return out


def _local(value: Any) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else torch.as_tensor(value)


def _laid_out_otherwise(model: Any, full: dict[str, Any], mine: bool) -> dict[str, Any]:
    """``full`` with one 2-D state, on this rank if ``mine``, a DTensor sharded on dim 1.

    Made without communication: loading it needs a gather the other ranks would not run.
    """
    osd = copy.deepcopy(full)
    if not mine:
        return osd
    params = {n.replace("_fsdp_wrapped_module.", ""): p for n, p in model.named_parameters()}
    name = next(n for n in sorted(osd["state"]) if params[n].dim() == 2)
    param = params[name]
    assert isinstance(param, DTensor)
    value = osd["state"][name]["exp_avg"]
    osd["state"][name]["exp_avg"] = distribute_tensor(
        value, param.device_mesh, [Shard(1)], src_data_rank=None
    )
    return osd


def test_optimizer_state_bad_on_one_rank_is_refused_alike_and_nothing_is_loaded() -> None:
    results = run_on_ranks(2, _body, timeout_s=180)
    expected = {
        "scatter nothing": "ValueError: the first rank's full optimizer state dict: it is None",
        "scatter a list": "ValueError: the first rank's full optimizer state dict: a list",
        "unknown name": "KeyError: rank 1: optimizer state for 'no.such.weight'",
        "entry not a mapping": "TypeError: rank 1: optimizer state for",
        "steps differ": "ValueError: rank 1: All unflattened parameters comprising",
    }
    for case, start in expected.items():
        for kind in ("flat", "orig"):
            if kind == "orig" and case == "steps differ":
                continue  # per-parameter: each has its own step
            said = {out[f"{kind} {case}"] for out in results}
            assert len(said) == 1, (kind, case, said)  # every rank: the same error
            assert said.pop().startswith(start), (kind, case, results[0][f"{kind} {case}"])
    said = {out["orig layout differs"] for out in results}
    assert len(said) == 1 and said.pop().startswith("ValueError: the optimizer state dicts"), said
    said = {out["orig sharded without state"] for out in results}
    assert len(said) == 1 and said.pop().startswith("TypeError: rank 1: an optimizer state"), said
    for out in results:
        assert out["flat reloads"] == out["orig reloads"] == "True"
        assert out["flat trains on"] == out["orig trains on"] == "yes"
