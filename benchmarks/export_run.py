"""One weight-sync comparison at W=2: shardkit's export against trl's per-parameter pattern.

Usage: torchrun --nproc-per-node 2 benchmarks/export_run.py SIZE TRANSPORT ROUNDS [BUCKET_MIB]

SIZE is ``5m`` or ``150m`` (a Qwen2-style model from transformers, fp32 masters, sharded by
shardkit's ``fully_shard`` layer by layer). The receiver is a bf16 copy of the model (the
inference engine's stand-in) that takes tensors by name, as vLLM's ``load_weights`` does:

- ``colocated``: in rank 0's process;
- ``shm``: in another process on this host, through double-buffered shared memory;
- ``group``: in another process, over a gloo group of its own.

trl's pattern (trl 1.16, ``_iter_fsdp2_params`` then ``load_weights`` per tensor): every rank
gathers each parameter whole (``full_tensor()``, an fp32 all-gather), and rank 0 casts it to
bf16 and hands it over alone. Each round runs both, alternating which goes first; a sync's
time is its slowest rank's. Peak RSS is the high-water mark after a reset (/proc/self/
clear_refs), with MALLOC_MMAP_THRESHOLD_=65536 so freed memory shows: per rank, above each
sync's start and as a whole (VmHWM), for trl's pattern, a full export, and a delta export after
an AdamW step at lr 1e-6 (what it holds from the sync before, rank 1's kept part, is in the
whole, not in the rise; rank 0 compares with its receiver's copy and keeps none).
``BUCKET_MIB``: the exports' ``bucket_bytes`` (64 unless given). Prints one JSON line.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES: dict[str, dict[str, Any]] = {
    "5m": {
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "vocab_size": 4096,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
    },
    "150m": {
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 14,
        "vocab_size": 32000,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
    },
}


def build(size: str, dtype: torch.dtype) -> Any:
    """The Qwen2-style model of ``size``, seeded, untied head."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SIZES[size], tie_word_embeddings=False, max_position_embeddings=256)
    torch.manual_seed(0)
    model: Any = Qwen2ForCausalLM(config)
    return model.to(dtype=dtype)


def sharded(size: str, lr: float) -> tuple[Any, torch.optim.Optimizer]:
    """The model of ``size`` in fp32, sharded by shardkit per layer and at the root; AdamW."""
    from shardkit.core import fully_shard

    model = build(size, torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def train_step(model: Any, optimizer: torch.optim.Optimizer, size: str, rank: int) -> None:
    """One step on 64 tokens of this rank's (the same each time: a benchmark, not training)."""
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, SIZES[size]["vocab_size"], (1, 64), generator=g)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def reset_peak() -> float:
    """Reset this process's peak RSS; its RSS now (MiB)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS:")


def peak() -> float:
    """Peak RSS since the last reset (MiB)."""
    return _status("VmHWM:")


def slowest(seconds: float) -> float:
    value = torch.tensor([seconds])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def trl_sync(model: torch.nn.Module, receiver: Any) -> tuple[int, float]:
    """trl's pattern: one fp32 all-gather per parameter; rank 0 casts each to bf16 and hands
    it over alone (a bucket of one tensor, through the same receiver as the export's).

    Returns the bytes on the wire and rank 0's seconds in the receiver.
    """
    from torch.distributed.tensor import DTensor

    from shardkit.core.export import ExportedTensor, ExportManifest, WeightBucket

    state = model.state_dict(keep_vars=True)
    entries = tuple(
        ExportedTensor(name, tuple(p.shape), torch.bfloat16, i)
        for i, (name, p) in enumerate(state.items())
    )
    manifest = ExportManifest(trl_sync.count, "full", entries, len(entries))  # type: ignore[attr-defined]
    trl_sync.count += 1  # type: ignore[attr-defined]
    wire, handing = 0, 0.0

    def hand(work: Callable[[], None]) -> None:
        nonlocal handing
        start = time.perf_counter()
        work()
        handing += time.perf_counter() - start

    if receiver is not None:
        hand(lambda: receiver.begin(manifest))
    for i, (name, param) in enumerate(state.items()):
        full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        if isinstance(param, DTensor):
            wire += param.to_local().numel() * param.element_size() * (dist.get_world_size() - 1)
        if receiver is not None:
            bucket = WeightBucket(i, full=((name, full.to(torch.bfloat16)),))
            hand(functools.partial(receiver.receive, bucket))
        del full
    if receiver is not None:
        hand(receiver.finish)
    return wire, handing


trl_sync.count = 0  # type: ignore[attr-defined]


def main() -> None:
    size, transport, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    bucket_bytes = int(sys.argv[4] if len(sys.argv) > 4 else 64) * 2**20
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from shardkit.core.export.exporter import ExportOptions, WeightExporter

    model, optimizer = sharded(size, 1e-6)
    params = sum(p.numel() for p in model.parameters())
    receiver, closer = _receiver(transport, size) if rank == 0 else (None, lambda: None)
    # trl's hand-offs go to the same receiver (a colocated one: a model of its own).
    trl_receiver = (
        receiver
        if transport != "colocated"
        else (_receiver(transport, size)[0] if rank == 0 else None)
    )

    def step() -> None:
        train_step(model, optimizer, size, rank)

    step()  # warm-up: optimizer state, lazy init
    base = reset_peak()
    step()
    step_peak = peak() - base
    exporter = WeightExporter(model, ExportOptions(dtype=torch.bfloat16, bucket_bytes=bucket_bytes))
    exporter.export(receiver)  # warm-up: the export's groups
    rows: dict[str, list[float]] = {k: [] for k in ("trl", "trl_load", "ours", "ours_load")}
    ours_peak = trl_peak = ours_whole = trl_whole = 0.0
    wire_ours = wire_trl = 0
    for r in range(rounds):
        for impl in ("trl", "ours") if r % 2 == 0 else ("ours", "trl"):
            dist.barrier()
            base = reset_peak()
            start = time.perf_counter()
            if impl == "trl":
                wire, load = trl_sync(model, trl_receiver)
                sent_trl = torch.tensor([wire])
                dist.all_reduce(sent_trl)  # every rank sends: the bytes of all of them
                wire_trl = int(sent_trl)
            else:
                report = exporter.export(receiver)
                load = report.handoff_seconds
                sent = torch.tensor([0 if exporter.receiving else report.counts.sent_bytes])
                dist.all_reduce(sent)
                wire_ours = int(sent)
            seconds = slowest(time.perf_counter() - start)
            mine = peak() - base
            if impl == "trl":
                trl_peak, trl_whole = max(trl_peak, mine), max(trl_whole, peak())
            else:
                ours_peak, ours_whole = max(ours_peak, mine), max(ours_whole, peak())
            rows[impl].append(seconds)
            rows[impl + "_load"].append(float(slowest(load)))
    # A delta export after an AdamW step at lr 1e-6.
    exporter.export(receiver, delta=True)
    step()
    dist.barrier()
    base = reset_peak()
    delta_report = exporter.export(receiver, delta=True)
    delta_peak, delta_whole = peak() - base, peak()
    sent = torch.tensor([0 if exporter.receiving else delta_report.counts.sent_bytes])
    dist.all_reduce(sent)
    peaks = torch.tensor(
        [step_peak, ours_peak, trl_peak, delta_peak, ours_whole, trl_whole, delta_whole]
    )
    gathered = [torch.zeros(7) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, peaks)
    closer()
    if rank == 0:
        median = {k: statistics.median(v) for k, v in rows.items()}
        print(
            json.dumps(
                {
                    "size": size,
                    "transport": transport,
                    "params": params,
                    "model_bytes_bf16": params * 2,
                    "buckets": len(exporter.buckets),
                    "bucket_bytes": bucket_bytes,
                    "trl_s": median["trl"],
                    "trl_load_s": median["trl_load"],
                    "ours_s": median["ours"],
                    "ours_load_s": median["ours_load"],
                    "ours_export_s": median["ours"] - median["ours_load"],
                    "trl_export_s": median["trl"] - median["trl_load"],
                    "wire_ours": wire_ours,
                    "wire_trl": wire_trl,
                    "wire_delta": int(sent),
                    # per rank: the rise above the sync's start of a training step, a full
                    # export, trl's pattern, a delta; then the whole (VmHWM) of the last three
                    "peaks_mib": [[round(float(x), 1) for x in row] for row in gathered],
                    "delta_plain_buckets": delta_report.counts.plain_buckets,
                }
            )
        )
    dist.destroy_process_group()


def _receiver(transport: str, size: str) -> tuple[Any, Callable[[], None]]:
    """The receiver on rank 0, and what closes it: a bf16 model in place, here or in a
    process of its own (benchmarks/export_receiver.py) behind a transport."""
    from shardkit.core.export import (
        GroupSender,
        ModuleReceiver,
        ReceiverGroupSpec,
        SharedMemorySender,
    )

    if transport == "colocated":
        return ModuleReceiver(build(size, torch.bfloat16)), lambda: None
    folder = Path(tempfile.mkdtemp())
    script = str(Path(__file__).resolve().parent / "export_receiver.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if transport == "shm":
        authkey = os.urandom(16)
        env["SHARDKIT_BENCH_AUTHKEY"] = authkey.hex()
        address = str(folder / "receiver.sock")
        args = [size, "shm", address, str(folder / "ready")]
        process = subprocess.Popen([sys.executable, script, *args], env=env)
        _wait_ready(folder / "ready", process)
        sender: Any = SharedMemorySender(address, authkey, bound_s=300.0)
    elif transport == "group":
        sender = GroupSender(
            ReceiverGroupSpec(host="127.0.0.1", port=0, receivers=1, bound_s=300.0)
        )
        args = [size, "group", "127.0.0.1", str(sender.port), str(folder / "ready")]
        process = subprocess.Popen([sys.executable, script, *args], env=env)
    else:
        raise SystemExit(f"unknown transport {transport!r}")

    def close() -> None:
        sender.close(stop_serving=True)
        process.wait(timeout=60)

    return sender, close


def _wait_ready(ready: Path, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 300
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the receiving process did not start")
        time.sleep(0.05)


if __name__ == "__main__":
    main()
