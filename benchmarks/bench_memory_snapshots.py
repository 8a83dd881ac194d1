"""Memory snapshots on the demo GPT at W=2: the step time they cost, and the restart they save.

1. **Step time** (``test_snapshot_step_time``), on the worker pool: the demo's own model
   (demo/model.py, 1.3M parameters), optimizer and training step, each rank its own "node"
   (a snapshot folder each, ``ranks_per_node=1``), so every snapshot is copied into shared
   memory, checksummed and exchanged with the other rank, as on two machines. Each round
   trains a block of steps without snapshots and a block with one every ``every`` steps (1,
   and 4 for the trade-off; the call timed with its step), alternating which block goes
   first; a block's figure is its mean step time on the slower rank (what throughput sees),
   and the ratio is the median of the rounds' ratios. The demo's batch (8 sequences of 128
   tokens per rank), and 32 per rank: a snapshot's work is fixed per step (the rank's share
   of the state), so its share of a longer step is smaller. And a snapshot every step with
   only every fourth replicated (``replicate_every=4``: a quarter of the exchange), and the
   same with the gradient log between (``optimizer=``: the steps between send their
   gradients, a third of the bytes; the blocks without snapshots take no gradients). Also
   timed, on the training thread: the state's ``state_dict()`` (the demo's,
   ``StateDictCache``) and the copy. And the CPU time a snapshot adds to a step, two ways:
   each process's, all its threads (``cpu_ms_added_per_step``: the difference of two blocks,
   as noisy as the step), and the snapshots' own (``snapshot_cpu_ms_per_step``: the training
   thread's time in ``snapshot()`` and in the gradient log's hook, and the CPU of the threads
   at the snapshots' niceness, which are theirs alone: the writer and the snapshot group's
   gloo threads), stable from block to block. On two cores that both train, that CPU is what
   a snapshot takes from training: the step with snapshots is about ``1 + snapshot CPU /
   a step's CPU`` of the step without, which the step times of a shared machine show only
   through their noise. Every block starts on a replicated step, so a block with the log
   replicates as many snapshots whole as steady training does.
2. **Restart** (``test_restart_time``): the demo as two torchrun "nodes" of one rank (as the
   snapshot soak runs it), killed once mid-forward at the same step, resumed by torchrun
   --max-restarts: from memory snapshots (every step), and from the disk checkpoint (every 10
   steps, asynchronous), alternating. Measured from the kill (the rig's kill log is written
   just before the SIGKILL) to the end of the first step after the restart, and to the end of
   the step that was killed (the steps lost recomputed); the restore itself as the demo logs
   it (``resumed ... in S s``).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from demo.run_demo import launch_lines

from benchmarks.snapshot_cpu import SnapshotCPU
from harness.pool import run_on_ranks

REPO = Path(__file__).resolve().parents[1]
BLOCK = 8  # steps per block
# Rounds of the step-time test (one block with snapshots and one without each), besides the
# warm-up's: more narrow the median on a busy machine (SHARDKIT_SNAPSHOT_ROUNDS=20: about 80 s
# a case here, against 45 s at the default).
ROUNDS = int(os.environ.get("SHARDKIT_SNAPSHOT_ROUNDS", "8"))
_STATE: dict[str, Any] = {}


def _setup(
    rank: int, world_size: int, root: str, every: int, batch: int, replicate_every: int, log: bool
) -> None:
    import torch
    from demo.batches import BatchSampler, load_corpus
    from demo.distributed import build_mesh
    from demo.train_gpt import (
        GPT,
        ModelConfig,
        TrainConfig,
        TrainState,
        build_optimizer,
        parallelize,
    )

    from shardkit.core import MemorySnapshots, fully_shard

    model_cfg, cfg = ModelConfig(), TrainConfig(batch_size=batch)
    mesh = build_mesh(model_cfg, tp=1, replicas=1)
    torch.manual_seed(cfg.seed)
    model = GPT(model_cfg)
    parallelize(model, mesh, fully_shard)
    _STATE.clear()
    _STATE["cfg"] = cfg
    _STATE["state"] = TrainState(model, build_optimizer(model, cfg))
    _STATE["sampler"] = BatchSampler(
        data=load_corpus(cfg.corpus),
        seq_len=model_cfg.seq_len,
        batch_per_rank=cfg.batch_size,
        rank=rank,
        world=world_size,
        seed=cfg.seed,
    )
    _STATE["snapshots"] = MemorySnapshots(
        "bench",
        directory=f"{root}/node{rank}",
        every=every,
        ranks_per_node=1,
        replicate_every=replicate_every,
        optimizer=_STATE["state"].optimizer if log else None,
    )
    _STATE["cpu"] = SnapshotCPU(_STATE["snapshots"], _STATE["state"].optimizer)
    # Warm-up (lazy init, the optimizer's state, the slots) up to a replicated step: every
    # block then starts on one (BLOCK is a multiple of replicate_every), so a block with
    # snapshots replicates as many whole as steady training does, not one more after the
    # steps without.
    _step(snapshot=True)
    while _STATE["state"].step <= every or (_STATE["state"].step + 1) % replicate_every:
        _step(snapshot=True)
    _STATE["snapshots"].wait()


def _step(*, snapshot: bool) -> float:
    from demo.train_gpt import train_step

    state, cfg = _STATE["state"], _STATE["cfg"]
    log = _STATE["snapshots"]._log
    started = time.perf_counter()
    if log is not None and not snapshot:  # the baseline pays no gradient capture either
        with log.replaying():
            train_step(state, _STATE["sampler"].batch(state.step + 1), cfg)
    else:
        train_step(state, _STATE["sampler"].batch(state.step + 1), cfg)
    if snapshot:
        _STATE["cpu"].snapshot(state.step, {"train": state})
    return time.perf_counter() - started


def _block(rank: int, world_size: int, snapshot: bool) -> tuple[float, float, float]:
    """The block's mean step time; this process's CPU time a step (all its threads); and
    the snapshots' own CPU time a step (their part of the training thread, their threads)."""
    import torch.distributed as dist

    dist.barrier()
    cpu, own = time.process_time(), _STATE["cpu"].total()
    seconds = [_step(snapshot=snapshot) for _ in range(BLOCK)]
    _STATE["snapshots"].wait()  # the last one's background work stays out of the next block
    own = _STATE["cpu"].total() - own
    return statistics.mean(seconds), (time.process_time() - cpu) / BLOCK, own / BLOCK


def _parts(rank: int, world_size: int) -> dict[str, float]:
    """The training thread's share of a snapshot: the state_dict() call, and the copy."""
    from shardkit.core.snapshots.contents import leaves_of

    state, snapshots = _STATE["state"], _STATE["snapshots"]
    writer = snapshots._writer  # the benchmark times the writer's own copy
    times: dict[str, list[float]] = {"state_dict_s": [], "copy_s": []}
    for _ in range(10):
        started = time.perf_counter()
        leaves = leaves_of({"train": state})
        between = time.perf_counter()
        writer._copier.copy(writer._own[0].data(), writer._views[0], leaves)
        times["state_dict_s"].append(between - started)
        times["copy_s"].append(time.perf_counter() - between)
    return {name: statistics.median(values) for name, values in times.items()}


def _teardown(rank: int, world_size: int) -> int:
    nbytes: int = _STATE["snapshots"].nbytes
    _STATE["snapshots"].close()
    _STATE.clear()
    return nbytes


@pytest.mark.parametrize(
    ("every", "batch", "replicate_every", "log"),
    [(1, 8, 1, False), (4, 8, 4, False), (1, 32, 1, False), (1, 8, 4, False), (1, 8, 4, True)],
    ids=["every-step", "every-4th", "every-step-batch-32", "every-4th-replicated", "gradient-log"],
)
def test_snapshot_step_time(
    benchmark: Any, every: int, batch: int, replicate_every: int, log: bool
) -> None:
    root = Path("/dev/shm") / f"shardkit-bench-{os.getpid()}"
    kwargs = {"every": every, "batch": batch, "replicate_every": replicate_every, "log": log}
    run_on_ranks(2, _setup, root=str(root), timeout_s=600, **kwargs)
    rounds: list[dict[str, float]] = []
    order = [False, True]

    def one_round() -> None:
        order.reverse()
        measured = {}
        for snapshot in order:
            measured[snapshot] = run_on_ranks(2, _block, snapshot=snapshot, timeout_s=600)
        rounds.append(
            {
                "without": max(wall for wall, _, _ in measured[False]),
                "with": max(wall for wall, _, _ in measured[True]),
                # CPU a snapshot adds a step, a rank's (the mean of the ranks'): what two busy
                # cores pay, which a shared machine's step times show only through their noise.
                "cpu_added": statistics.mean(
                    with_[1] - without[1]
                    for with_, without in zip(measured[True], measured[False], strict=True)
                ),
                "cpu_without": statistics.mean(cpu for _, cpu, _ in measured[False]),
                # The snapshots' own CPU a step (the mean of the ranks'), and what their
                # threads spent in the block without them (nothing, or a leftover).
                "snapshot_cpu": statistics.mean(own for _, _, own in measured[True]),
                "snapshot_cpu_without": statistics.mean(own for _, _, own in measured[False]),
            }
        )

    try:
        benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=1)
        parts = run_on_ranks(2, _parts)[0]
        nbytes = run_on_ranks(2, _teardown)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rounds = rounds[1:]  # not the warm-up
    ratios = [r["with"] / r["without"] for r in rounds]
    benchmark.extra_info.update(
        subject="shardkit",
        every=every,
        replicate_every=replicate_every,
        gradient_log=log,
        batch_per_rank=batch,
        step_with_snapshots_over_without=statistics.median(ratios),
        ratio_min=min(ratios),
        ratio_max=max(ratios),
        step_s=statistics.median(r["without"] for r in rounds),
        step_with_snapshots_s=statistics.median(r["with"] for r in rounds),
        cpu_ms_added_per_step=1e3 * statistics.median(r["cpu_added"] for r in rounds),
        cpu_ms_per_step_without=1e3 * statistics.median(r["cpu_without"] for r in rounds),
        snapshot_cpu_ms_per_step=1e3 * statistics.median(r["snapshot_cpu"] for r in rounds),
        snapshot_threads_cpu_ms_without=1e3
        * statistics.median(r["snapshot_cpu_without"] for r in rounds),
        shared_memory_mib_per_rank=nbytes / 2**20,
        **parts,
    )
    print(
        f"\nmemory snapshots every {every} step(s), replicated every {replicate_every}"
        f"{' with the gradient log between' if log else ''}, "
        f"demo GPT W=2, batch {batch} per rank:"
    )
    for r in rounds:
        print(f"  without {r['without']:.4f} s  with {r['with']:.4f} s  "
              f"ratio {r['with'] / r['without']:.3f}  "
              f"CPU added {1e3 * r['cpu_added']:.1f} ms a step, "
              f"the snapshots' own {1e3 * r['snapshot_cpu']:.1f} ms")  # fmt: skip
    print("  " + " ".join(f"{k}={v}" for k, v in benchmark.extra_info.items()))


# --- the restart ------------------------------------------------------------------------------

KILL_STEP = 27  # mid-forward; the disk checkpoint before it is step 20's
RESTART_STEPS = 32


def _restart(tmp: Path, name: str, memory: bool) -> dict[str, float]:
    """One two-node run killed once at KILL_STEP; the times from the kill, in seconds."""
    out = tmp / name
    metrics, log = out / "metrics.jsonl", out / "kills.log"
    out.mkdir(parents=True)
    shm = Path("/dev/shm") / f"shardkit-bench-{os.getpid()}-{name}"
    args = ["-m", "tests.demo.rig", f"--kill-at=0:{KILL_STEP}:forward", f"--kill-log={log}"]
    args += [f"--steps={RESTART_STEPS}", f"--ckpt-dir={out / 'ckpt'}", "--ckpt-every=10"]
    args += ["--auto-resume", f"--metrics-file={metrics}", "--replicas=1", "--log-every=10"]
    if memory:
        args += ["--snapshot-every=1", f"--snapshot-dir={shm}", f"--run-id={name}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        launches = [
            subprocess.Popen(
                [*line, "--max-restarts=1", *args],
                env=env,
                cwd=REPO,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for line in launch_lines(2, 1)
        ]
        assert all(launch.wait(timeout=900) == 0 for launch in launches), name
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    killed_at = log.stat().st_mtime
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    resumed = next(i for i, r in enumerate(records) if r.get("event") == "resumed")
    after = [r for r in records[resumed + 1 :] if "loss" in r]
    back = next(r for r in after if r["step"] == KILL_STEP)
    return {
        "to_first_step_s": after[0]["time"] - killed_at,
        "to_killed_step_s": back["time"] - killed_at,
        "restore_s": float(records[resumed]["seconds"]),
        "steps_lost": KILL_STEP - 1 - int(records[resumed]["step"]),
    }


def test_restart_time(benchmark: Any, tmp_path: Path) -> None:
    runs: dict[str, list[dict[str, float]]] = {"memory": [], "disk": []}
    order = ["memory", "disk"]

    def one_round() -> None:
        order.reverse()
        for name in order:
            index = len(runs[name])
            runs[name].append(_restart(tmp_path, f"{name}{index}", name == "memory"))

    benchmark.pedantic(one_round, rounds=2, iterations=1, warmup_rounds=0)

    def median(name: str, key: str) -> float:
        return float(statistics.median(r[key] for r in runs[name]))

    info = {f"{name}_{key}": median(name, key) for name in runs for key in runs[name][0]}
    benchmark.extra_info.update(subject="shardkit", **info)
    print(f"\nkill at step {KILL_STEP} (mid-forward), two torchrun nodes of one rank:")
    for name, measured in runs.items():
        for r in measured:
            print(f"  {name:6s} " + " ".join(f"{k}={v:.3f}" for k, v in r.items()))
    print("  " + " ".join(f"{k}={v}" for k, v in benchmark.extra_info.items()))
