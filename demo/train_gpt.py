"""Train a small byte-level GPT with fully sharded data parallelism, checkpoint it, resume it.

One story, top to bottom: configuration, the model, how it is parallelized, the data, the
checkpoint, the training loop. Launch it with torchrun (demo/run_demo.py does this for you):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 demo/train_gpt.py \
        --impl torch --steps 30 --ckpt-dir demo/runs/manual/ckpt
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 demo/train_gpt.py \
        --impl torch --steps 45 --ckpt-dir demo/runs/manual/ckpt --resume

On several nodes (or several torchrun launches on one machine) it trains with HSDP: sharded
within a node, replicated across nodes. Run the same line on each node:

    OMP_NUM_THREADS=1 torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \
        --rdzv-endpoint localhost:29500 --rdzv-id demo demo/train_gpt.py --steps 30

Add `--profile DIR` to profile the training loop with shardkit.tools: DIR gets a terminal summary,
JSON, a Perfetto trace and plots of memory and of compute vs communication per rank.

Resuming is exact: every step's batch and learning rate are functions of the step number alone,
and the checkpoint holds everything else that changes (parameters, optimizer moments, the step
counter, the RNG), so a resumed run computes the same losses as one that never stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from shardkit.core import CheckpointManager, save_full_state_dict

if TYPE_CHECKING:
    from shardkit.tools.track.profiler import Profiler

DEMO_DIR = Path(__file__).resolve().parent
Impl = Literal["shardkit", "torch"]

# ---------------------------------------------------------------------------------------------
# Configuration


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The GPT's shape. The defaults give about 1.3M parameters: a step takes about 0.25 s on
    two CPU cores."""

    vocab_size: int = 256
    """Bytes are the tokens, so 256 covers any UTF-8 text."""
    seq_len: int = 128
    """Context length in tokens; also the length of every training sequence."""
    d_model: int = 128
    """Width of the residual stream."""
    n_layers: int = 6
    """Number of transformer blocks; each becomes one fully_shard unit."""
    n_heads: int = 4
    """Attention heads per block; must divide d_model."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if min(self.vocab_size, self.seq_len, self.d_model, self.n_layers, self.n_heads) <= 0:
            raise ValueError(f"every size in {self} must be positive")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """How to train. Nothing here may depend on --steps except where training stops: a run to
    step 30 then resumed to 45 must see what a run straight to 45 sees."""

    impl: Impl = "shardkit"
    """Whose fully_shard to use: ours (shardkit.core) or torch's (the reference)."""
    steps: int = 30
    """The step to stop at (a total, not a count of more steps when resuming)."""
    batch_size: int = 8
    """Sequences per data-parallel rank per step; the global batch is batch_size * dp."""
    tp: int = 1
    """Tensor-parallel degree: ranks that split each layer (dp = world size / tp)."""
    replicas: int = 0
    """HSDP replicas: the model is sharded within groups of world / replicas ranks and the
    groups are replicas of each other (gradients all-reduced across them). 0 means one per
    node (torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE), so that the shard groups' all-gathers
    and reduce-scatters stay inside a node and only the all-reduce crosses nodes; 1 is plain
    FSDP over every rank."""
    lr: float = 3e-3
    """Peak learning rate, reached after the warmup and then held."""
    warmup_steps: int = 10
    """Steps of linear learning-rate warmup."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, applied to matrices only."""
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
    """Start from the latest checkpoint in ckpt_dir if there is one, else from scratch: what a
    job restarted by torchrun --max-restarts needs (the same command line runs every time)."""
    log_every: int = 1
    """Print a progress line every this many steps (rank 0)."""
    metrics_file: Path | None = None
    """If set, rank 0 appends one JSON line per step and per event, for run_demo.py to check."""
    profile_dir: Path | None = None
    """If set, profile the training loop with shardkit.tools: every rank writes its records
    there (rank-N.json), then rank 0 writes the report (summary, JSON, trace, plots)."""

    def __post_init__(self) -> None:
        if (self.resume or self.auto_resume) and self.ckpt_dir is None:
            raise ValueError("--resume and --auto-resume need --ckpt-dir")
        if self.steps < 1 or self.batch_size < 1 or self.log_every < 1 or self.keep_ckpts < 1:
            raise ValueError("--steps, --batch-size, --log-every and --keep-ckpts must be >= 1")
        if self.ckpt_every < 0:
            raise ValueError(f"--ckpt-every must be >= 0, got {self.ckpt_every}")
        if self.tp < 1:
            raise ValueError(f"--tp must be >= 1, got {self.tp}")
        if self.replicas < 0:
            raise ValueError(f"--replicas must be >= 0, got {self.replicas}")


# ---------------------------------------------------------------------------------------------
# The model: token + position embeddings, pre-LN blocks, final LN, linear head.


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        # Separate projections, so that tensor parallelism can give each rank whole heads.
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, T, D)
        b, t = x.shape[:2]
        # Under TP each rank holds H/tp heads: its projections are D/tp wide (H' = local heads).
        q, k, v = (  # each (B, H', T, D/H)
            z.view(b, t, -1, self.head_dim).transpose(1, 2)
            for z in (self.q(x), self.k(x), self.v(x))
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H', T, D/H)
        out: Tensor = self.proj(y.transpose(1, 2).reshape(b, t, -1))  # (B, T, D)
        return out


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, T, D)
        out: Tensor = self.proj(F.gelu(self.fc(x)))
        return out


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, T, D)
        x = x + self.attn(self.ln1(x))
        out: Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        # Not tied to tok_emb: both sit in the root's fully_shard unit either way, but untied
        # weights keep the state dict free of aliases.
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(_init_weights)
        # GPT-2's scaling: each residual branch adds to the stream once per block, so shrink its
        # output projection to keep the stream's variance flat in depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layers))

    def forward(self, idx: Tensor) -> Tensor:  # idx: (B, T) int64 → logits (B, T, V)
        pos = torch.arange(idx.shape[1], device=idx.device)  # (T,)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, D)
        for block in self.blocks:
            x = block(x)
        logits: Tensor = self.head(self.ln_f(x))
        return logits


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


# ---------------------------------------------------------------------------------------------
# Parallelism, applied from outside the model.


class FullyShard(Protocol):
    """The part of `fully_shard`'s signature the demo uses; torch's and shardkit's both fit."""

    def __call__(self, module: nn.Module, *, mesh: DeviceMesh | None = ...) -> object: ...


def resolve_fully_shard(impl: Impl) -> FullyShard:
    """Import the chosen `fully_shard`, with a clear error if shardkit's is not there yet."""
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard

        return fully_shard
    try:
        from shardkit.core import fully_shard as shardkit_fully_shard
    except ImportError as err:
        raise ImportError(
            "--impl shardkit needs `from shardkit.core import fully_shard`, which is not "
            f"importable in this environment ({err}). Install the core package (make setup) "
            "or run the demo on torch's engine with --impl torch."
        ) from err
    return shardkit_fully_shard


def tensor_parallel_plan(model: GPT) -> dict[str, ParallelStyle]:
    """Megatron-style TP with sequence parallelism, as torchtitan applies it.

    Attention heads and MLP columns are split across the "tp" axis (colwise in, rowwise out);
    between them the activations are split along the sequence (Shard(1)), so that the layer
    norms run on 1/tp of the tokens; embeddings split the table by rows, and the head gathers
    the full logits for the loss.
    """
    plan: dict[str, ParallelStyle] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "ln_f": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(len(model.blocks)):
        gather_sequence = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        )
        plan |= {
            f"blocks.{i}.ln1": SequenceParallel(),
            f"blocks.{i}.attn": gather_sequence,
            f"blocks.{i}.attn.q": ColwiseParallel(),
            f"blocks.{i}.attn.k": ColwiseParallel(),
            f"blocks.{i}.attn.v": ColwiseParallel(),
            f"blocks.{i}.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            f"blocks.{i}.ln2": SequenceParallel(),
            f"blocks.{i}.mlp": gather_sequence,
            f"blocks.{i}.mlp.fc": ColwiseParallel(),
            f"blocks.{i}.mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
        }
    return plan


def parallelize(model: GPT, mesh: DeviceMesh, fully_shard: FullyShard) -> None:
    """Tensor parallelism on the "tp" axis if the mesh has one; then shard every block on its
    own over "dp", then the root (embeddings, final LN, head).

    One unit per block means one all-gather per block in forward and one reduce-scatter per
    block in backward, so only one block's full parameters exist at a time and the next block's
    all-gather can be in flight while the current one computes. Under TP each parameter is a
    DTensor on "tp" before fully_shard, and one DTensor on ("dp", "tp") after it. On the
    HSDP mesh ("dp_replicate", "dp_shard") fully_shard shards over "dp_shard" and replicates
    over "dp_replicate".
    """
    dp_mesh = mesh
    if mesh.mesh_dim_names is not None and "tp" in mesh.mesh_dim_names:
        parallelize_module(model, mesh["tp"], tensor_parallel_plan(model))
        dp_mesh = mesh["dp"]
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def plan_model() -> GPT:
    """The default model on the meta device, for the planner (README: "past one machine"):
    shardkit-plan demo.train_gpt:plan_model --inputs demo.train_gpt:plan_inputs ..."""
    with torch.device("meta"):
        return GPT(ModelConfig())


def plan_inputs() -> Tensor:
    """One rank's default batch of token ids on the meta device, (batch_size, seq_len)."""
    return torch.zeros(TrainConfig().batch_size, ModelConfig().seq_len, dtype=torch.long,
                       device="meta")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Data: the batch of step s is a pure function of (seed, s); rank r takes its slice.


def load_corpus(path: Path) -> Tensor:
    """The corpus as a 1-D uint8 tensor of bytes (the tokenizer is the identity on bytes)."""
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)  # (N,)


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchSampler:
    """Cuts step s's global batch out of the corpus and hands this rank its rows.

    The global batch's start offsets come from a generator seeded by (seed, step) alone, so
    resuming at step k replays exactly the batches an uninterrupted run sees, with no data-loader
    state to checkpoint. Every rank draws the whole global batch (a few integers) and keeps its
    rows, so the global batch is the same at any world size.
    """

    data: Tensor  # (N,) uint8
    seq_len: int
    batch_per_rank: int
    rank: int
    world: int
    seed: int

    def batch(self, step: int) -> tuple[Tensor, Tensor]:
        """Inputs and next-byte targets, each (batch_per_rank, seq_len) int64."""
        n_windows = self.data.numel() - self.seq_len - 1
        rng = np.random.default_rng((self.seed, step))
        starts = rng.integers(0, n_windows, size=self.batch_per_rank * self.world)  # (W*B,)
        mine = starts[self.rank * self.batch_per_rank : (self.rank + 1) * self.batch_per_rank]
        offsets = torch.from_numpy(mine)[:, None] + torch.arange(self.seq_len + 1)  # (B, T+1)
        window = self.data[offsets].long()  # (B, T+1)
        return window[:, :-1], window[:, 1:]  # (B, T) inputs, (B, T) targets


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then constant: a function of the step alone, never of --steps."""
    return cfg.lr * min(1.0, step / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr


# ---------------------------------------------------------------------------------------------
# Checkpoints: DCP through shardkit.core.CheckpointManager (one directory per save, published by
# atomic renames once every rank has finished, the newest --keep-ckpts kept).


class TrainState:
    """Everything a checkpoint holds, as one DCP `Stateful`.

    DCP calls `state_dict()` to learn what to save or what to load into, then `load_state_dict()`
    after loading. Model and optimizer states are the sharded DTensors (each rank writes its own
    shards); the step is replicated; the RNG state is keyed by rank because ranks may differ.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
        self.model = model
        self.optimizer = optimizer
        self.rank = rank
        self.step = 0  # steps completed
        self.faults: Faults | None = None  # kill points (tests only)

    def state_dict(self) -> dict[str, Any]:
        if self.faults is not None:
            self.faults.maybe(self.step, "save")
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        rng = {f"rank{self.rank}": torch.get_rng_state()}
        return {"model": model_sd, "optim": optim_sd, "step": self.step, "rng": rng}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )
        self.step = int(state_dict["step"])
        torch.set_rng_state(state_dict["rng"][f"rank{self.rank}"])


# ---------------------------------------------------------------------------------------------
# Faults on purpose, for the kill tests and the soak test (tests/demo): SIGKILL one rank at a
# chosen point. SHARDKIT_DEMO_KILL_AT="RANK:STEP:PHASE,..." names the points; PHASE is forward,
# backward, save (the training thread, while the save of STEP stages the state) or async-save
# (DCP's writer thread, while it writes the save of STEP). SHARDKIT_DEMO_KILL_LOG names a file
# where a point is recorded before it fires: torchrun restarts the workers with the same
# environment, and a point must fire once only.

Phase = Literal["forward", "backward", "save", "async-save"]


class Faults:
    """The kill points of this rank that have not fired yet."""

    def __init__(self, rank: int) -> None:
        log = os.environ.get("SHARDKIT_DEMO_KILL_LOG")
        self.log = Path(log) if log else None
        fired = set(self.log.read_text().split()) if self.log and self.log.exists() else set()
        spec = os.environ.get("SHARDKIT_DEMO_KILL_AT", "")
        mine = [p for p in spec.split(",") if p.split(":")[0] == str(rank) and p not in fired]
        self.points = {(int(p.split(":")[1]), p.split(":")[2]) for p in mine}
        self.rank = rank

    def due(self, step: int, phase: Phase) -> bool:
        return (step, phase) in self.points

    def kill(self, step: int, phase: Phase) -> None:
        """Record the point, then die as a lost machine does: no cleanup, no exit handlers."""
        if self.log is not None:
            with self.log.open("a") as f:
                f.write(f"{self.rank}:{step}:{phase}\n")
                f.flush()
                os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    def maybe(self, step: int, phase: Phase) -> None:
        if self.due(step, phase):
            self.kill(step, phase)


class KillWhenWritten:
    """A checkpoint value that kills its rank when DCP's writer serializes it (mid-write)."""

    def __init__(self, faults: Faults, step: int) -> None:
        self.faults, self.step = faults, step

    def __deepcopy__(self, memo: dict[int, Any]) -> KillWhenWritten:
        return self  # staging copies the state: this value must reach the writer as itself

    def __reduce__(self) -> tuple[Any, ...]:
        self.faults.kill(self.step, "async-save")
        raise AssertionError("unreachable: the process was killed")


def arm_model_faults(model: GPT, faults: Faults, state: TrainState) -> None:
    """Forward and backward kill points, in the middle block of the model."""
    if not faults.points:
        return
    middle = model.blocks[len(model.blocks) // 2]

    def in_forward(module: nn.Module, args: Any, output: Tensor) -> None:
        step = state.step + 1  # the step being computed
        faults.maybe(step, "forward")
        if faults.due(step, "backward") and output.requires_grad:
            output.register_hook(lambda grad: faults.maybe(step, "backward"))

    middle.register_forward_hook(in_forward)


def checkpoint_contents(state: TrainState) -> dict[str, Any]:
    """What a save writes: the train state, plus a kill point inside the write if one is due."""
    faults = state.faults
    if faults is not None and faults.due(state.step, "async-save"):
        return {"train": state, "fault": KillWhenWritten(faults, state.step)}
    return {"train": state}


# ---------------------------------------------------------------------------------------------
# Training


class StepResult(NamedTuple):
    loss: float  # the global batch's mean loss
    grad_norm: float  # global, before clipping
    seconds: float


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    # Decay matrices only: pulling LayerNorm gains and biases towards 0 only hurts.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def train_step(state: TrainState, batch: tuple[Tensor, Tensor], cfg: TrainConfig) -> StepResult:
    """One optimizer step on this rank's rows of the global batch."""
    t0 = time.perf_counter()
    for group in state.optimizer.param_groups:
        group["lr"] = lr_at(state.step + 1, cfg)
    inputs, targets = batch  # (B, T), (B, T)
    logits = state.model(inputs)  # (B, T, V)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    torch.autograd.backward(loss)  # = loss.backward(), which torch leaves untyped
    grad_norm = nn.utils.clip_grad_norm_(state.model.parameters(), cfg.max_grad_norm)
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.step += 1
    # Averaged for the log only; the gradients were already averaged by the reduce-scatter.
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss)
    if isinstance(grad_norm, DTensor):  # sharded grads give a replicated DTensor norm
        grad_norm = grad_norm.full_tensor()
    return StepResult(
        loss=global_loss.item() / dist.get_world_size(),
        grad_norm=grad_norm.item(),
        seconds=time.perf_counter() - t0,
    )


class Reporter:
    """Progress for people (printed by rank 0) and for run_demo.py (JSON lines)."""

    def __init__(self, cfg: TrainConfig, tokens_per_step: int) -> None:
        self.cfg = cfg
        self.tokens_per_step = tokens_per_step
        self.rank0 = dist.get_rank() == 0

    def say(self, message: str) -> None:
        if self.rank0:
            print(message, flush=True)

    def record(self, **fields: object) -> None:
        if self.rank0 and self.cfg.metrics_file is not None:
            with self.cfg.metrics_file.open("a") as f:
                f.write(json.dumps(fields) + "\n")

    def step(self, step: int, result: StepResult) -> None:
        tokens_per_s = self.tokens_per_step / result.seconds
        self.record(step=step, **result._asdict(), tokens_per_s=tokens_per_s)
        if step % self.cfg.log_every == 0 or step == self.cfg.steps:
            self.say(
                f"step {step:4d} | loss {result.loss:.4f} | grad norm {result.grad_norm:6.3f} | "
                f"lr {lr_at(step, self.cfg):.2e} | {tokens_per_s:7,.0f} tok/s"
            )


def restore(state: TrainState, cfg: TrainConfig, reporter: Reporter) -> None:
    """Load the latest checkpoint if --resume; refuse to mix a fresh run into an old directory."""
    if cfg.ckpt_dir is None:
        return
    cfg.ckpt_dir.mkdir(parents=True, exist_ok=True)
    manager = CheckpointManager(cfg.ckpt_dir, keep=cfg.keep_ckpts)
    latest = manager.latest()
    if not (cfg.resume or cfg.auto_resume):
        if latest is not None:
            raise FileExistsError(
                f"{cfg.ckpt_dir} already holds {latest.name}: pass --resume or a new --ckpt-dir"
            )
        return
    if latest is None:
        if cfg.auto_resume:
            return  # the job's first start
        raise FileNotFoundError(f"--resume: no checkpoint in {cfg.ckpt_dir}")
    # The newest checkpoint that loads on every rank (a corrupt one is passed over).
    loaded = manager.load({"train": state})
    reporter.record(event="resumed", step=state.step, path=str(loaded))
    reporter.say(f"resumed from {loaded} at step {state.step}")


def report_published(checkpoint: Path | None, reporter: Reporter) -> None:
    """Tell that a save written in the background became the latest checkpoint."""
    if checkpoint is not None:
        step = int(checkpoint.name.removeprefix("step_"))
        reporter.record(event="saved", step=step, path=str(checkpoint))
        reporter.say(f"saved {checkpoint}")


def start_profiler(cfg: TrainConfig) -> Profiler | None:
    """With --profile: a started profiler (shardkit.tools is imported only then)."""
    if cfg.profile_dir is None:
        return None
    from shardkit.tools.track.profiler import Profiler

    if dist.get_rank() == 0:  # files of ranks this run lacks, left by a bigger earlier run
        for path in cfg.profile_dir.glob("rank-*.json"):
            number = path.stem.removeprefix("rank-")
            if number.isdigit() and int(number) >= dist.get_world_size():
                path.unlink()
    profiler = Profiler(comm=True, memory=True)
    profiler.start()
    return profiler


def write_profile(profiler: Profiler, folder: Path, reporter: Reporter) -> None:
    """Every rank writes its records; then rank 0 merges them into the report folder."""
    from shardkit.tools.report.folder import write_report
    from shardkit.tools.report.json_io import load_rank_reports, rank_report_path, write_rank_report
    from shardkit.tools.report.text import summarize

    profiler.stop()
    report = profiler.rank_report()
    write_rank_report(rank_report_path(folder, report.rank), report)
    dist.barrier()  # every rank's file is in place before rank 0 reads the folder
    if reporter.rank0:
        reports = load_rank_reports(folder)
        write_report(folder, reports)
        reporter.say(
            f"\n{summarize(reports)}\nprofile report (summary, JSON, trace, plots): {folder}"
        )
        reporter.record(event="profiled", path=str(folder))


def replica_count(cfg: TrainConfig) -> int:
    """--replicas, or with 0 the number of nodes torchrun launched (ranks per node from
    LOCAL_WORLD_SIZE): HSDP keeps the shard groups' traffic inside a node."""
    if cfg.replicas > 0:
        return cfg.replicas
    world = dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if per_node < 1 or world % per_node != 0:
        raise ValueError(f"LOCAL_WORLD_SIZE={per_node} does not divide the world size {world}")
    return world // per_node


def build_mesh(model_cfg: ModelConfig, cfg: TrainConfig) -> DeviceMesh:
    """("dp",) over every rank; ("dp_replicate", "dp_shard") for HSDP across nodes (the
    planner's and CommTracker's axis names: inter-node traffic is on dp_replicate); or
    ("dp", "tp") with tp ranks splitting each layer."""
    world = dist.get_world_size()
    replicas = replica_count(cfg)
    if replicas > 1 and cfg.tp > 1:
        raise ValueError(f"--tp {cfg.tp} with {replicas} HSDP replicas is not in the demo")
    if replicas > 1:
        if world % replicas != 0:
            raise ValueError(f"--replicas {replicas} must divide the world size {world}")
        shape = (replicas, world // replicas)  # a node's ranks are consecutive: one shard group
        return init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard"))
    if cfg.tp == 1:
        return init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    sizes = {"the world size": world, "n_heads": model_cfg.n_heads, "seq_len": model_cfg.seq_len}
    sizes |= {"vocab_size": model_cfg.vocab_size}
    for what, size in sizes.items():
        if size % cfg.tp != 0:
            raise ValueError(f"--tp {cfg.tp} must divide {what} ({size})")
    return init_device_mesh("cpu", (world // cfg.tp, cfg.tp), mesh_dim_names=("dp", "tp"))


def describe(mesh: DeviceMesh) -> str:
    """The mesh as the progress line shows it, e.g. 'dp_replicate 2 x dp_shard 2'."""
    names = mesh.mesh_dim_names or ()
    return " x ".join(f"{name} {size}" for name, size in zip(names, mesh.shape, strict=True))


def data_position(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's index among the data-parallel ranks, and their number. The ranks of one
    TP group work on the same rows, so data follows "dp" only; under HSDP every rank has its
    own rows, in the order of the global ranks, as in plain FSDP over the same ranks."""
    names = mesh.mesh_dim_names or ()
    if "tp" in names:
        dp_mesh = mesh["dp"]
        return dp_mesh.get_local_rank(), dp_mesh.size()
    return dist.get_rank(), dist.get_world_size()


def train(model_cfg: ModelConfig, cfg: TrainConfig) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    fully_shard = resolve_fully_shard(cfg.impl)
    mesh = build_mesh(model_cfg, cfg)
    dp_rank, dp_size = data_position(mesh)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank, before sharding
    model = GPT(model_cfg)
    n_params = sum(p.numel() for p in model.parameters())
    parallelize(model, mesh, fully_shard)
    state = TrainState(model, build_optimizer(model, cfg), rank)
    sampler = BatchSampler(
        data=load_corpus(cfg.corpus),
        seq_len=model_cfg.seq_len,
        batch_per_rank=cfg.batch_size,
        rank=dp_rank,
        world=dp_size,
        seed=cfg.seed,
    )
    reporter = Reporter(cfg, tokens_per_step=cfg.batch_size * dp_size * model_cfg.seq_len)
    reporter.say(
        f"impl={cfg.impl} ranks={world} ({describe(mesh)}) params={n_params:,} "
        f"corpus={sampler.data.numel():,} bytes tokens/step={reporter.tokens_per_step:,}"
    )
    restore(state, cfg, reporter)
    manager = CheckpointManager(cfg.ckpt_dir, keep=cfg.keep_ckpts) if cfg.ckpt_dir else None
    state.faults = Faults(rank)
    arm_model_faults(model, state.faults, state)
    profiler = start_profiler(cfg)
    while state.step < cfg.steps:
        result = train_step(state, sampler.batch(state.step + 1), cfg)
        reporter.step(state.step, result)
        if manager is None:
            continue
        # Asynchronous: the state is copied at the save and written while the next steps
        # train. It becomes current (atomically) at the first step after every rank's write
        # has finished: a job killed before then resumes from the previous checkpoint.
        report_published(manager.poll(), reporter)
        if (cfg.ckpt_every > 0 and state.step % cfg.ckpt_every == 0) or state.step == cfg.steps:
            report_published(manager.wait(), reporter)
            manager.save(state.step, checkpoint_contents(state), async_save=True)
    if manager is not None:
        report_published(manager.wait(), reporter)
    if profiler is not None:
        assert cfg.profile_dir is not None  # start_profiler returns one only then
        write_profile(profiler, cfg.profile_dir, reporter)
    if cfg.ckpt_dir is not None and cfg.impl == "shardkit":
        # The model alone, as one consolidated file any single process can load: streamed
        # through rank 0 one parameter group at a time (shardkit.core.save_full_state_dict).
        export = cfg.ckpt_dir / "model.safetensors"
        save_full_state_dict(model, export)
        reporter.record(event="exported", step=state.step, path=str(export))
        reporter.say(f"exported the full model to {export}")


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args() -> tuple[ModelConfig, TrainConfig]:
    model_defaults, train_defaults = ModelConfig(), TrainConfig()
    p = argparse.ArgumentParser(description="Train a small GPT with fully_shard on CPU ranks.")
    p.add_argument("--impl", choices=["shardkit", "torch"], default=train_defaults.impl)
    p.add_argument("--steps", type=int, default=train_defaults.steps, help="the step to stop at")
    p.add_argument("--ckpt-dir", type=Path, default=None)
    p.add_argument("--ckpt-every", type=int, default=train_defaults.ckpt_every)
    p.add_argument("--resume", action="store_true")
    p.add_argument(
        "--auto-resume",
        action="store_true",
        help="resume from the latest checkpoint if there is one (for torchrun --max-restarts)",
    )
    p.add_argument("--seed", type=int, default=train_defaults.seed)
    p.add_argument("--batch-size", type=int, default=train_defaults.batch_size)
    p.add_argument(
        "--tp", type=int, default=train_defaults.tp, help="tensor-parallel degree (dp = W / tp)"
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=train_defaults.replicas,
        help="HSDP replicas (default 0: one per torchrun node; 1: plain FSDP)",
    )
    p.add_argument("--lr", type=float, default=train_defaults.lr)
    p.add_argument("--log-every", type=int, default=train_defaults.log_every)
    p.add_argument("--metrics-file", type=Path, default=None)
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="profile the training loop; write the report (summary, JSON, trace, plots) to DIR",
    )
    p.add_argument("--corpus", type=Path, default=train_defaults.corpus)
    p.add_argument("--seq-len", type=int, default=model_defaults.seq_len)
    p.add_argument("--d-model", type=int, default=model_defaults.d_model)
    p.add_argument("--n-layers", type=int, default=model_defaults.n_layers)
    p.add_argument("--n-heads", type=int, default=model_defaults.n_heads)
    a = p.parse_args()
    model_cfg = ModelConfig(
        seq_len=a.seq_len, d_model=a.d_model, n_layers=a.n_layers, n_heads=a.n_heads
    )
    train_cfg = TrainConfig(
        impl=a.impl,
        steps=a.steps,
        batch_size=a.batch_size,
        tp=a.tp,
        replicas=a.replicas,
        lr=a.lr,
        seed=a.seed,
        corpus=a.corpus,
        ckpt_dir=a.ckpt_dir,
        ckpt_every=a.ckpt_every,
        resume=a.resume,
        auto_resume=a.auto_resume,
        log_every=a.log_every,
        metrics_file=a.metrics_file,
        profile_dir=a.profile,
    )
    return model_cfg, train_cfg


def init_distributed() -> None:
    """The gloo process group, on keys of this restart attempt only.

    Under `torchrun --max-restarts`, the workers of every attempt share the launcher's store,
    and torch's default init (env://) uses the same keys each time: a restarted worker can
    read the address its dead predecessor published and fail to connect ("Connection
    refused"), or wait forever in the store's barrier. Scoping the keys by the restart count
    makes every attempt rendezvous afresh. (Launching with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    does the same from outside: a new store per attempt.)
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group("gloo")
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # torch.distributed exports both stores at run time, without declaring them to type checkers.
    store = dist.TCPStore(host, port, world, is_master=False)  # type: ignore[attr-defined]
    scoped = dist.PrefixStore(f"demo/attempt_{attempt}", store)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=scoped, rank=rank, world_size=world)


def main() -> None:
    model_cfg, train_cfg = parse_args()
    init_distributed()
    try:
        train(model_cfg, train_cfg)
        # Leave together. A rank that runs ahead into interpreter shutdown while a gloo worker
        # thread still holds the last reference to a finished collective's tensor aborts with
        # "terminate called without an active exception": freeing the tensor's Python object needs
        # the GIL of an interpreter that is going away (seen about 1 run in 8 without this).
        # The barrier itself holds no tensor, and waiting for the slower rank gives the worker
        # thread time to let go of the last one.
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
