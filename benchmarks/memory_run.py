"""One implementation's peak RSS per rank: run under torchrun with MALLOC_MMAP_THRESHOLD_ set.

Usage: torchrun --nproc-per-node 2 benchmarks/memory_run.py IMPL SIZE STEPS [OPTION ...]
OPTION: ``bf16`` (bf16 parameters, fp32 reduction) or ``keep`` (reshard_after_forward=False).
Prints one JSON line per rank: {"rank", "baseline_mib", "peak_mib"}.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import gpt


def rss_kib() -> int:
    """This process's resident set size now (KiB)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def report_peak(rank: int, baseline_kib: int) -> None:
    """Print this rank's JSON record (baseline and peak RSS, MiB) and leave the group."""
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    record = {"rank": rank, "baseline_mib": baseline_kib / 1024, "peak_mib": peak_kib / 1024}
    sys.stdout.write(json.dumps(record) + "\n")
    dist.destroy_process_group()


def main() -> None:
    impl, size, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    options = gpt.Options(
        bf16="bf16" in sys.argv[4:], reshard_after_forward="keep" not in sys.argv[4:]
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    baseline_kib = rss_kib()
    model, opt = gpt.build(impl, size, world, options)
    for step in range(steps):
        gpt.train_step(model, opt, gpt.batch(size, step, rank, world))
    report_peak(rank, baseline_kib)


if __name__ == "__main__":
    main()
