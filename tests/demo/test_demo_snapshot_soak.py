"""Soak with memory snapshots: `make soak`'s kills on two torchrun "nodes", plus a node lost.

The demo trains 300 steps at W=2 as two torchrun launches of one rank each (two "nodes" on this
machine, plain FSDP across them: --replicas=1), with asynchronous disk checkpoints every 10
steps and a memory snapshot after every step (--snapshot-every=1), each replicated to the
other node. The kills are `make soak`'s (tests/demo/test_demo_soak.py's kill points, the same
seed), plus one more: a node lost, whose snapshot folder is wiped before its rank is killed
mid-forward, so that it restores from its peer's replica. torchrun restarts both nodes each
time and the demo resumes from the newest step every rank holds. The loss curve, every loss
recomputed after a restart, and the exported model must equal an uninterrupted run's (one
torchrun of two ranks, no snapshots), bit for bit; each kill may lose at most one step (the
disk path loses 5 to 13). Prints the steps lost per kill. Slow (minutes): `make soak`.

A short variant runs in the default suite: 30 steps, a node lost and a kill mid-forward.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from demo.run_demo import launch_lines

from tests.demo.rig import KillPoint
from tests.demo.soak import EVERY, SMALL, STEPS, check_against_reference, kill_points

REPO = Path(__file__).resolve().parents[2]


def _with_a_node_lost(kills: list[KillPoint], seed: int) -> list[KillPoint]:
    """The soak's kills, and a node lost mid-forward in a checkpoint interval none of them uses."""
    rng = random.Random(seed + 1)
    used = {k.step // EVERY for k in kills}
    free = [i for i in range(3, STEPS // EVERY - 1) if not used & {i - 1, i, i + 1}]
    slot = rng.choice(free)
    lost = KillPoint(rng.randrange(2), slot * EVERY + rng.randrange(1, EVERY), "node")
    return sorted([*kills, lost], key=lambda k: k.step)


def _run(tmp: Path, name: str, *, steps: int, nodes: int, restarts: int, extra: list[str]) -> Path:
    """The demo (through the rig when ``extra`` has kill points) on 2 ranks; its metrics file."""
    metrics = tmp / f"{name}.jsonl"
    script = ["-m", "tests.demo.rig"] if nodes > 1 else [str(REPO / "demo" / "train_gpt.py")]
    args = [f"--steps={steps}", f"--ckpt-dir={tmp / name}", f"--ckpt-every={EVERY}"]
    args += ["--auto-resume", f"--metrics-file={metrics}", *SMALL, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launches = [
        subprocess.Popen(
            [*line, f"--max-restarts={restarts}", *script, *args],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for line in launch_lines(nodes, 2 // nodes)
    ]
    outputs = [launch.communicate(timeout=1800)[0] for launch in launches]
    for launch, output in zip(launches, outputs, strict=True):
        assert launch.returncode == 0, output[-4000:]
    return metrics


# How the snapshots reach the other node: each one whole, or every fourth whole and a log of
# the steps' gradients between (--snapshot-log: a lost node's rank replays it).
REPLICATION = {"whole": [], "log": ["--snapshot-replicate-every=4", "--snapshot-log"]}


def _soak(tmp_path: Path, steps: int, kills: list[KillPoint], replication: str) -> None:
    """The uninterrupted run, then the killed one on two nodes; every check, and the table."""
    started = time.monotonic()
    reference = _run(tmp_path, "ref", steps=steps, nodes=1, restarts=0, extra=[])
    reference_s = time.monotonic() - started
    log, memory = tmp_path / "kills.log", Path("/dev/shm") / f"shardkit-soak-{os.getpid()}"
    rig = [f"--kill-at={','.join(map(str, kills))}", f"--kill-log={log}", "--replicas=1"]
    rig += ["--snapshot-every=1", f"--snapshot-dir={memory}", "--run-id=soak"]
    rig += REPLICATION[replication]
    try:
        restarts = len(kills) + 1
        metrics = _run(tmp_path, "soak", steps=steps, nodes=2, restarts=restarts, extra=rig)
    finally:
        leftover = sorted(p.name for p in memory.rglob("*")) if memory.exists() else []
        shutil.rmtree(memory, ignore_errors=True)
    soak_s = time.monotonic() - started - reference_s

    assert log.read_text().split() == [str(k) for k in kills]  # each fired, once, in order
    assert leftover == [], leftover  # close() freed the shared memory
    resumes = check_against_reference(reference, metrics, tmp_path / "ref", tmp_path / "soak")
    lost = [(r.done, r.step, r.path, r.seconds) for r in resumes]

    print(f"\nsnapshot soak: {steps} steps, W=2 on two torchrun nodes, a memory snapshot every")
    print(f"step ({replication}), disk checkpoints every {EVERY} (async), {len(kills)} kills")
    print(f"uninterrupted run {reference_s:.0f} s; killed and restarted run {soak_s:.0f} s")
    print("kill  rank  step  phase        last logged step  resumed from  lost  restore  source")
    assert len(lost) == len(kills), lost
    for index, (kill, (done, resumed, source, seconds)) in enumerate(zip(kills, lost, strict=True)):
        print(f"{index + 1:4d}  {kill.rank:4d}  {kill.step:4d}  {kill.phase:11s}  "
              f"{done:16d}  {resumed:12d}  {done - resumed:4d}  {seconds:6.3f}s  "
              f"{source}")  # fmt: skip
        assert source.startswith("memory"), (kill, source)  # never the disk
        assert done - resumed <= 1, (kill, done, resumed)
        if kill.phase == "node":
            assert f"rank(s) [{kill.rank}] from a peer's replica" in source, source


@pytest.mark.slow
@pytest.mark.parametrize("replication", list(REPLICATION))
def test_soak_with_memory_snapshots_loses_at_most_one_step_per_kill(
    tmp_path: Path, replication: str
) -> None:
    seed = int(os.environ.get("SHARDKIT_SOAK_SEED", "0"))
    _soak(tmp_path, STEPS, _with_a_node_lost(kill_points(seed), seed), replication)


@pytest.mark.parametrize("replication", list(REPLICATION))
def test_a_lost_node_and_a_killed_rank_resume_from_memory(tmp_path: Path, replication: str) -> None:
    # Step 14's node loss: with the log, rank 1 replays step 13 from step 12's replica.
    kills = [KillPoint(1, 14, "node"), KillPoint(0, 23, "forward")]
    _soak(tmp_path, 30, kills, replication)
