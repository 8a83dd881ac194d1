"""no_sync, clip_grad_norm_, summon_full_params and apply behave as FSDP1's."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from tests.core import models
from tests.core.torch_releases import INSTALLED
from tests.legacy.legacy_parity import LegacyRun, lib, rank_batch, wrap_model

ORIG = {"use_orig_params": True}  # FSDP1 summons gradients only with original parameters


def _grads(impl: str, model: nn.Module) -> dict[str, torch.Tensor]:
    with lib(impl).FSDP.summon_full_params(model, writeback=False, with_grads=True):
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _no_sync_and_clip_body(rank: int, world_size: int, strategy: str) -> dict[str, Any]:
    run = LegacyRun(model="gpt", strategy=strategy, extra=ORIG)
    out: dict[str, Any] = {}
    for impl in ("shardkit", "torch"):
        model = wrap_model(impl, run)
        # Two microbatches accumulated without reduction, then one synchronised.
        with model.no_sync():
            for step in range(2):
                x, y = rank_batch(run, step, rank, world_size)
                models.loss_of("gpt", model(x), y).backward()
        x, y = rank_batch(run, 2, rank, world_size)
        models.loss_of("gpt", model(x), y).backward()
        out[f"{impl}/accumulated"] = _grads(impl, model)
        out[f"{impl}/norm2"] = model.clip_grad_norm_(0.5).item()
        out[f"{impl}/clipped"] = _grads(impl, model)
        out[f"{impl}/norminf"] = model.clip_grad_norm_(0.01, norm_type=math.inf).item()
        out[f"{impl}/clipped_inf"] = _grads(impl, model)
        inner = lib(impl).FSDP.fsdp_modules(model)[1]
        with pytest.raises(RuntimeError) as no_sync, inner.no_sync():
            pass
        with pytest.raises(RuntimeError) as clip:
            inner.clip_grad_norm_(1.0)
        out[f"{impl}/no_sync_error"] = str(no_sync.value)
        out[f"{impl}/clip_error"] = str(clip.value)
    return out


@pytest.mark.parametrize(
    ("world_size", "strategy"), [(2, "FULL_SHARD"), (2, "NO_SHARD"), (4, "SHARD_GRAD_OP")]
)
def test_no_sync_accumulation_and_clipping_match_fsdp1(world_size: int, strategy: str) -> None:
    out = run_on_ranks(world_size, _no_sync_and_clip_body, strategy=strategy)[0]
    for what in ("accumulated", "clipped", "clipped_inf"):
        ours, theirs = out[f"shardkit/{what}"], out[f"torch/{what}"]
        assert ours.keys() == theirs.keys() and ours, what
        for name in ours:
            torch.testing.assert_close(ours[name], theirs[name], msg=f"{what} {name}")
    for what in ("norm2", "norminf"):
        assert out[f"shardkit/{what}"] == pytest.approx(out[f"torch/{what}"], rel=1e-6)
    assert out["shardkit/norm2"] > 0.5  # the clipping did clip
    for name in ("no_sync", "clip"):
        assert out[f"shardkit/{name}_error"] == out[f"torch/{name}_error"]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
def test_clip_arithmetic_is_fsdp1s_bit_for_bit(norm_type: float) -> None:
    # The batched (foreach) norms and scaling against torch FSDP1's own per-gradient code.
    from torch.distributed.fsdp.fully_sharded_data_parallel import _get_grad_norm

    from shardkit.legacy.grads import _norm, _scale

    torch.manual_seed(0)
    grads = [
        (torch.randn(33, 7) * 5).bfloat16(),
        torch.randn(1000),
        torch.randn(5).half(),
        torch.randn(8, 8).bfloat16(),
    ]
    if norm_type != math.inf:
        grads.append(torch.zeros(0))  # an empty shard (the inf norm of one is an error)
    if INSTALLED < (2, 11):
        # torch 2.10's FSDP1 refuses gradients of mixed dtypes (ours takes them, as 2.11's
        # does): there the arithmetic is compared on the bf16 gradients alone.
        grads = [g for g in grads if g.dtype == torch.bfloat16]
    params = [nn.Parameter(torch.empty_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    zero = torch.tensor(0.0)
    ours = _norm(grads, norm_type, zero)
    theirs = _get_grad_norm(params, norm_type, zero, zero.device)
    assert torch.equal(ours, theirs)
    coefficient = torch.clamp(0.5 / (ours + 1e-6), max=1.0)
    _scale(grads, coefficient)
    for p, g in zip(params, grads, strict=True):
        assert p.grad is not None
        p.grad.mul_(coefficient.to(p.grad.device, p.grad.dtype))  # FSDP1's loop
        assert torch.equal(g, p.grad)


def _summon_body(rank: int, world_size: int) -> dict[str, Any]:
    run = LegacyRun(extra=ORIG)
    out: dict[str, Any] = {}
    for impl in ("shardkit", "torch"):
        fsdp = lib(impl).FSDP
        model = wrap_model(impl, run)
        with fsdp.summon_full_params(model):
            names = [n for n, _ in model.named_parameters()]
            with torch.no_grad():
                model.module.head.weight.mul_(3)  # written back
        with fsdp.summon_full_params(model, writeback=False), torch.no_grad():
            model.module.inp.weight.zero_()  # discarded
        with fsdp.summon_full_params(model, rank0_only=True, writeback=False):
            out[f"{impl}/rank0_only"] = model.module.head.weight.numel()
        with fsdp.summon_full_params(model, recurse=False, writeback=False):
            block = model.module.blocks[0].module.fc1.weight
            # Outside a summon FSDP1 shows 1-D views of the shard, shardkit DTensors.
            out[f"{impl}/recurse_false"] = [
                p.dim() == 2 and not isinstance(p, DTensor)
                for p in (model.module.head.weight, block)
            ]
        with fsdp.summon_full_params(model, offload_to_cpu=True, rank0_only=True, writeback=False):
            out[f"{impl}/offload"] = model.module.head.weight.device.type

        def init(module: nn.Module) -> None:
            if isinstance(module, nn.LayerNorm):
                with torch.no_grad():
                    module.weight.fill_(2.0)

        # FSDP1's apply fails with use_orig_params=True (an in-place write to a split view).
        model = wrap_model(impl, LegacyRun())
        with fsdp.summon_full_params(model), torch.no_grad():
            model.module.head.weight.mul_(3)
        model.apply(init)  # full parameters inside, kept
        with fsdp.summon_full_params(model, writeback=False):
            out[f"{impl}/params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[f"{impl}/names"] = names
    out["sharded_after"] = all(
        isinstance(p, DTensor) for p in wrap_model("shardkit", run).parameters()
    )
    return out


def test_summon_full_params_and_apply_match_fsdp1() -> None:
    for rank, out in enumerate(run_on_ranks(2, _summon_body)):
        assert out["shardkit/names"] == out["torch/names"]
        assert "head.weight" in out["shardkit/names"]  # clean names inside
        ours, theirs = out["shardkit/params"], out["torch/params"]
        assert ours.keys() == theirs.keys()
        for name in ours:
            torch.testing.assert_close(ours[name], theirs[name], msg=f"{rank} {name}")
        for what in ("rank0_only", "recurse_false", "offload"):
            assert out[f"shardkit/{what}"] == out[f"torch/{what}"], (rank, what)
        assert out["sharded_after"]
