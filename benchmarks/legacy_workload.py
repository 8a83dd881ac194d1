"""The FSDP1 script's training step (demo/train_fsdp1.py), at a benchmark's size.

Shared by ``bench_legacy.py`` (step time, in the pool) and ``legacy_memory_run.py`` (peak RSS,
one torchrun launch per implementation).
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F
from demo.train_fsdp1 import Config, build, fsdp1, train_step
from demo.train_gpt import GPT, Block, ModelConfig
from torch import nn

from demo import fsdp1_mnist

MODEL = ModelConfig(vocab_size=256, seq_len=128, d_model=256, n_layers=8, n_heads=8)
"""About 6.4M parameters: 8 transformer blocks, each its own FSDP unit."""
BATCH = 8
"""Sequences per rank per step."""
MNIST_BATCH = 64
"""Images per rank per step in the "mnist" scenario (the tutorial's batch size)."""


def setup(
    impl: str, rank: int, scenario: str = "script"
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model and optimizer for ``impl`` ("shardkit" or "torch").

    Scenarios: "script", the FSDP1 script's own (FULL_SHARD, bf16); "no_shard", the same
    model in float32 with ``ShardingStrategy.NO_SHARD`` (DDP-like: what shardkit.legacy runs
    as a (W, 1) mesh); "mnist", FSDP1's MNIST tutorial (demo/fsdp1_mnist.py: a 1.2M-parameter
    CNN, size-based auto-wrap, Adadelta).
    """
    if scenario == "script":
        return build(Config(fsdp=impl, batch_size=BATCH, model=MODEL), rank)
    if scenario == "mnist":
        names = fsdp1_mnist.fsdp_names(impl)
        torch.manual_seed(0)
        policy = functools.partial(names.size_based_auto_wrap_policy, min_num_params=100)
        model = names.FSDP(
            fsdp1_mnist.Net(), auto_wrap_policy=policy, device_id=torch.device("cpu")
        )
        return model, torch.optim.Adadelta(model.parameters(), lr=1.0)
    api = fsdp1(impl)
    torch.manual_seed(0)
    model = api.FullyShardedDataParallel(
        GPT(MODEL),
        auto_wrap_policy=functools.partial(
            api.transformer_auto_wrap_policy, transformer_layer_cls={Block}
        ),
        sharding_strategy=api.ShardingStrategy.NO_SHARD,
        device_id=torch.device("cpu"),
    )
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def batch(
    step: int, rank: int, world_size: int, scenario: str = "script"
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's inputs and targets at ``step`` (random data: speed, not learning)."""
    gen = torch.Generator().manual_seed(step)
    if scenario == "mnist":
        images = torch.randn(MNIST_BATCH, 1, 28, 28, generator=gen)
        return images, torch.randint(0, 10, (MNIST_BATCH,), generator=gen)
    idx = torch.randint(0, MODEL.vocab_size, (BATCH * world_size, MODEL.seq_len + 1), generator=gen)
    mine = idx[rank * BATCH : (rank + 1) * BATCH]
    return mine[:, :-1], mine[:, 1:]


def timed_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: tuple[torch.Tensor, torch.Tensor],
    scenario: str = "script",
) -> float:
    """Seconds of one training step of the scenario's script (forward, backward, update)."""
    start = time.perf_counter()
    if scenario == "mnist":  # the tutorial's step
        opt.zero_grad()
        loss = F.nll_loss(model(data[0]), data[1], reduction="sum")
        loss.backward()
        opt.step()
        loss.item()
    else:
        train_step(model, opt, data).item()
    return time.perf_counter() - start
