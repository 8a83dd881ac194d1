"""The demo's contract for exact resumption, checked in one process with no process group.

`make demo` checks the whole story on 2 ranks (about 40 s); these check its pieces in about a
second: batches are a function of the step alone and tile across ranks, the learning rate does
not depend on where a run stops, the model is causal, and the checkpoint pointer is read right.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from demo.run_demo import require_impl
from demo.train_gpt import (
    FULLY_SHARD,
    GPT,
    BatchSampler,
    ModelConfig,
    TrainConfig,
    lr_at,
    parse_args,
)

from tests.demo.rig import KillPoint

DATA = (torch.arange(5_000) % 251).to(torch.uint8)  # (N,) no period that divides seq_len


def sampler(rank: int, world: int, batch_per_rank: int, seed: int = 0) -> BatchSampler:
    return BatchSampler(
        data=DATA, seq_len=16, batch_per_rank=batch_per_rank, rank=rank, world=world, seed=seed
    )


def test_rank_rows_tile_the_global_batch() -> None:
    inputs, targets = sampler(rank=0, world=1, batch_per_rank=8).batch(step=7)
    parts = [sampler(rank=r, world=2, batch_per_rank=4).batch(step=7) for r in range(2)]
    assert torch.equal(torch.cat([x for x, _ in parts]), inputs)
    assert torch.equal(torch.cat([y for _, y in parts]), targets)


def test_batch_is_a_function_of_seed_and_step() -> None:
    a, b = sampler(0, 2, 4), sampler(0, 2, 4)
    assert torch.equal(a.batch(12)[0], b.batch(12)[0])
    assert not torch.equal(a.batch(12)[0], a.batch(13)[0])
    assert not torch.equal(a.batch(12)[0], sampler(0, 2, 4, seed=1).batch(12)[0])


def test_targets_are_the_next_bytes() -> None:
    inputs, targets = sampler(1, 2, 4).batch(3)
    assert inputs.shape == targets.shape == (4, 16)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_lr_does_not_depend_on_where_the_run_stops() -> None:
    short, long = TrainConfig(steps=30), TrainConfig(steps=45)
    assert [lr_at(s, short) for s in range(1, 31)] == [lr_at(s, long) for s in range(1, 31)]
    assert lr_at(short.warmup_steps, short) == short.lr


def test_model_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT(ModelConfig(seq_len=16, d_model=32, n_layers=2, n_heads=2))
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    logits, logits_changed = model(idx), model(changed)
    assert logits.shape == (2, 16, 256)
    assert torch.equal(logits[:, :10], logits_changed[:, :10])
    assert not torch.equal(logits[:, 10:], logits_changed[:, 10:])


def test_model_config_rejects_heads_that_do_not_divide_the_width() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        ModelConfig(d_model=30, n_heads=4)


def test_resume_needs_a_checkpoint_dir() -> None:
    with pytest.raises(ValueError, match="--ckpt-dir"):
        TrainConfig(resume=True)


def test_replicas_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="--replicas"):
        TrainConfig(replicas=-1)


def test_torch_impl_resolves() -> None:
    from torch.distributed.fsdp import fully_shard

    assert FULLY_SHARD["torch"] is fully_shard


def test_shardkit_impl_resolves() -> None:
    import shardkit.core

    assert FULLY_SHARD["shardkit"] is shardkit.core.fully_shard


def test_without_shardkit_the_demo_says_how_to_run_on_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # None in sys.modules makes the import raise ImportError, as on a machine without the core.
    monkeypatch.setitem(sys.modules, "shardkit.core", None)
    with pytest.raises(SystemExit, match="--impl torch"):
        require_impl("shardkit")


def test_snapshots_replicated_every_n_steps_from_the_command_line() -> None:
    from demo.train_gpt import memory_snapshots

    _, cfg = parse_args(["--ckpt-dir=x", "--snapshot-every=1", "--snapshot-replicate-every=4"])
    snapshots = memory_snapshots(cfg)
    assert snapshots is not None and (snapshots.every, snapshots.replicate_every) == (1, 4)
    _, cfg = parse_args(["--ckpt-dir=x", "--snapshot-every=2"])
    snapshots = memory_snapshots(cfg)
    assert snapshots is not None and snapshots.replicate_every == 2  # each one, by default
    with pytest.raises(ValueError, match="--snapshot-replicate-every needs --snapshot-every"):
        parse_args(["--ckpt-dir=x", "--snapshot-replicate-every=4"])


def test_the_gradient_log_from_the_command_line() -> None:
    from demo.train_gpt import memory_snapshots

    args = ["--ckpt-dir=x", "--snapshot-every=1", "--snapshot-replicate-every=4"]
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    _, cfg = parse_args([*args, "--snapshot-log"])
    snapshots = memory_snapshots(cfg, optimizer)
    assert snapshots is not None and snapshots._log is not None
    assert snapshots._log.optimizer is optimizer
    snapshots.close()
    _, cfg = parse_args(args)
    snapshots = memory_snapshots(cfg, optimizer)
    assert snapshots is not None and snapshots._log is None  # not asked for
    with pytest.raises(ValueError, match="--snapshot-log needs --snapshot-every=1"):
        parse_args(["--ckpt-dir=x", "--snapshot-every=1", "--snapshot-log"])


def test_command_line_fills_both_configs() -> None:
    model_cfg, cfg = parse_args(
        ["--steps=7", "--d-model=64", "--n-layers=2", "--ckpt-dir=x", "--auto-resume", "--tp=2"]
    )
    assert (model_cfg.d_model, model_cfg.n_layers, model_cfg.seq_len) == (64, 2, 128)
    assert (cfg.steps, cfg.ckpt_dir, cfg.auto_resume, cfg.tp, cfg.resume) == (
        7,
        Path("x"),
        True,
        2,
        False,
    )


def test_rig_kill_points_parse_and_print_back() -> None:
    point = KillPoint.parse("1:15:async-save")
    assert (point.rank, point.step, point.phase) == (1, 15, "async-save")
    assert str(point) == "1:15:async-save"
    with pytest.raises(ValueError, match="RANK:STEP:PHASE"):
        KillPoint.parse("1:15:optimizer")
