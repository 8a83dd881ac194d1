"""A typical FSDP1 training script that runs on shardkit with only the import changed.

What production FSDP1 scripts do (Llama recipes, older trainers): transformer auto-wrap,
bf16 mixed precision, weights on rank 0 only and ``sync_module_states`` to broadcast them,
gradient clipping, a FULL checkpoint (model and optimizer) written by rank 0 every N steps,
and resuming from it. Everything below :func:`fsdp1` is FSDP1 code as written for torch:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 demo/train_fsdp1.py \
        --steps 20 --ckpt demo/runs/fsdp1/ckpt.pt
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 demo/train_fsdp1.py \
        --steps 30 --ckpt demo/runs/fsdp1/ckpt.pt --resume

``--fsdp torch`` runs torch's own FSDP1 instead, for comparison. On a CPU-only machine two
of its FSDP1 limits apply, and only to it: ``sync_module_states`` refuses CPU tensors, and a
FULL state dict offloaded to the CPU fails when FSDP1 computes there. The torch run then
builds the model on every rank and keeps the checkpoint's tensors where they are.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demo.train_gpt import GPT, BatchSampler, Block, ModelConfig, load_corpus

DEMO_DIR = Path(__file__).resolve().parent


def fsdp1(impl: str) -> Any:
    """FSDP1's names: shardkit.legacy's, or torch's own. The import is all that differs."""
    if impl == "shardkit":
        import shardkit.legacy as api  # was: torch.distributed.fsdp (+ .wrap)

        return api
    import torch.distributed.fsdp as fsdp
    import torch.distributed.fsdp.wrap as wrap

    return SimpleNamespace(**{**vars(fsdp), **vars(wrap)})


@dataclass(kw_only=True, slots=True)
class Config:
    """How to train (the model is demo/train_gpt.py's GPT)."""

    fsdp: str = "shardkit"
    """Whose FSDP1: "shardkit" (shardkit.legacy) or "torch"."""
    steps: int = 20
    """The step to stop at (a total: a resumed run goes on to it)."""
    batch_size: int = 4
    """Sequences per rank per step."""
    lr: float = 3e-3
    """AdamW's learning rate."""
    ckpt: Path | None = None
    """The FULL checkpoint file; None saves none."""
    ckpt_every: int = 5
    """Save every this many steps."""
    resume: bool = False
    """Start from ``ckpt``."""
    model: ModelConfig = field(
        default_factory=lambda: ModelConfig(d_model=64, n_layers=4, seq_len=64)
    )
    """The GPT's shape."""


def build(cfg: Config, rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model, sharded by FSDP1, and its optimizer."""
    api = fsdp1(cfg.fsdp)
    device = torch.device("cpu")
    # torch's FSDP1 cannot sync CPU tensors: see the module docstring.
    sync = not (cfg.fsdp == "torch" and device.type == "cpu")
    torch.manual_seed(0)
    if rank == 0 or not sync:
        model = GPT(cfg.model)  # rank 0 holds the weights (a pretrained checkpoint, say)
    else:
        with torch.device("meta"):
            model = GPT(cfg.model)  # the others only the shapes, filled by the broadcast
    model = api.FullyShardedDataParallel(
        model,
        auto_wrap_policy=functools.partial(
            api.transformer_auto_wrap_policy, transformer_layer_cls={Block}
        ),
        mixed_precision=api.MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16
        ),
        sharding_strategy=api.ShardingStrategy.FULL_SHARD,
        device_id=device,
        sync_module_states=sync,
        param_init_fn=lambda m: m.to_empty(device=device, recurse=False),
        limit_all_gathers=True,
        use_orig_params=False,
    )
    return model, torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1)


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, batch: tuple[Tensor, Tensor]
) -> Tensor:
    """One step: forward, backward, clipping, update. Returns this rank's loss."""
    inputs, targets = batch
    logits = model(inputs)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    loss.backward()
    model.clip_grad_norm_(1.0)  # type: ignore[operator]
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def save(cfg: Config, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """A FULL checkpoint of model and optimizer, written by rank 0 (every rank calls it)."""
    assert cfg.ckpt is not None
    api = fsdp1(cfg.fsdp)
    offload = cfg.fsdp == "shardkit"  # torch's FSDP1 offload fails on CPU (docstring)
    with api.FullyShardedDataParallel.state_dict_type(
        model,
        api.StateDictType.FULL_STATE_DICT,
        api.FullStateDictConfig(offload_to_cpu=offload, rank0_only=True),
        api.FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True),
    ):
        model_state = model.state_dict()
        optim_state = api.FullyShardedDataParallel.optim_state_dict(model, opt)
    failure = [""]
    if dist.get_rank() == 0:
        partial = cfg.ckpt.with_name(cfg.ckpt.name + ".partial")  # renamed once complete
        try:
            cfg.ckpt.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"model": model_state, "optim": optim_state, "step": step}, partial)
            partial.replace(cfg.ckpt)
        except OSError as error:
            failure[0] = f"rank 0 could not write {cfg.ckpt}: {error}"
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
    # Every rank learns how rank 0's write went (in place of a barrier): a full disk raises
    # on every rank, instead of leaving the others waiting for a rank that has given up.
    dist.broadcast_object_list(failure, src=0)
    if failure[0]:
        raise OSError(failure[0])


def load(cfg: Config, model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Resume from ``cfg.ckpt``: every rank reads the model, rank 0 the optimizer state."""
    assert cfg.ckpt is not None
    api = fsdp1(cfg.fsdp)
    checkpoint = torch.load(cfg.ckpt, weights_only=False)
    with api.FullyShardedDataParallel.state_dict_type(
        model,
        api.StateDictType.FULL_STATE_DICT,
        api.FullStateDictConfig(rank0_only=False),
        api.FullOptimStateDictConfig(rank0_only=True),
    ):
        model.load_state_dict(checkpoint["model"])
        optim_state = checkpoint["optim"] if dist.get_rank() == 0 else {}
        opt.load_state_dict(
            api.FullyShardedDataParallel.optim_state_dict_to_load(model, opt, optim_state)
        )
    return int(checkpoint["step"])


def train(cfg: Config) -> list[float]:
    """Train (and checkpoint, and resume) as ``cfg`` says; the global loss of every step run."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build(cfg, rank)
    start = load(cfg, model, opt) if cfg.resume else 0
    sampler = BatchSampler(
        data=load_corpus(DEMO_DIR / "data" / "corpus.txt"),
        seq_len=cfg.model.seq_len,
        batch_per_rank=cfg.batch_size,
        rank=rank,
        world=world,
        seed=0,
    )
    losses = []
    for step in range(start + 1, cfg.steps + 1):
        loss = train_step(model, opt, sampler.batch(step))
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
        if rank == 0:
            print(f"step {step:4d}  loss {losses[-1]:.4f}", flush=True)
        if cfg.ckpt is not None and step % cfg.ckpt_every == 0:
            save(cfg, model, opt, step)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fsdp", choices=["shardkit", "torch"], default="shardkit")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ckpt", type=Path)
    parser.add_argument("--ckpt-every", type=int, default=5)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    cfg = Config(
        fsdp=args.fsdp,
        steps=args.steps,
        ckpt=args.ckpt,
        ckpt_every=args.ckpt_every,
        resume=args.resume,
    )
    train(cfg)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
