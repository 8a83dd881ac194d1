"""One weight-sync mode into vLLM's CPU build at W=2, in fresh processes: the time per sync.

Usage: torchrun --nproc-per-node 2 benchmarks/export_vllm_run.py SIZE PLACEMENT MODE LR ROUNDS
DIR [BUCKET_MIB] (under .venv-vllm; ``benchmarks/bench_export_vllm.py`` runs every
combination). ``BUCKET_MIB``: the export's ``bucket_bytes`` (default 64, ``ExportOptions``'
default; trl's pattern has no buckets and ignores it).

The trainer is ``benchmarks/export_run.py``'s Qwen2-style model of ``SIZE`` (fp32 masters,
shardkit's ``fully_shard`` per layer, AdamW at ``LR``, one step before each sync). The engine
is a ``vllm.LLM`` (bf16, eager) started from the same initial weights saved in ``DIR``:

- ``colocated``: one engine in each trainer process (``external_launcher``, vLLM's engine
  core in the process), every rank receives;
- ``process``: one engine on rank 0 whose engine core runs in a process of its own (vLLM's
  default), reached through shardkit's worker extension.

``MODE`` is ``trl`` (trl 1.16's pattern: every rank walks ``named_parameters()`` and calls
``full_tensor()`` on each, an fp32 all-gather per parameter, streamed into the engine: in the
process, one ``reload_weights`` over a generator of them, as trl's per-parameter
``load_weights`` would be on a GPU build (vLLM's CPU build repacks layers after loading and
takes whole layers only); in another process, one RPC per parameter staged on the worker and
one commit, as trl's server mode sends one parameter per call), ``full`` or ``delta``
(``WeightExporter`` into ``vllm_receiver``, bf16; a delta's first sync is full), or
``streamed``: full exports into ``vllm_receiver(keep_mirror=False, all_or_nothing=False)``,
each bucket loaded as it arrives and no copy of the model kept (no deltas, no versions), or
``files``: delta exports into ``vllm_receiver(all_or_nothing=False, mirror_dir=DIR/mirror)``,
each bucket loaded as it arrives, the mirror in files (no versions), or ``versioned``: delta
exports into ``vllm_receiver(mirror_dir=DIR/mirror)``, all or nothing (versions), the mirror
in files and the staged export in files on the engine's worker.

Per sync: the whole sync (its slowest rank), the engine's load (the receiving ranks' slowest
time inside it) and the trainer side (the one less the other), the bytes the trainer ranks sent each
other, and each rank's peak RSS during the sync (VmHWM after a reset through
/proc/self/clear_refs, with MALLOC_MMAP_THRESHOLD_=65536 so that freed memory shows; the
engine core's own process is not a trainer rank and is not counted). The first sync of every
mode is a warm-up and is not reported. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

SIZE, PLACEMENT, MODE = sys.argv[1], sys.argv[2], sys.argv[3]
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if PLACEMENT == "colocated" else "1"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)

import torch  # noqa: E402 (vLLM reads the variables above once, at its import)
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.export_run import (  # noqa: E402
    build,
    peak,
    reset_peak,
    sharded,
    slowest,
    train_step,
)


def _engine(folder: Path) -> Any:
    from demo.grpo_vllm import start_engine

    from shardkit.core.export.vllm import EXTENSION

    if PLACEMENT == "colocated":
        return start_engine(folder, seed=0, max_num_seqs=4)
    return start_engine(
        folder, seed=0, shares_the_group=False, max_num_seqs=4, worker_extension_cls=EXTENSION
    )


class TrlPattern:
    """trl 1.16's sync (``_iter_fsdp2_params`` into the engine), adapted to the CPU build."""

    def __init__(self, model: torch.nn.Module, llm: Any) -> None:
        from shardkit.core.export.vllm_rpc import EngineCalls

        self.model, self.llm = model, llm
        self.calls = EngineCalls(llm) if llm is not None and PLACEMENT == "process" else None
        self.version = 1_000_000
        self.gathering = 0.0

    def _params(self) -> Iterator[tuple[str, torch.Tensor]]:
        from torch.distributed.tensor import DTensor

        for name, param in self.model.named_parameters():
            start = time.perf_counter()
            full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
            self.gathering += time.perf_counter() - start
            yield name, full

    def sync(self) -> tuple[float, float, int]:
        """(seconds, of which in the engine, bytes this rank sent)."""
        from safetensors.torch import save as save_safetensors
        from torch.distributed.tensor import DTensor

        from shardkit.core.export.vllm_worker import load_on_worker

        self.gathering = 0.0
        start = time.perf_counter()
        if self.llm is None:
            for _ in self._params():  # take part in every gather
                pass
            engine = 0.0
        elif self.calls is None:
            # A generator into the in-process worker: each parameter is gathered as the
            # engine's loader asks for it; the engine's time is the rest.
            self.llm.collective_rpc(load_on_worker, args=("reload_weights", self._params()))
            engine = time.perf_counter() - start - self.gathering
        else:
            self.version += 1
            engine = 0.0
            for name, full in self._params():
                begin = time.perf_counter()
                self.calls.stage(self.version, save_safetensors({name: full}))
                engine += time.perf_counter() - begin
            begin = time.perf_counter()
            self.calls.commit(self.version, "reload_weights")
            engine += time.perf_counter() - begin
        seconds = time.perf_counter() - start
        world = dist.get_world_size()
        sent = sum(
            p.to_local().numel() * p.element_size() * (world - 1)
            for p in self.model.parameters()
            if isinstance(p, DTensor)
        )
        return seconds, engine, sent


def main() -> None:
    lr, rounds, folder = float(sys.argv[4]), int(sys.argv[5]), Path(sys.argv[6])
    bucket_mib = int(sys.argv[7]) if len(sys.argv) > 7 else 64
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    from shardkit.core.export.exporter import ExportOptions, WeightExporter
    from shardkit.core.export.vllm import vllm_receiver

    if rank == 0 and not (folder / "config.json").exists():
        build(SIZE, torch.bfloat16).save_pretrained(folder)
    dist.barrier()
    model, optimizer = sharded(SIZE, lr)
    engine = None
    if PLACEMENT == "colocated":
        engine = _engine(folder)
    elif rank == 0:
        # The engine core's own process is a world of one: torchrun's variables stay here.
        names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT")
        saved = {n: os.environ.pop(n) for n in names if n in os.environ}
        engine = _engine(folder)
        os.environ.update(saved)
    to: Literal["first", "all"] = "all" if PLACEMENT == "colocated" else "first"
    options = ExportOptions(dtype=torch.bfloat16, to=to, bucket_bytes=bucket_mib * 2**20)
    exporter = WeightExporter(model, options)
    kept, staged = MODE != "streamed", MODE not in ("streamed", "files")
    mirror_dir = folder / "mirror" if MODE in ("files", "versioned") else None
    receiver = (
        vllm_receiver(engine, keep_mirror=kept, all_or_nothing=staged, mirror_dir=mirror_dir)
        if engine is not None
        else None
    )
    trl = TrlPattern(model, engine)
    rows: list[dict[str, Any]] = []
    first: dict[str, Any] = {}
    for r in range(rounds + 1):
        train_step(model, optimizer, SIZE, rank)
        dist.barrier()
        base = reset_peak()
        if MODE == "trl":
            seconds, engine_s, sent = trl.sync()
            plain = 0
        else:
            begin = time.perf_counter()
            report = exporter.export(receiver, delta=MODE in ("delta", "files", "versioned"))
            seconds, engine_s = time.perf_counter() - begin, report.handoff_seconds
            sent, plain = report.counts.sent_bytes, report.counts.plain_buckets
        top = peak()
        # A rank that does not receive waits for the one that does: the trainer side is the
        # whole sync less the engine's part, not each rank's own difference.
        whole, load = slowest(seconds), slowest(engine_s)
        trainer_side = whole - load
        wire = torch.tensor([sent])
        dist.all_reduce(wire)
        peaks = [torch.zeros(2) for _ in range(dist.get_world_size())]
        dist.all_gather(peaks, torch.tensor([top, top - base]))
        row = {
            "sync_s": whole,
            "trainer_s": trainer_side,
            "engine_s": load,
            "bytes": int(wire),
            "plain_buckets": plain,
            "peak_rss_mib": [round(float(p[0]), 1) for p in peaks],
            "peak_above_start_mib": [round(float(p[1]), 1) for p in peaks],
        }
        if r:  # the first sync warms up (and a delta's first is full)
            rows.append(row)
        else:  # reported apart: a receiver's first sync may hold what later ones do not
            first = row
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        line = dict(size=SIZE, placement=PLACEMENT, mode=MODE, lr=lr, params=params, rows=rows)
        line["first_sync"] = first
        line.update(bucket_mib=bucket_mib, buckets=len(exporter.buckets))
        print(json.dumps(line), flush=True)
    if PLACEMENT == "process" and engine is not None:
        # The engine core's process would outlive this one (and hold its caller's pipes).
        engine.llm_engine.engine_core.shutdown()
    dist.destroy_process_group()
    os._exit(0)  # vLLM's threads (and an engine core's client) would hold the exit


if __name__ == "__main__":
    main()
