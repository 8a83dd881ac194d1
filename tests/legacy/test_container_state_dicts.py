"""State dicts of a model whose root is a plain container of FSDP1 wrappers, as FSDP1's.

``nn.Module.load_state_dict`` on the container walks into the wrappers; FSDP1's hooks make
that work for every state-dict type, and so must ours. torch's FSDP1 is the oracle: the
saved forms compare equal, a model loaded from them computes what the saved model computes,
and missing or unexpected keys are reported under the same names. With CPU offload and fp16
mixed precision too (offloading on shardkit's side only: FSDP1 cannot on CPU, and offloading
changes no value).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from harness.pool import run_on_ranks
from tests.legacy.legacy_parity import lib
from tests.legacy.optim_support import assert_same, comparable

KINDS = ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT")


class Container(nn.Module):
    """A plain root: two wrapped children (one with a wrapped child of its own), a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 5))
        self.b = nn.Linear(5, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(self.a(x)) * self.scale
        return out


def _build(impl: str, setting: str, seed: int) -> nn.Module:
    ns = lib(impl)
    torch.manual_seed(seed)
    model = Container()
    kwargs: dict[str, Any] = {"device_id": torch.device("cpu")}
    if setting == "fp16":
        kwargs["mixed_precision"] = ns.MixedPrecision(
            param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16
        )
    if setting == "offload" and impl == "shardkit":
        kwargs["cpu_offload"] = ns.CPUOffload(offload_params=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.a[2] = ns.FSDP(model.a[2], **kwargs)
        model.a = ns.FSDP(model.a, **kwargs)
        model.b = ns.FSDP(model.b, **kwargs)
    return model


def _save_and_load(impl: str, setting: str, kind: str) -> dict[str, Any]:
    ns = lib(impl)
    source = _build(impl, setting, seed=0)
    x = torch.randn(2, 4)
    source(x).sum().backward()  # lazy init, as a trained model has had
    target = _build(impl, setting, seed=1)
    out: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ns.FSDP.state_dict_type(source, getattr(ns.StateDictType, kind)):
            saved = source.state_dict()
        out["saved"] = comparable(saved)
        with ns.FSDP.state_dict_type(target, getattr(ns.StateDictType, kind)):
            out["result"] = str(target.load_state_dict(saved))
            out["after"] = bool(torch.equal(source(x), target(x)))
            # Strictness: a key the container lacks, and one too many, under FSDP1's names
            # (LOCAL: a unit's flat parameter missing is refused outright, by FSDP1 too).
            broken = {k: v for k, v in saved.items() if not k.startswith("b.")}
            broken["a.bogus"] = torch.zeros(1)
            with pytest.raises((RuntimeError, ValueError, AssertionError)) as caught:
                target.load_state_dict(broken)
            out["strict"] = sorted(
                line.strip() for line in str(caught.value).splitlines() if "key(s)" in line
            )
            out["strict_error"] = f"{type(caught.value).__name__}: {caught.value}"
    return out


def _body(rank: int, world_size: int, setting: str) -> dict[str, dict[str, Any]]:
    return {
        kind: {impl: _save_and_load(impl, setting, kind) for impl in ("shardkit", "torch")}
        for kind in KINDS
    }


@pytest.mark.parametrize("setting", ["plain", "offload", "fp16"])
def test_a_plain_root_of_wrappers_saves_and_loads_as_fsdp1s(setting: str) -> None:
    for rank, out in enumerate(run_on_ranks(2, _body, setting=setting)):
        for kind, both in out.items():
            ours, theirs = both["shardkit"], both["torch"]
            where = f"rank {rank} {setting} {kind}"
            assert_same(ours["saved"], theirs["saved"], where)
            # (target was built from another seed: equal outputs mean the load took effect)
            assert theirs["after"] and ours["after"], where
            assert ours["result"] == theirs["result"] == "<All keys matched successfully>"
            assert ours["strict"] == theirs["strict"], where
            if kind == "LOCAL_STATE_DICT":
                assert theirs["strict_error"].startswith("AssertionError: No `FlatParameter`")
                assert ours["strict_error"].startswith("ValueError: loading 'b': ")
                assert "_flat_param" in ours["strict_error"]
            else:
                assert theirs["strict"] == [
                    'Missing key(s) in state_dict: "b.weight", "b.bias".',
                    'Unexpected key(s) in state_dict: "a.bogus".',
                ]
