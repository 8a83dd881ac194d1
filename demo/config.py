"""The demo's options: how to train (`TrainConfig`) and the command line that sets them.

Kept apart from demo/train_gpt.py as torchtitan keeps its job configuration apart: the example
reads the fields, this module says what each one means.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from demo.model import ModelConfig

__all__ = ["TrainConfig", "parse_args"]

DEMO_DIR = Path(__file__).resolve().parent


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """How to train. Only where training stops depends on --steps: a run to step 30 then
    resumed to 45 sees what a run straight to 45 sees."""

    impl: Literal["shardkit", "torch"] = "shardkit"
    """Whose fully_shard to use: ours (shardkit.core) or torch's (the reference)."""
    steps: int = 30
    """The step to stop at (a total, not a count of more steps when resuming)."""
    batch_size: int = 8
    """Sequences per data-parallel rank per step; the global batch is batch_size * dp."""
    tp: int = 1
    """Tensor-parallel degree: ranks that split each layer (dp = world size / tp)."""
    replicas: int = 0
    """HSDP replicas, each sharding the model over world / replicas ranks; 0 means one per
    torchrun node (only the gradients' all-reduce crosses nodes), 1 is plain FSDP."""
    lr: float = 3e-3
    """Peak learning rate, reached after the warmup and then held."""
    warmup_steps: int = 10
    """Steps of linear learning-rate warmup."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, applied to matrices only."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """"muon": shardkit.core.optim.Muon on the blocks' matrices (attention and MLP), AdamW on
    the rest (embeddings, norms, biases), as docs/guide/muon.md groups a transformer."""
    muon_lr: float = 0.02
    """Muon's peak learning rate (torch's Muon scale), warmed up and held as --lr is."""
    max_grad_norm: float = 1.0
    """Gradient clipping threshold on the global norm."""
    seed: int = 0
    """Seeds the initial weights and, with the step number, every batch."""
    corpus: Path = DEMO_DIR / "data" / "corpus.txt"
    """The training text."""
    ckpt_dir: Path | None = None
    """Where checkpoints go; None saves none."""
    ckpt_every: int = 10
    """Save every this many steps (and at the last step); 0 saves only at the last step."""
    keep_ckpts: int = 2
    """How many recent checkpoints to keep on disk."""
    resume: bool = False
    """Start from the latest checkpoint in ckpt_dir (it must exist)."""
    auto_resume: bool = False
    """Resume if there is a checkpoint, else start afresh (for torchrun --max-restarts)."""
    snapshot_every: int = 0
    """Copy the state into this node's shared memory every this many steps, replicated to a
    rank of the next node (shardkit.core.MemorySnapshots); a restart resumes from the newest
    step every rank holds, before any disk checkpoint. 0: off."""
    snapshot_replicate_every: int = 0
    """Replicate only the snapshots of steps that are a multiple of this (0: each one): a
    killed process still costs at most one step, a lost node up to this many."""
    snapshot_log: bool = False
    """With --snapshot-replicate-every, send the peer a log entry on the steps between (the
    step's gradients: a third of the bytes with AdamW): a lost node then also costs at most
    one step, its ranks replaying the log from the newest replicated step."""
    snapshot_dir: Path | None = None
    """Where the snapshots go, a folder node<N> per torchrun node (two "nodes" on one machine
    then keep apart, as two machines' memories are); default /dev/shm/shardkit-<run id>."""
    run_id: str = ""
    """Names the job for its snapshots: a restart restores only its own run's. Default:
    torchrun's TORCHELASTIC_RUN_ID."""
    log_every: int = 1
    """Print a progress line every this many steps (rank 0)."""
    metrics_file: Path | None = None
    """If set, rank 0 appends one JSON line per step and per event (run_demo.py reads them)."""

    def __post_init__(self) -> None:
        if (self.resume or self.auto_resume) and self.ckpt_dir is None:
            raise ValueError("--resume and --auto-resume need --ckpt-dir")
        if min(self.steps, self.batch_size, self.log_every, self.keep_ckpts, self.tp) < 1:
            raise ValueError("--steps, --batch-size, --log-every, --keep-ckpts, --tp must be >= 1")
        if self.ckpt_every < 0 or self.replicas < 0 or self.snapshot_every < 0:
            raise ValueError("--ckpt-every, --replicas and --snapshot-every must be >= 0")
        if self.snapshot_every and self.ckpt_dir is None:
            raise ValueError("--snapshot-every needs --ckpt-dir (the disk checkpoints behind it)")
        if self.snapshot_replicate_every and not self.snapshot_every:
            raise ValueError("--snapshot-replicate-every needs --snapshot-every")
        if self.optimizer == "muon" and self.snapshot_log:
            # The gradient log replays one optimizer's steps; Muon's matrices have another
            raise ValueError("--optimizer muon takes no --snapshot-log (it replays AdamW alone)")
        if self.snapshot_log and (self.snapshot_every != 1 or self.snapshot_replicate_every < 2):
            raise ValueError("--snapshot-log needs --snapshot-every=1 --snapshot-replicate-every=N")


def parse_args(argv: Sequence[str] | None = None) -> tuple[ModelConfig, TrainConfig]:
    m, t = ModelConfig(), TrainConfig()
    p = argparse.ArgumentParser(description="Train a small GPT with fully_shard on CPU ranks.")
    p.add_argument("--impl", choices=["shardkit", "torch"], default=t.impl)
    p.add_argument("--steps", type=int, default=t.steps, help="the step to stop at")
    p.add_argument("--ckpt-dir", type=Path, default=None)
    p.add_argument("--ckpt-every", type=int, default=t.ckpt_every)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--auto-resume", action="store_true", help="resume if there is a checkpoint")
    p.add_argument("--seed", type=int, default=t.seed)
    p.add_argument("--batch-size", type=int, default=t.batch_size)
    p.add_argument("--tp", type=int, default=t.tp, help="tensor-parallel degree (dp = W / tp)")
    p.add_argument("--replicas", type=int, default=t.replicas, help="HSDP replicas (0: nodes)")
    p.add_argument("--lr", type=float, default=t.lr)
    p.add_argument("--optimizer", choices=["adamw", "muon"], default=t.optimizer)
    p.add_argument("--muon-lr", type=float, default=t.muon_lr)
    p.add_argument("--snapshot-every", type=int, default=t.snapshot_every)
    p.add_argument("--snapshot-replicate-every", type=int, default=t.snapshot_replicate_every)
    p.add_argument("--snapshot-log", action="store_true")
    p.add_argument("--snapshot-dir", type=Path, default=None)
    p.add_argument("--run-id", default=t.run_id)
    p.add_argument("--log-every", type=int, default=t.log_every)
    p.add_argument("--metrics-file", type=Path, default=None)
    p.add_argument("--corpus", type=Path, default=t.corpus)
    sizes = ("seq_len", "d_model", "n_layers", "n_heads")
    for size in sizes:
        p.add_argument(f"--{size.replace('_', '-')}", type=int, default=getattr(m, size))
    args = vars(p.parse_args(argv))
    return ModelConfig(**{s: args.pop(s) for s in sizes}), TrainConfig(**args)
