"""Train a small byte-level GPT with fully sharded data parallelism, checkpoint it, resume it.

One story, top to bottom: parallelism applied from outside the model (demo/model.py), the
checkpoint, the training loop, `main`; the options are in demo/config.py. Launch it with torchrun:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 demo/train_gpt.py \
        --steps 30 --ckpt-dir demo/runs/manual/ckpt
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 demo/train_gpt.py \
        --steps 45 --ckpt-dir demo/runs/manual/ckpt --resume

`--tp 2` adds tensor parallelism inside each layer; on several torchrun nodes it trains with
HSDP (demo/distributed.py builds the mesh). Resuming is exact: every step's batch
(demo/batches.py) and learning rate are functions of the step number alone, and the checkpoint
holds everything else that changes (parameters, optimizer moments, the step, the RNG).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from shardkit.core import (
    CheckpointManager,
    MemorySnapshots,
    StateDictCache,
    save_full_state_dict,
)
from shardkit.core import fully_shard as shardkit_fully_shard
from shardkit.core.optim import Muon

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, run as a script

from demo.batches import BatchSampler, load_corpus
from demo.config import TrainConfig, parse_args
from demo.distributed import build_mesh, data_position, describe, init_distributed
from demo.model import GPT, Block, ModelConfig, plan_inputs, plan_model, tensor_parallel_plan

# The model's and data's names stay importable from here: benchmarks/, demo/train_fsdp1.py,
# `shardkit-plan demo.train_gpt:plan_model --inputs demo.train_gpt:plan_inputs` use them.
__all__ = ["GPT", "BatchSampler", "Block", "Hooks", "ModelConfig", "TrainConfig", "TrainState"]
__all__ += ["load_corpus", "main", "node_memory", "parse_args", "plan_inputs", "plan_model"]
__all__ += ["tensor_parallel_plan"]

# ---------------------------------------------------------------------------------------------
# Parallelism, applied from outside the model.

FULLY_SHARD: dict[str, Callable[..., object]] = {
    "shardkit": shardkit_fully_shard,
    "torch": torch_fully_shard,
}


def parallelize(model: GPT, mesh: DeviceMesh, fully_shard: Callable[..., object]) -> None:
    """TP on the mesh's "tp" axis if it has one; then fully_shard each block, then the root.

    One unit per block: one all-gather per block in forward and one reduce-scatter in backward,
    so only one block's full parameters exist at a time, and the next block's all-gather can be
    in flight while this one computes. On the HSDP mesh ("dp_replicate", "dp_shard")
    fully_shard shards over "dp_shard" and replicates over "dp_replicate".
    """
    dp_mesh = mesh
    if "tp" in (mesh.mesh_dim_names or ()):
        parallelize_module(model, mesh["tp"], tensor_parallel_plan(model))
        dp_mesh = mesh["dp"]  # each parameter is a DTensor on "tp", then on ("dp", "tp")
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


# ---------------------------------------------------------------------------------------------
# Checkpoints: DCP through shardkit.core.CheckpointManager (a directory per save, published by
# atomic renames once every rank has written its part; the newest --keep-ckpts kept).


class TrainState:
    """Everything a checkpoint holds, as one DCP `Stateful`: the model and optimizer states
    (sharded DTensors: each rank writes its own shards), the step, each rank's RNG state."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, *others: torch.optim.Optimizer
    ) -> None:
        self.model, self.optimizer = model, optimizer
        # Stepped after it: Muon beside AdamW (--optimizer muon).
        self.optimizers = (optimizer, *others)
        # get_state_dict, with the FQNs learned once (a memory snapshot asks every step) and
        # the parameters themselves, not detached aliases (a DTensor detach per parameter).
        self.state_dicts = StateDictCache(model, optimizer, keep_vars=True)
        self.rank = dist.get_rank()
        self.step = 0  # steps completed

    def state_dict(self) -> dict[str, Any]:
        if len(self.optimizers) > 1:
            # Both optimizers' states in one dict, keyed by FQN as torch's get_state_dict
            # keys a list of optimizers (Muon's momentum: DTensors sharded like its matrices).
            model_sd, optim_sd = get_state_dict(self.model, list(self.optimizers))
        else:
            model_sd, optim_sd = self.state_dicts()
        rng = {f"rank{self.rank}": torch.get_rng_state()}
        return {"model": model_sd, "optim": optim_sd, "step": self.step, "rng": rng}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            list(self.optimizers),
            model_state_dict=sd["model"],
            optim_state_dict=sd["optim"],
        )
        self.step = int(sd["step"])
        torch.set_rng_state(sd["rng"][f"rank{self.rank}"])


def run_id(cfg: TrainConfig) -> str:
    """--run-id, or torchrun's: what a snapshot must say to be restored into this job."""
    return cfg.run_id or os.environ.get("TORCHELASTIC_RUN_ID", "demo")


def node_memory(cfg: TrainConfig) -> Path:
    """This node's folder of snapshots: one per torchrun node (GROUP_RANK), as each machine
    has its own memory (two "nodes" on one machine keep apart)."""
    root = cfg.snapshot_dir or MemorySnapshots(run_id(cfg)).root
    return root / f"node{os.environ.get('GROUP_RANK', '0')}"


def memory_snapshots(
    cfg: TrainConfig, optimizer: torch.optim.Optimizer | None = None
) -> MemorySnapshots | None:
    """This node's memory snapshots (None without --snapshot-every); ``optimizer`` replays the
    gradient log of a lost node (--snapshot-log)."""
    if not cfg.snapshot_every:
        return None
    return MemorySnapshots(
        run_id(cfg),
        directory=node_memory(cfg),
        every=cfg.snapshot_every,
        replicate_every=cfg.snapshot_replicate_every or None,
        optimizer=optimizer if cfg.snapshot_log else None,
    )


def restore(
    state: TrainState, cfg: TrainConfig, snapshots: MemorySnapshots | None
) -> CheckpointManager | None:
    """The checkpoint manager (None without --ckpt-dir), after resuming from memory snapshots
    if there are any, else loading the newest checkpoint that loads; a fresh run refuses a
    directory that holds one."""
    if cfg.ckpt_dir is None:
        return None
    cfg.ckpt_dir.mkdir(parents=True, exist_ok=True)
    manager = CheckpointManager(cfg.ckpt_dir, keep=cfg.keep_ckpts)
    latest = manager.latest()
    if latest is not None and not (cfg.resume or cfg.auto_resume):
        raise FileExistsError(f"{cfg.ckpt_dir} holds {latest.name}: pass --resume or a new dir")
    if snapshots is not None and (cfg.resume or cfg.auto_resume):
        # The newest step every rank holds in memory (own copy or a peer's replica), unless
        # the newest disk checkpoint is newer; else that checkpoint.
        point = snapshots.resume({"train": state}, manager)
        where = str(point.path) if point.path is not None else "memory"
        if point.from_replicas:
            where += f" (rank(s) {list(point.from_replicas)} from a peer's replica)"
        if point.source == "none" and cfg.resume:
            raise FileNotFoundError(f"--resume: no snapshot or checkpoint for {cfg.ckpt_dir}")
        if point.source != "none":
            message = f"resumed from {where} at step {state.step} in {point.seconds:.3f} s"
            fields = {"step": state.step, "path": where, "seconds": point.seconds}
            log(cfg, message, event="resumed", source=point.source, **fields)
        return manager
    if latest is None and cfg.resume:
        raise FileNotFoundError(f"--resume: no checkpoint in {cfg.ckpt_dir}")
    if latest is not None:  # a checkpoint that does not load is passed over for an older one
        started = time.perf_counter()
        path = str(manager.load({"train": state}))
        seconds = time.perf_counter() - started
        message = f"resumed from {path} at step {state.step} in {seconds:.3f} s"
        log(cfg, message, event="resumed", step=state.step, path=path, seconds=seconds)
    return manager


# ---------------------------------------------------------------------------------------------
# Training


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then constant: a function of the step alone, never of --steps."""
    return cfg.lr * min(1.0, step / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr


def muon_matrices(model: nn.Module, cfg: TrainConfig) -> list[tuple[str, nn.Parameter]]:
    """What Muon takes with --optimizer muon (else nothing): the blocks' matrices. Muon
    orthogonalizes whole hidden matrices (each once, on one rank); the embeddings are lookups,
    not maps, and keep AdamW, as do norms and biases."""
    if cfg.optimizer != "muon":
        return []
    return [(n, p) for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW on every trainable parameter that Muon does not take."""
    taken = {id(p) for _, p in muon_matrices(model, cfg)}
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in taken]
    # Decay matrices only: pulling LayerNorm gains and biases towards 0 only hurts.
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def build_optimizers(model: nn.Module, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
    """AdamW; with --optimizer muon, then shardkit's Muon on the blocks' matrices."""
    matrices = muon_matrices(model, cfg)
    if not matrices:
        return [build_optimizer(model, cfg)]
    group = {"params": [p for _, p in matrices], "param_names": [n for n, _ in matrices]}
    group["lr_ratio"] = cfg.muon_lr / cfg.lr  # warmed up with the step, as AdamW's lr is
    muon = Muon([group], lr=cfg.muon_lr, weight_decay=cfg.weight_decay)
    return [build_optimizer(model, cfg), muon]


def train_step(
    state: TrainState, batch: tuple[Tensor, Tensor], cfg: TrainConfig
) -> tuple[float, float]:
    """One optimizer step on this rank's rows of the global batch; the global batch's mean
    loss, and the gradients' global norm before clipping."""
    for optimizer in state.optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(state.step + 1, cfg) * group.get("lr_ratio", 1.0)
    inputs, targets = batch  # (B, T), (B, T)
    logits = state.model(inputs)  # (B, T, V)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    torch.autograd.backward(loss)  # = loss.backward(), which torch leaves untyped
    grad_norm = nn.utils.clip_grad_norm_(state.model.parameters(), cfg.max_grad_norm)
    for optimizer in state.optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    state.step += 1
    # Averaged for the log only; the gradients were already averaged by the reduce-scatter.
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss)
    if isinstance(grad_norm, DTensor):  # sharded grads give a replicated DTensor norm
        grad_norm = grad_norm.full_tensor()
    return global_loss.item() / dist.get_world_size(), grad_norm.item()


def log(cfg: TrainConfig, message: str | None, **fields: object) -> None:
    """On rank 0: print the message for people, append the fields to --metrics-file."""
    # The record first: whoever reads the printed line (a test that kills the job on it) finds
    # the step in the metrics file too.
    if dist.get_rank() == 0 and fields and cfg.metrics_file is not None:
        with cfg.metrics_file.open("a") as f:
            f.write(json.dumps(fields) + "\n")
    if dist.get_rank() == 0 and message is not None:
        print(message, flush=True)


def log_saved(cfg: TrainConfig, checkpoint: Path | None) -> None:
    """Tell that a save written in the background became the latest checkpoint."""
    if checkpoint is not None:
        step = int(checkpoint.name.removeprefix("step_"))
        log(cfg, f"saved {checkpoint}", event="saved", step=step, path=str(checkpoint))


class Hooks:
    """The training loop's extension point: pass a subclass to `main` to ride along without
    changing the training (tests/demo/rig.py kills ranks at chosen points and profiles this
    way). Its methods run on every rank; these do nothing."""

    def started(self, state: TrainState) -> None:
        """Called once the model is parallelized and the checkpoint restored."""

    def checkpoint_extras(self, state: TrainState) -> dict[str, Any]:
        """Entries to save beside the train state in the checkpoint of `state.step`."""
        return {}

    def finished(self, state: TrainState) -> None:
        """Called after the last step and the last save, the process group still up."""


def train(model_cfg: ModelConfig, cfg: TrainConfig, hooks: Hooks) -> None:
    mesh = build_mesh(model_cfg, tp=cfg.tp, replicas=cfg.replicas)
    dp_rank, dp_size = data_position(mesh)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank, before sharding
    model = GPT(model_cfg)
    n_params = sum(p.numel() for p in model.parameters())
    parallelize(model, mesh, FULLY_SHARD[cfg.impl])
    state = TrainState(model, *build_optimizers(model, cfg))
    data = load_corpus(cfg.corpus)
    sampler = BatchSampler(
        data=data,
        seq_len=model_cfg.seq_len,
        batch_per_rank=cfg.batch_size,
        rank=dp_rank,
        world=dp_size,
        seed=cfg.seed,
    )
    tokens = cfg.batch_size * dp_size * model_cfg.seq_len  # per step
    ranks = f"ranks={dist.get_world_size()} ({describe(mesh)})"
    log(cfg, f"impl={cfg.impl} {ranks} params={n_params:,} tokens/step={tokens:,}")
    if cfg.optimizer == "muon":
        log(cfg, f"optimizer=muon (lr {cfg.muon_lr}) on the blocks' matrices, adamw on the rest")
    snapshots = memory_snapshots(cfg, state.optimizer)
    manager = restore(state, cfg, snapshots)
    hooks.started(state)
    while state.step < cfg.steps:
        t0 = time.perf_counter()
        loss, grad_norm = train_step(state, sampler.batch(state.step + 1), cfg)
        step, tokens_per_s = state.step, tokens / (time.perf_counter() - t0)
        line = (
            f"step {step:4d} | loss {loss:.4f} | grad norm {grad_norm:6.3f} | "
            f"lr {lr_at(step, cfg):.2e} | {tokens_per_s:7,.0f} tok/s"
        )
        shown = step % cfg.log_every == 0 or step == cfg.steps
        fields = {"step": step, "loss": loss, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s}
        fields["time"] = time.time()  # wall clock: when the step ended (restarts are timed so)
        log(cfg, line if shown else None, **fields)
        if snapshots is not None:  # copied into shared memory; replicated in the background
            snapshots.snapshot(step, {"train": state})
        if manager is None:
            continue
        # Asynchronous: the state is copied at the save and written while the next steps
        # train. It becomes current (atomically) at the first step after every rank's write
        # has finished: a job killed before then resumes from the previous checkpoint.
        log_saved(cfg, manager.poll())
        if (cfg.ckpt_every > 0 and step % cfg.ckpt_every == 0) or step == cfg.steps:
            log_saved(cfg, manager.wait())
            contents = {"train": state, **hooks.checkpoint_extras(state)}
            manager.save(step, contents, async_save=True)
    if manager is not None:
        log_saved(cfg, manager.wait())
        if cfg.impl == "shardkit":
            # The model alone, as one file any single process can load: streamed through
            # rank 0 one parameter group at a time (shardkit.core.save_full_state_dict).
            export = manager.root / "model.safetensors"
            save_full_state_dict(model, export)
            message = f"exported the full model to {export}"
            log(cfg, message, event="exported", step=state.step, path=str(export))
    if snapshots is not None:
        snapshots.close()  # frees the shared memory
    hooks.finished(state)


def main(argv: Sequence[str] | None = None, hooks: Hooks | None = None) -> None:
    model_cfg, train_cfg = parse_args(argv)
    init_distributed()
    try:
        train(model_cfg, train_cfg, hooks or Hooks())
        # Leave together: a rank that runs ahead into interpreter shutdown while a gloo thread
        # still holds a finished collective's tensor aborts ("terminate called without an
        # active exception", about 1 run in 8 without this barrier).
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
