"""A whole FSDP1 training job as a laptop runs it before the cluster does, bit for bit.

The GPT under ``transformer_auto_wrap_policy``, bf16 mixed precision reduced in fp32 with bf16
buffers, four microbatches a step under ``no_sync``, ``clip_grad_norm_``, AdamW with a
one-cycle schedule; a FULL checkpoint after three steps, two more steps, and a fresh job that
loads the checkpoint and trains the same two steps. In a world of one FSDP1 runs every unit as
``NO_SHARD`` (so does shardkit.legacy), where each of these is reproducible to the bit; and
``NO_SHARD`` at W=2. Flat and original parameters.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from typing import Any

import pytest
import torch

from harness.pool import run_on_ranks
from tests.core import models
from tests.legacy.legacy_parity import LegacyRun, global_loss, lib, rank_batch

MICROBATCHES = 4
CHECKPOINT_AFTER, STEPS = 3, 5
RUN = LegacyRun(model="gpt")


class _Job:
    def __init__(self, impl: str, strategy: str, orig: bool, seed: int) -> None:
        from shardkit.tools.plan.gpt import GPTBlock

        self.ns = ns = lib(impl)
        torch.manual_seed(seed)
        policy = functools.partial(
            ns.transformer_auto_wrap_policy, transformer_layer_cls={GPTBlock}
        )
        bf16 = torch.bfloat16
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model: Any = ns.FSDP(
                models.build("gpt"),
                auto_wrap_policy=policy,
                mixed_precision=ns.MixedPrecision(bf16, torch.float32, bf16),
                sharding_strategy=getattr(ns.ShardingStrategy, strategy),
                use_orig_params=orig,
                device_id=torch.device("cpu"),
            )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.1)
        self.schedule = torch.optim.lr_scheduler.OneCycleLR(self.opt, 3e-3, total_steps=STEPS)

    def train(self, steps: range, rank: int, world: int) -> tuple[list[float], list[float]]:
        losses, norms = [], []
        for step in steps:
            for micro in range(MICROBATCHES):
                last = micro == MICROBATCHES - 1
                with contextlib.nullcontext() if last else self.model.no_sync():
                    x, y = rank_batch(RUN, step * MICROBATCHES + micro, rank, world)
                    loss = models.loss_of("gpt", self.model(x), y) / MICROBATCHES
                    loss.backward()
                losses.append(global_loss(loss, world))
            norms.append(self.model.clip_grad_norm_(1.0).item())
            self.opt.step()
            self.schedule.step()
            self.opt.zero_grad()
        return losses, norms

    def checkpoint(self) -> dict[str, Any]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with self.ns.FSDP.state_dict_type(self.model, self.ns.StateDictType.FULL_STATE_DICT):
                model = self.model.state_dict()
                optim = self.ns.FSDP.optim_state_dict(self.model, self.opt)
        return copy.deepcopy(
            {"model": model, "optim": optim, "schedule": self.schedule.state_dict()}
        )

    def load(self, saved: dict[str, Any]) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with self.ns.FSDP.state_dict_type(self.model, self.ns.StateDictType.FULL_STATE_DICT):
                self.model.load_state_dict(saved["model"])
                osd = self.ns.FSDP.optim_state_dict_to_load(self.model, self.opt, saved["optim"])
        self.opt.load_state_dict(osd)
        self.schedule.load_state_dict(saved["schedule"])


def _run(impl: str, strategy: str, orig: bool, rank: int, world: int) -> dict[str, Any]:
    job = _Job(impl, strategy, orig, seed=0)
    losses, norms = job.train(range(CHECKPOINT_AFTER), rank, world)
    saved = job.checkpoint()
    after, after_norms = job.train(range(CHECKPOINT_AFTER, STEPS), rank, world)
    fresh = _Job(impl, strategy, orig, seed=1)  # other initial values, all overwritten
    fresh.load(saved)
    resumed, resumed_norms = fresh.train(range(CHECKPOINT_AFTER, STEPS), rank, world)
    return {
        "losses": losses + after,
        "norms": norms + after_norms,
        "resumed": resumed + resumed_norms,
        "continued": after + after_norms,
    }


def _body(rank: int, world_size: int, strategy: str) -> dict[str, Any]:
    return {
        f"{impl}/orig={orig}": _run(impl, strategy, orig, rank, world_size)
        for orig in (False, True)
        for impl in ("shardkit", "torch")
    }


@pytest.mark.parametrize(("world_size", "strategy"), [(1, "FULL_SHARD"), (2, "NO_SHARD")])
def test_a_laptop_job_trains_checkpoints_and_resumes_as_fsdp1s_bit_for_bit(
    world_size: int, strategy: str
) -> None:
    for rank, out in enumerate(run_on_ranks(world_size, _body, strategy=strategy)):
        for orig in (False, True):
            ours, theirs = out[f"shardkit/orig={orig}"], out[f"torch/orig={orig}"]
            where = f"rank {rank} use_orig_params={orig}"
            assert ours == theirs, where
            assert ours["resumed"] == ours["continued"], where  # the checkpoint is the job
