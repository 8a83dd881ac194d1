"""Step time and peak memory of rank 0 of W ranks, simulated on torch's fake process group.

Usage::

    python benchmarks/fake_scale.py IMPL SIZE WORLD [IMPL SIZE WORLD ...]
        [--device cuda|cpu] [--steps 5] [--warmup 2] [--float8]

One process simulates rank 0 of a world of W (``dist.init_process_group("fake", ...)``, as
torchtitan's dry runs and Megatron's ``--fake-process-group`` do): every collective returns at
once and moves no data, so what remains is this rank's own work, whatever W: the kernels, the
CPU time spent launching them, and the memory. The model is built on the meta device and
materialized after sharding (1/W of its parameters), with bf16 mixed precision and activation
checkpointing around each block. Prints one JSON line per point (IMPL SIZE WORLD triple), each
measured after the previous one's model and optimizer are gone; for peak memory that is not
the whole story on CUDA (the caching allocator keeps blocks), so scripts/check_gpu.py runs one
point per process. Losses are meaningless: the gathered parameters are whatever the buffers
held. See [Note: gpu schedule] for what a fake group cannot show.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import gpt

OPTIONS = gpt.Options(bf16=True, checkpoint=True, meta=True)


class Point(NamedTuple):
    impl: str  # "shardkit" or "torch"
    size: str  # a size of benchmarks/gpt.py
    world: int


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(
    point: Point, *, device: str, steps: int, warmup: int, float8: bool = False
) -> dict[str, Any]:
    """Time ``steps`` training steps of ``point`` after ``warmup`` on a fresh fake group.

    ``float8``: torchao's Float8 training with float8 all-gather on top (issue 31's point:
    bf16 mixed precision, no activation checkpointing).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    options = replace(OPTIONS, float8=True, checkpoint=False) if float8 else OPTIONS
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=point.world)
    try:
        model, opt = gpt.build(point.impl, point.size, point.world, options, device=device)
        local_params = sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters()
        )
        for step in range(warmup):
            gpt.train_step(model, opt, gpt.batch(point.size, step, 0, point.world).to(device))
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for step in range(steps):
            data = gpt.batch(point.size, warmup + step, 0, point.world).to(device)
            _sync(device)
            started = time.perf_counter()
            gpt.train_step(model, opt, data)
            _sync(device)
            times.append(time.perf_counter() - started)
        record: dict[str, Any] = {
            **point._asdict(),
            "device": device,
            "step_s": statistics.median(times),
            "steps": steps,
            "local_params": local_params,
            "float8_linears": sum(type(m).__name__ == "Float8Linear" for m in model.modules()),
            "torch": torch.__version__,
        }
        if device == "cuda":
            record["peak_alloc_bytes"] = torch.cuda.max_memory_allocated()
            record["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
            record["gpu"] = torch.cuda.get_device_name()
            # Whether the caching allocator had to free and retry (memory pressure: slow
            # steps) or went to the driver, over the whole run: the step ratio's context.
            stats = torch.cuda.memory_stats()
            for key in ("num_alloc_retries", "num_device_alloc", "num_device_free"):
                record[key] = stats.get(key, 0)
            # The bytes the tensors asked for: the allocated peak counts whole blocks, and a
            # cached block too little larger to split counts in full (issue 64: shardkit's
            # allocated peak above torch's with no more live bytes on a CPU).
            record["peak_requested_bytes"] = stats.get("requested_bytes.all.peak", 0)
        else:
            # The process's peak RSS (KiB on Linux): all points so far, torch included.
            record["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        del model, opt
        return record
    finally:
        dist.destroy_process_group()
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def _points(words: list[str]) -> list[Point]:
    if len(words) % 3:
        raise SystemExit("points come as IMPL SIZE WORLD triples")
    points = []
    for impl, size, world in zip(words[::3], words[1::3], words[2::3], strict=True):
        if impl not in ("shardkit", "torch") or size not in gpt.SIZES:
            raise SystemExit(f"unknown point {impl} {size} {world}")
        points.append(Point(impl, size, int(world)))
    return points


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("points", nargs="+", help="IMPL SIZE WORLD, repeated")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--float8", action="store_true", help="torchao Float8 training, float8 all-gather"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda":
        torch.cuda.set_device(0)
    for point in _points(args.points):
        record = measure(
            point, device=args.device, steps=args.steps, warmup=args.warmup, float8=args.float8
        )
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
