"""FSDP1's advanced tutorial (T5, FULL_STATE_DICT on rank 0), in its shape, on CPU and made-up text.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 demo/fsdp1_t5_tutorial.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 demo/fsdp1_t5_tutorial.py \
        --fsdp torch

The tutorial fine-tunes Hugging Face's T5 on WikiHow summaries with FSDP1: T5Block as the
transformer wrapping unit, a mixed-precision policy, a sharding strategy, backward prefetch,
``device_id``, AdamW with a per-epoch StepLR, a train and a validation pass every epoch, and,
when the validation loss improves, a FULL_STATE_DICT gathered to rank 0's CPU
(``FullStateDictConfig(offload_to_cpu=True, rank0_only=True)``) and ``torch.save``d there. Its
example code also checkpoints activations of every T5Block (``apply_activation_checkpointing``
with a non-reentrant ``checkpoint_wrapper``). This script does all of that, with these changes
only: T5 is built from a small ``T5Config`` (nothing is downloaded), the data are synthetic
text-to-text pairs with WikiHow's fields (source and target ids and masks, padded to fixed
lengths), and the process group is gloo on CPU where the tutorial says NCCL and CUDA.

The FSDP1 names come from two imports, ``fsdp_names(impl)``: the package and its ``wrap``
module, from torch or from shardkit.legacy with the module paths changed and nothing else. The
activation-checkpoint wrapper is torch's in both runs (it is not an FSDP1 import).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import T5Config, T5ForConditionalGeneration
from transformers.models.t5.modeling_t5 import T5Block

PACKAGES = {"torch": "torch.distributed.fsdp", "shardkit": "shardkit.legacy"}
PAD, EOS = 0, 1  # T5's pad and end-of-sequence ids; the decoder starts from the pad id


def fsdp_names(impl: str) -> SimpleNamespace:
    """The tutorial's two FSDP1 imports, from ``impl``'s package path."""
    package = importlib.import_module(PACKAGES[impl])
    wrap = importlib.import_module(f"{PACKAGES[impl]}.wrap")
    return SimpleNamespace(
        FSDP=package.FullyShardedDataParallel,
        MixedPrecision=package.MixedPrecision,
        BackwardPrefetch=package.BackwardPrefetch,
        ShardingStrategy=package.ShardingStrategy,
        FullStateDictConfig=package.FullStateDictConfig,
        StateDictType=package.StateDictType,
        transformer_auto_wrap_policy=wrap.transformer_auto_wrap_policy,
    )


@dataclass(kw_only=True)
class Args:
    """The tutorial's settings that matter here, and the sizes of the small model and data."""

    impl: str = "shardkit"
    precision: str = "fp32"
    """"fp32" (no policy: the tutorial's choice without bf16-capable CUDA), "bf16" or "fp16"."""
    sharding_strategy: str = "SHARD_GRAD_OP"
    activation_checkpointing: bool = True
    offload_to_cpu: bool = True
    """FullStateDictConfig's; torch's FSDP1 cannot offload on a CPU-only machine."""
    epochs: int = 2
    batch_size: int = 4
    test_batch_size: int = 4
    lr: float = 0.002
    gamma: float = 0.7
    seed: int = 1
    train_size: int = 32
    val_size: int = 16
    input_length: int = 32
    output_length: int = 8
    save_dir: str | None = None
    """Where rank 0 saves the FULL_STATE_DICT checkpoints; None saves nothing."""


@dataclass(kw_only=True)
class Outcome:
    """Every epoch's global train and validation loss, and the checkpoints rank 0 saved."""

    train_losses: list[float] = field(default_factory=list)
    val_losses: list[float] = field(default_factory=list)
    saved: list[str] = field(default_factory=list)


def t5_config(vocab_size: int = 64) -> T5Config:
    """A T5 small enough for CPU tests: 2 encoder and 2 decoder blocks of width 32."""
    config = T5Config(
        vocab_size=vocab_size,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        pad_token_id=PAD,
        eos_token_id=EOS,
        # The decoder's key/value cache grows during the forward, so a checkpointed block's
        # recomputation would save other tensors than its forward did (torch's checkpoint
        # raises); training has no use for the cache.
        use_cache=False,
    )
    config.decoder_start_token_id = PAD  # as t5-small's own config.json sets it
    return config


class SyntheticSummaries(Dataset[dict[str, torch.Tensor]]):
    """Made-up (text, summary) pairs shaped as the tutorial's WikiHow samples.

    A source is a run of random tokens of random length ended by EOS and padded; its summary
    is every fourth token of it, ended and padded likewise, so there is something to learn.
    """

    def __init__(self, size: int, args: Args, vocab_size: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.samples = [self._pair(gen, args, vocab_size) for _ in range(size)]

    @staticmethod
    def _pair(gen: torch.Generator, args: Args, vocab_size: int) -> dict[str, torch.Tensor]:
        length = int(torch.randint(args.input_length // 2, args.input_length, (1,), generator=gen))
        words = torch.randint(EOS + 1, vocab_size, (length - 1,), generator=gen)
        summary = words[::4][: args.output_length - 1]
        source = _padded(words, args.input_length)
        target = _padded(summary, args.output_length)
        return {
            "source_ids": source,
            "source_mask": (source != PAD).long(),
            "target_ids": target,
            "target_mask": (target != PAD).long(),
        }

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.samples[index]


def _padded(tokens: torch.Tensor, length: int) -> torch.Tensor:
    out = torch.full((length,), PAD, dtype=torch.long)
    out[: len(tokens)] = tokens
    out[len(tokens)] = EOS
    return out


def _mixed_precision(names: SimpleNamespace, precision: str) -> Any:
    if precision == "fp32":
        return None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return names.MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)


def _wrap(args: Args, names: SimpleNamespace) -> nn.Module:
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = T5ForConditionalGeneration(t5_config())
    policy = functools.partial(names.transformer_auto_wrap_policy, transformer_layer_cls={T5Block})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP1's own deprecation warnings
        wrapped: nn.Module = names.FSDP(
            model,
            auto_wrap_policy=policy,
            mixed_precision=_mixed_precision(names, args.precision),
            sharding_strategy=names.ShardingStrategy[args.sharding_strategy],
            backward_prefetch=names.BackwardPrefetch.BACKWARD_PRE,
            device_id=torch.device("cpu"),
        )
    if args.activation_checkpointing:
        non_reentrant = functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
        )
        apply_activation_checkpointing(
            wrapped,
            checkpoint_wrapper_fn=non_reentrant,
            check_fn=lambda module: isinstance(module, T5Block),
        )
    return wrapped


def batch_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tutorial's call: source ids and mask in, the target ids as labels."""
    out = model(
        input_ids=batch["source_ids"],
        attention_mask=batch["source_mask"],
        labels=batch["target_ids"],
    )
    loss: torch.Tensor = out["loss"]
    return loss


def train(model: nn.Module, loader: DataLoader[Any], optimizer: torch.optim.Optimizer) -> float:
    """One epoch; the mean of every rank's batch losses."""
    model.train()
    totals = torch.zeros(2)  # (sum of batch losses, batches)
    for batch in loader:
        optimizer.zero_grad()
        loss = batch_loss(model, batch)
        loss.backward()
        optimizer.step()
        totals += torch.tensor([loss.item(), 1.0])
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def validation(model: nn.Module, loader: DataLoader[Any]) -> float:
    """The mean of every rank's validation batch losses."""
    model.eval()
    totals = torch.zeros(2)
    with torch.no_grad():
        for batch in loader:
            totals += torch.tensor([batch_loss(model, batch).item(), 1.0])
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def save_full_checkpoint(
    model: nn.Module, names: SimpleNamespace, args: Args, epoch: int
) -> str | None:
    """FSDP1's FULL_STATE_DICT gathered to rank 0 and saved there; its path on rank 0."""
    policy = names.FullStateDictConfig(offload_to_cpu=args.offload_to_cpu, rank0_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP1's deprecation of state_dict_type
        with names.FSDP.state_dict_type(model, names.StateDictType.FULL_STATE_DICT, policy):
            cpu_state = model.state_dict()
    if dist.get_rank() != 0 or args.save_dir is None:
        return None
    path = Path(args.save_dir) / f"T5-model-{epoch}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(cpu_state, path)
    return str(path)


def fsdp_main(args: Args) -> Outcome:
    """Train, validate and checkpoint as the tutorial does."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    names = fsdp_names(args.impl)
    vocab_size = t5_config().vocab_size
    train_set = SyntheticSummaries(args.train_size, args, vocab_size, seed=args.seed)
    val_set = SyntheticSummaries(args.val_size, args, vocab_size, seed=args.seed + 1)
    train_sampler: DistributedSampler[Any] = DistributedSampler(
        train_set, rank=rank, num_replicas=world_size, shuffle=True
    )
    val_sampler: DistributedSampler[Any] = DistributedSampler(
        val_set, rank=rank, num_replicas=world_size
    )
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    val_loader = DataLoader(val_set, batch_size=args.test_batch_size, sampler=val_sampler)
    model = _wrap(args, names)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    outcome = Outcome()
    best_val_loss = float("inf")
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        outcome.train_losses.append(train(model, train_loader, optimizer))
        val_loss = validation(model, val_loader)
        outcome.val_losses.append(val_loss)
        scheduler.step()
        if val_loss < best_val_loss:  # every rank sees the same all-reduced loss
            best_val_loss = val_loss
            saved = save_full_checkpoint(model, names, args, epoch)
            if saved is not None:
                outcome.saved.append(saved)
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--fsdp", choices=sorted(PACKAGES), default="shardkit")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save-dir", default="demo/runs/t5-tutorial")
    cli = parser.parse_args()
    dist.init_process_group("gloo")
    args = Args(
        impl=cli.fsdp,
        precision=cli.precision,
        epochs=cli.epochs,
        save_dir=cli.save_dir,
        # torch's FSDP1 cannot offload a full state dict to CPU on a machine without CUDA.
        offload_to_cpu=cli.fsdp == "shardkit",
    )
    outcome = fsdp_main(args)
    if dist.get_rank() == 0:
        losses = zip(outcome.train_losses, outcome.val_losses, strict=True)
        for epoch, (tr, val) in enumerate(losses, 1):
            print(f"epoch {epoch}: train loss {tr:.6f}, validation loss {val:.6f}")
        for path in outcome.saved:
            print(f"saved {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
