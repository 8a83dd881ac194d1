"""One implementation's full-state-dict save on rank 0: time and peak RSS above the start.

Usage: torchrun --nproc-per-node 2 benchmarks/full_state_dict_run.py IMPL SIZE OUTDIR
IMPL 'shardkit' streams with save_full_state_dict; 'torch' is torch's fully_shard with
get_model_state_dict(full_state_dict=True, cpu_offload=True) then torch.save on rank 0.
Prints one JSON line from rank 0.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import gpt
from shardkit.tools.plan.gpt import GPT


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def _save(impl: str, model: object, path: Path) -> None:
    if impl == "shardkit":
        from shardkit.core import save_full_state_dict

        assert isinstance(model, torch.nn.Module)
        save_full_state_dict(model, path)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    assert isinstance(model, torch.nn.Module)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if dist.get_rank() == 0:
        torch.save(state, path)
    del state
    dist.barrier()


def main() -> None:
    impl, size, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, _ = gpt.build(impl, size, dist.get_world_size())
    path = out / f"full_{impl}.{'safetensors' if impl == 'shardkit' else 'pt'}"
    times, peaks = [], []
    for _ in range(3):
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
        start_rss = _status("VmRSS")
        started = time.perf_counter()
        _save(impl, model, path)
        times.append(time.perf_counter() - started)
        peaks.append(_status("VmHWM") - start_rss)
    model_mib = sum(p.numel() * p.element_size() for p in GPT(gpt.SIZES[size].model).parameters())
    if dist.get_rank() == 0:
        record = {
            "impl": impl,
            "seconds": statistics.median(times),
            "peak_above_start_mib": max(peaks),
            "model_mib": model_mib / 2**20,
            "file_mib": path.stat().st_size / 2**20,
        }
        sys.stdout.write(json.dumps(record) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
