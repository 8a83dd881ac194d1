"""The benchmark model and workload: shardkit.tools' GPT (about 8.45M parameters by default;
"medium" about 35M, "large" about 134M; for GPUs, the models of issue 31: "217m", and "7.5b"
and "70b" built on the meta device, which only a sharded engine materializes, 1/W of them)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from shardkit.tools.plan.gpt import GPT, GPTConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class Size:
    model: GPTConfig
    batch: int  # per rank


SIZES = {
    "small": Size(
        model=GPTConfig(vocab_size=4096, dim=256, n_layers=8, n_heads=4, max_seq_len=128), batch=4
    ),
    "medium": Size(
        model=GPTConfig(vocab_size=8192, dim=512, n_layers=8, n_heads=8, max_seq_len=128), batch=2
    ),
    # GPT-2 small's blocks (12 x 768 wide) with a 32k vocabulary, head untied: 134.3M.
    "large": Size(
        model=GPTConfig(vocab_size=32000, dim=768, n_layers=12, n_heads=12, max_seq_len=128),
        batch=1,
    ),
    # The GPU models of issue 31: a plain pre-norm decoder at three scales.
    "217m": Size(
        model=GPTConfig(vocab_size=32000, dim=1024, n_layers=12, n_heads=16, max_seq_len=1024),
        batch=8,
    ),
    "7.5b": Size(
        model=GPTConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, max_seq_len=2048),
        batch=1,
    ),
    "70b": Size(
        model=GPTConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, max_seq_len=2048),
        batch=1,
    ),
    # The 7.5B model's 32 blocks at a width whose compute is next to nothing: a step's host
    # time (hooks, dispatch, launches) on the fake group (benchmarks/bench_host_time.py).
    "host-32": Size(
        model=GPTConfig(vocab_size=1024, dim=256, n_layers=32, n_heads=4, max_seq_len=32), batch=1
    ),
    # The demo GPT's shape (demo/model.py: 1.3M parameters, 8 sequences of 128 per rank):
    # memory snapshots on a host whose cores do not all train (check-gpu's memory-snapshots-host).
    "demo": Size(
        model=GPTConfig(vocab_size=256, dim=128, n_layers=6, n_heads=4, max_seq_len=128), batch=8
    ),
    # The fake-group points' peak memory against torch's on a CPU (issue 64's test,
    # tests/core/interop/test_fake_scale_memory.py): the 217M and 7.5B models' plain decoder,
    # narrow enough for the CPU, wide enough that every shard of a 1-D parameter at W=64 is a
    # multiple of 16 bytes, as at the GPU points.
    "fake-scale-cpu": Size(
        model=GPTConfig(vocab_size=4096, dim=256, n_layers=4, n_heads=4, max_seq_len=128), batch=2
    ),
    # The fake-group benchmark's smoke test on a CPU (scripts/check_gpu.py --cpu-smoke).
    "fake-tiny": Size(
        model=GPTConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, max_seq_len=32), batch=2
    ),
}


class TinyLayers(nn.Module):
    """Many tiny layers (48 x [LayerNorm(32), Linear(32, 32)]): per-call overhead dominates."""

    def __init__(self, depth: int = 48, dim: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim)) for _ in range(depth)
        )
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return cast(torch.Tensor, self.head(x))


class Linears(nn.Module):
    """Eight Linear(128, 128) layers, each its own group: a small model where a few per-collective
    costs (desync checks) weigh against little compute."""

    def __init__(self, depth: int = 8, dim: int = 128) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


# The models that are not a GPT: name -> (constructor, input width).
_SMALL_MODELS: dict[str, tuple[type[nn.Module], int]] = {
    "tiny": (TinyLayers, 32),
    "linear8": (Linears, 128),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Options:
    """How the FSDPs are applied in a scenario."""

    reshard_after_forward: bool = True
    bf16: bool = False  # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    offload: bool = False  # torch's CPUOffloadPolicy(pin_memory=True), on either engine
    checkpoint: bool = False  # activation checkpointing around each block
    meta: bool = False  # built on the meta device, materialized after sharding (1/W of it)
    compile: bool = False  # torch.compile each block before sharding (torchtitan's order)
    float8: bool = False  # torchao Float8 training of the blocks' linears, float8 all-gather


def build(
    impl: str,
    size_name: str,
    world_size: int,
    options: Options | None = None,
    device: str = "cpu",
    left_whole: Callable[[str, torch.Tensor], bool] | None = None,
) -> tuple[Any, torch.optim.Optimizer]:
    """The model wrapped by ``impl`` and AdamW.

    ``impl``: 'shardkit', 'torch' (torch's fully_shard), 'fsdp1' (torch's
    FullyShardedDataParallel), 'ddp' or 'local' (no wrapper). ``device``: 'cpu' (gloo) or
    'cuda' (NCCL; the current CUDA device must be set already). ``left_whole`` (a sharded
    engine only): the parameters, by name, that ``fully_shard`` leaves alone
    (``ignored_params``: not sharded, not reduced), for a caller that moves them itself.
    """
    from torch.distributed.device_mesh import init_device_mesh

    options = options or Options()
    torch.manual_seed(0)
    if options.meta and impl not in ("shardkit", "torch"):
        raise ValueError(f"a meta-device build needs a sharded engine, not {impl!r}")
    with torch.device("meta" if options.meta else "cpu"):
        model: Any = _model(size_name)
    if not options.meta:
        model = model.to(device)
    if options.float8:
        _to_float8(model)
    if options.checkpoint:
        # torchtitan's activation checkpointing: torch's (non-reentrant) wrapper on each block.
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    if options.compile:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block)
    if impl == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    elif impl == "fsdp1":
        model = _wrap_fsdp1(model, options, device)
    elif impl in ("shardkit", "torch"):
        import torch.distributed.fsdp as torch_fsdp

        import shardkit.core as shardkit_core

        api: Any = shardkit_core if impl == "shardkit" else torch_fsdp
        kwargs: dict[str, Any] = {"reshard_after_forward": options.reshard_after_forward}
        if options.bf16:
            kwargs["mp_policy"] = api.MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        if options.offload:
            # torch's class for both engines, as code that swapped only fully_shard's import
            # passes it (shardkit ignored torch's class until 2026-11-27)
            kwargs["offload_policy"] = torch_fsdp.CPUOffloadPolicy(pin_memory=True)
        mesh = init_device_mesh(device, (world_size,))
        whole = {id(p) for n, p in model.named_parameters() if left_whole and left_whole(n, p)}

        def left_alone(module: nn.Module) -> dict[str, Any]:  # passed only where there are any
            ignored = {p for p in module.parameters() if id(p) in whole}
            return {"ignored_params": ignored} if ignored else {}

        for block in model.blocks:
            api.fully_shard(block, mesh=mesh, **left_alone(block), **kwargs)
        api.fully_shard(model, mesh=mesh, **left_alone(model), **kwargs)
        if options.meta:
            model.to_empty(device=device)
            _init_sharded(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def _to_float8(model: nn.Module) -> None:
    """torchao's Float8 training (issue 31's Float8 point): the blocks' linear layers compute
    in float8 and their weights are all-gathered in float8; the embedding and head stay."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(
        model, config=config, module_filter_fn=lambda _module, fqn: fqn.startswith("blocks.")
    )


def _init_sharded(model: nn.Module) -> None:
    """Initialize each rank's shards in place (the values matter little: timings and memory)."""
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.normal_(0.0, 0.02)
        for b in model.buffers():
            b.zero_()


def _wrap_fsdp1(model: nn.Module, options: Options, device: str) -> Any:
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    blocks: Any = model.blocks
    block_type: type[nn.Module] = type(blocks[0])
    strategy = (
        ShardingStrategy.FULL_SHARD
        if options.reshard_after_forward
        else ShardingStrategy.SHARD_GRAD_OP
    )
    mp = (
        MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if options.bf16
        else None
    )
    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy({block_type}),
        use_orig_params=True,
        device_id=torch.device(device) if device == "cpu" else torch.cuda.current_device(),
        sharding_strategy=strategy,
        mixed_precision=mp,
    )


def _model(size_name: str) -> nn.Module:
    if size_name in _SMALL_MODELS:
        return _SMALL_MODELS[size_name][0]()
    return GPT(SIZES[size_name].model)


def batch(size_name: str, step: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's rows of the global batch of ``step``."""
    gen = torch.Generator().manual_seed(step)
    if size_name in _SMALL_MODELS:
        width = _SMALL_MODELS[size_name][1]
        return torch.randn(8 * world_size, width, generator=gen)[rank * 8 : (rank + 1) * 8]
    size = SIZES[size_name]
    shape = (size.batch * world_size, size.model.max_seq_len + 1)
    idx = torch.randint(0, size.model.vocab_size, shape, generator=gen)
    return idx[rank * size.batch : (rank + 1) * size.batch]


def wire_bytes() -> int:
    """Bytes this process has written (gloo's socket writes dominate during a step)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar"):
                return int(line.split()[1])
    return 0


def train_step(model: Any, opt: torch.optim.Optimizer, data: torch.Tensor) -> dict[str, float]:
    """One timed step: zero_grad, forward, loss, backward, optimizer step, loss.item()."""
    start_bytes = wire_bytes()
    start = time.perf_counter()
    opt.zero_grad()
    if data.is_floating_point():  # the tiny-layers model: a regression loss
        loss = model(data).float().pow(2).mean()
    else:
        out = model(data[:, :-1])
        loss = F.cross_entropy(out.float().reshape(-1, out.size(-1)), data[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    value = loss.item()
    return {
        "seconds": time.perf_counter() - start,
        "wire_bytes": float(wire_bytes() - start_bytes),
        "loss": value,
    }


def param_count(size_name: str) -> int:
    return sum(p.numel() for p in _model(size_name).parameters())


def largest_group_params(size_name: str) -> int:
    """Parameters of the largest fully_shard group (the root: embeddings, final norm, head)."""
    model = GPT(SIZES[size_name].model)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    root = sum(p.numel() for p in model.parameters()) - block * len(model.blocks)
    return max(block, root)
