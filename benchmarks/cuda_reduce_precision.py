"""Compressed gradient reduction on a device: its kernels' time beside NCCL's reduce-scatters.

One rank (``torchrun --nproc-per-node 1``, NCCL on CUDA, gloo with ``--device cpu``): for a
row of gradients, times NCCL's float32 and bfloat16 ``reduce_scatter_tensor`` beside the
compressed path, timed the way the engine runs it: encode the W rows
(``engine/reduce/wire.py``), ``all_to_all_single`` the bytes, decode and sum in float32. At
W=1 the collectives move nothing: what is timed is each path's launches and kernels, the cost
the compressed path adds on the device. The bytes each would send at W ranks are counted from
the formats. Prints one JSON line per (numel, mode); ``make check-gpu`` runs it (chunk
``reduce-precision``), ``--device cpu`` is its smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from shardkit.core.engine.reduce.wire import WireFormat

MODES: dict[str, WireFormat | torch.dtype] = {
    "nccl fp32 reduce-scatter": torch.float32,
    "nccl bf16 reduce-scatter": torch.bfloat16,
    "bf16 wire, fp32 sum": WireFormat(torch.bfloat16),
    "int8 wire (256), fp32 sum": WireFormat(torch.int8, 256),
}


def _native(rows: torch.Tensor, dtype: torch.dtype) -> Callable[[], None]:
    sent = rows.to(dtype).view(-1)
    out = torch.empty(rows.shape[1], dtype=dtype, device=rows.device)

    def run() -> None:
        dist.reduce_scatter_tensor(out, sent)

    return run


def _compressed(rows: torch.Tensor, fmt: WireFormat) -> Callable[[], None]:
    world, numel = rows.shape
    encoded = torch.empty(world, fmt.row_bytes(numel), dtype=torch.uint8, device=rows.device)
    received = torch.empty_like(encoded)

    def run() -> None:
        fmt.encode(rows, encoded)
        dist.all_to_all_single(received.view(-1), encoded.view(-1))
        fmt.decode(received, numel).sum(dim=0)

    return run


def _time(fn: Callable[[], None], device: torch.device, iterations: int) -> float:
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(iterations):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / iterations


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--numels", type=int, nargs="+", default=[16 * 2**20, 64 * 2**20])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--world", type=int, default=64, help="the W the bytes are counted at")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        for numel in args.numels:
            rows = torch.randn(1, numel, device=device)  # W=1: this rank's one row
            for mode, how in MODES.items():
                if isinstance(how, torch.dtype):
                    fn, row_bytes = _native(rows, how), numel * how.itemsize
                else:
                    fn, row_bytes = _compressed(rows, how), how.row_bytes(numel)
                seconds = _time(fn, device, args.iterations)
                record = {
                    "numel": numel,
                    "mode": mode,
                    "ms": seconds * 1e3,
                    "sent_bytes_at_w": (args.world - 1) * row_bytes // args.world,
                    "world": args.world,
                }
                sys.stdout.write(json.dumps(record) + "\n")
                sys.stdout.flush()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
