"""Peak RSS of the FSDP1 script's training, per rank: run under torchrun.

Usage: torchrun --nproc-per-node 2 benchmarks/legacy_memory_run.py IMPL STEPS
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

from benchmarks import legacy_workload


def main() -> None:
    impl, steps = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with open("/proc/self/status") as f:
        baseline_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    model, opt = legacy_workload.setup(impl, rank)
    for step in range(steps):
        legacy_workload.timed_step(model, opt, legacy_workload.batch(step, rank, world))
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    record = {"rank": rank, "baseline_mib": baseline_kib / 1024, "peak_mib": peak_kib / 1024}
    sys.stdout.write(json.dumps(record) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
