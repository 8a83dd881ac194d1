"""FSDP1's advanced T5 tutorial (demo/fsdp1_t5_tutorial.py) with its imports swapped is FSDP1's.

torch's FSDP1 runs the same script in the same worker (same seed, same made-up summaries,
dropout and activation checkpointing on): the train and validation loss of every epoch must
be equal bit for bit at W=2, as in the MNIST tutorial's test (two gradients summed once, so no
reduction order to differ in). Rank 0's FULL_STATE_DICT checkpoints of both must hold the
same keys in the same order and the same tensors, and each must load, strictly, into a plain
T5 that gives the validation loss the run printed for that epoch.

torch's FSDP1 cannot gather a full state dict with ``offload_to_cpu=True`` on a machine
without CUDA (it fails unflattening its parameters), so its run saves with
``offload_to_cpu=False``; shardkit's saves as the tutorial does, with offload.

Only the workers import the script, and so transformers (seconds of import, paid there once
with the other transformers tests); results come back as plain dicts and lists.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from harness.pool import run_on_ranks

if TYPE_CHECKING:
    from demo.fsdp1_t5_tutorial import Args

WORLD_SIZE = 2
# One optimizer step and one validation batch per rank and epoch: two epochs, two saves.
SIZES: dict[str, Any] = {"epochs": 2, "train_size": 8, "val_size": 8}
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}
# A plain T5 cast to bf16 is not bit for bit what FSDP1's bf16 policy computes (which casts
# inputs and parameters around each unit, not once): its loss may be one bf16 step away.
# In fp32 a plain T5's weights are separate tensors, the wrapped one's are views into flat
# parameters: a CPU's matmul kernels may pick another path for another alignment (seen on AMD
# EPYC: one fp32 step apart). Ours and FSDP1's losses and checkpoints are compared exactly.
TOLERANCE = {"fp32": 2**-20, "bf16": 2**-7}


def _both(rank: int, world_size: int, folder: str, **fields: Any) -> dict[str, Any]:
    from demo.fsdp1_t5_tutorial import Args, fsdp_main

    out: dict[str, Any] = {}
    for impl in ("shardkit", "torch"):
        # torch's FSDP1 cannot offload a full state dict on a CPU-only machine.
        args = Args(impl=impl, save_dir=f"{folder}/{impl}", offload_to_cpu=impl == "shardkit")
        args = dataclasses.replace(args, **fields)
        out[impl] = dataclasses.asdict(fsdp_main(args))
    out["plain"] = [_plain_validation_loss(path, args) for path in out["shardkit"]["saved"]]
    return out


def _plain_validation_loss(path: str, args: Args) -> float:
    """The tutorial's validation loss of a plain T5 loading ``path``, batched as the ranks do."""
    from demo.fsdp1_t5_tutorial import SyntheticSummaries, batch_loss, t5_config
    from transformers import T5ForConditionalGeneration

    model: torch.nn.Module = T5ForConditionalGeneration(t5_config())
    model.load_state_dict(torch.load(path), strict=True)
    # What a mixed-precision policy computes in (parameters, buffers and inputs cast alike).
    model.to(PRECISIONS[args.precision]).eval()
    val_set = SyntheticSummaries(args.val_size, args, t5_config().vocab_size, seed=args.seed + 1)
    totals = torch.zeros(2)  # summed in float32, as the script's all-reduced totals are
    with torch.no_grad():
        for rank in range(WORLD_SIZE):
            mine = range(rank, args.val_size, WORLD_SIZE)  # DistributedSampler, no shuffle
            for start in range(0, len(mine), args.test_batch_size):
                samples = [val_set[i] for i in mine[start : start + args.test_batch_size]]
                batch = {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
                totals += torch.tensor([batch_loss(model, batch).item(), 1.0])
    return (totals[0] / totals[1]).item()


@pytest.mark.parametrize(
    "fields",
    [
        {},  # the script's defaults: fp32, SHARD_GRAD_OP, activation checkpointing
        {"precision": "bf16", "sharding_strategy": "FULL_SHARD"},
    ],
    ids=["fp32-shard_grad_op", "bf16-full_shard"],
)
def test_the_t5_tutorial_gives_fsdp1s_losses_and_checkpoints(
    fields: dict[str, Any], tmp_path: Path
) -> None:
    results = run_on_ranks(WORLD_SIZE, _both, folder=str(tmp_path), **SIZES, **fields)
    for rank, out in enumerate(results):
        ours, theirs = out["shardkit"], out["torch"]
        assert ours["train_losses"] == theirs["train_losses"], rank
        assert ours["val_losses"] == theirs["val_losses"], rank
        assert len(theirs["val_losses"]) == SIZES["epochs"]
        if rank != 0:
            assert ours["saved"] == theirs["saved"] == [], "only rank 0 saves"
    ours, theirs = results[0]["shardkit"], results[0]["torch"]
    assert [Path(p).name for p in ours["saved"]] == [Path(p).name for p in theirs["saved"]]
    assert ours["saved"], "the first epoch's validation loss is a best, so it saves"
    tolerance = TOLERANCE[fields.get("precision", "fp32")]
    for mine, fsdp1, plain in zip(ours["saved"], theirs["saved"], results[0]["plain"], strict=True):
        saved, expected = torch.load(mine), torch.load(fsdp1)
        assert list(saved) == list(expected), mine
        for key, value in expected.items():
            assert saved[key].dtype == value.dtype == torch.float32, key
            assert saved[key].device.type == "cpu", key
            assert torch.equal(saved[key], value), key
        epoch = int(Path(mine).stem.rsplit("-", 1)[1])
        assert plain == pytest.approx(ours["val_losses"][epoch - 1], rel=tolerance), mine
