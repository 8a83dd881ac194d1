"""Kill a rank of one replica group under torchft, heal it from the live group, compare engines.

Starts torchft's lighthouse in this process and two replica groups of 2 ranks, one `torchrun`
each (demo/torchft_replicas.py), with a failure at a fixed step: a rank of group 1 SIGKILLs
itself mid-step; group 0 goes on alone; torchrun restarts group 1, which heals from group 0
and rejoins. Then it checks the run and prints what the healing cost:

    .venv/bin/python demo/run_torchft.py                  # shardkit, then torch's fully_shard
    .venv/bin/python demo/run_torchft.py --impl shardkit --hook private --quorum sync

With both engines it checks that they committed the same losses, bit for bit, and ended with
the same shards. It exits with status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# What torch's fully_shard dies of when torchft's quorum thread takes the state dict during a
# step (pytorch/torchtitan#4753; tests/core/state_dict/test_offthread_state_dict.py).
RACE_SIGNS = ("got mixed torch.Tensor and DTensor", "its data is not allocated yet")
WORKER = REPO / "demo" / "torchft_replicas.py"


@dataclass(kw_only=True, slots=True)
class Schedule:
    """A run's shape and its one failure (kill_replica -1: none)."""

    steps: int = 8
    """Steps every group commits."""
    kill_replica: int = 1
    """The group one of whose ranks dies."""
    kill_rank: int = 1
    """That rank, within its group."""
    kill_step: int = 3
    """The step it dies in (after its forward), on its group's first attempt."""
    alone_steps: int = 2
    """Steps the live group commits alone before it lets the restarted group rejoin."""
    model: str = "tiny"
    """The GPT's size: "tiny", or "demo" (make demo's, whose forward takes about 0.1 s)."""

    def worker_args(self) -> list[str]:
        return [
            f"--steps={self.steps}", f"--kill-replica={self.kill_replica}",
            f"--kill-rank={self.kill_rank}", f"--kill-step={self.kill_step}",
            f"--alone-steps={self.alone_steps}", f"--model={self.model}",
        ]  # fmt: skip


@dataclass(kw_only=True, slots=True)
class RunResult:
    """What one run's ranks recorded, read back from its folder."""

    steps: dict[tuple[int, int], list[dict[str, Any]]]
    """(replica, rank) -> every step record, in order, across attempts."""
    finals: dict[tuple[int, int], dict[str, Any]]
    """(replica, rank) -> the last attempt's final record (its shards' digest)."""
    heals: dict[tuple[int, int], dict[str, Any]]
    """(replica, rank) -> what healing cost that rank: bytes received, seconds."""
    wall_s: float
    logs: dict[int, str] = field(default_factory=dict)

    def committed(self) -> dict[tuple[int, int, int], str]:
        """(replica, rank, step) -> the loss (float.hex) of each committed step."""
        return {
            (replica, rank, r["step"]): r["loss"]
            for (replica, rank), records in self.steps.items()
            for r in records
            if r["committed"]
        }


def run(
    run_dir: Path,
    *,
    impl: str = "shardkit",
    hook: str = "public",
    quorum: str = "async",
    schedule: Schedule | None = None,
    timeout_s: float = 300.0,
) -> RunResult:
    """One run: the lighthouse here, two groups of 2 ranks under torchrun; their records."""
    from torchft._torchft import LighthouseServer

    schedule = schedule or Schedule()
    run_dir.mkdir(parents=True, exist_ok=True)
    # A dead group's heartbeats stop: after 2 s the live group may form a quorum without it
    # (a live group's come every 100 ms; 2 s leaves room for a loaded machine).
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=60_000, heartbeat_timeout_ms=2_000
    )
    start = time.monotonic()
    jobs: dict[int, subprocess.Popen[str]] = {}
    try:
        for replica in (0, 1):
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=2", f"--max-restarts={int(replica == schedule.kill_replica)}",
                "--monitor-interval=0.2",
                str(WORKER), f"--replica={replica}", f"--lighthouse={lighthouse.address()}",
                f"--run-dir={run_dir}", f"--impl={impl}", f"--hook={hook}",
                f"--quorum={quorum}", *schedule.worker_args(),
            ]  # fmt: skip
            env = dict(os.environ, OMP_NUM_THREADS="1")
            log = (run_dir / f"torchrun-{replica}.log").open("w")
            jobs[replica] = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                start_new_session=True,
            )  # fmt: skip
        _wait_all(jobs, start + timeout_s)
    finally:
        for job in jobs.values():
            if job.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(job.pid, signal.SIGKILL)
                job.wait()
        lighthouse.shutdown()
    wall_s = time.monotonic() - start
    logs = {r: (run_dir / f"torchrun-{r}.log").read_text() for r in jobs}
    failed = {r: job.returncode for r, job in jobs.items() if job.returncode != 0}
    if failed:
        raise RunFailed(failed, logs)
    return _read(run_dir, wall_s, logs)


class RunFailed(RuntimeError):
    """A group's torchrun failed (or was stopped because another did, or ran out of time)."""

    def __init__(self, exit_codes: dict[int, int], logs: dict[int, str]) -> None:
        self.exit_codes, self.logs = exit_codes, logs
        tails = "\n".join(f"--- group {r} ---\n{logs[r][-3000:]}" for r in exit_codes)
        super().__init__(f"torchrun exited with {exit_codes}:\n{tails}")

    @property
    def first_error(self) -> str:
        """The first error a rank died of, other than losing a peer ("" if none is found)."""
        for log in self.logs.values():
            for line in log.splitlines():
                died = re.match(r"\[rank\d+\]: (\w+Error: .*)", line)
                if died and "Connection closed by peer" not in line:
                    return died.group(1)
        return ""

    @property
    def state_dict_race(self) -> bool:
        """Whether a rank died of pytorch/torchtitan#4753: its forward or backward met what the
        state dict of torchft's quorum thread did to the parameters (the sharded ones swapped
        in, "got mixed torch.Tensor and DTensor"; or the unsharded storage freed)."""
        return any(sign in self.first_error for sign in RACE_SIGNS)


def _wait_all(jobs: dict[int, subprocess.Popen[str]], deadline: float) -> None:
    """Until every job has exited; the first to fail stops the others (the finally kills)."""
    while any(job.poll() is None for job in jobs.values()):
        if any(job.poll() not in (None, 0) for job in jobs.values()):
            return
        if time.monotonic() > deadline:
            return
        time.sleep(0.2)


def _read(run_dir: Path, wall_s: float, logs: dict[int, str]) -> RunResult:
    steps: dict[tuple[int, int], list[dict[str, Any]]] = {}
    finals: dict[tuple[int, int], dict[str, Any]] = {}
    heals: dict[tuple[int, int], dict[str, Any]] = {}
    for path in sorted(run_dir.glob("steps-*.jsonl")):
        _, replica, rank = path.stem.split("-")
        key = (int(replica), int(rank))
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("final"):
                finals[key] = record
            else:
                steps.setdefault(key, []).append(record)
    for path in sorted(run_dir.glob("heal-*.json")):
        _, replica, rank = path.stem.split("-")
        heals[(int(replica), int(rank))] = json.loads(path.read_text())
    return RunResult(steps=steps, finals=finals, heals=heals, wall_s=wall_s, logs=logs)


def check(result: RunResult, schedule: Schedule, quorum: str) -> list[str]:
    """What is wrong with a run of `schedule` (nothing: an empty list)."""
    problems: list[str] = []
    killed, live = schedule.kill_replica, 1 - schedule.kill_replica
    rejoin = schedule.kill_step + schedule.alone_steps
    for (replica, rank), records in sorted(result.steps.items()):
        committed = [r for r in records if r["committed"]]
        steps = [r["step"] for r in committed]
        first = rejoin if replica == killed else 0
        want = list(range(schedule.kill_step)) if replica == killed else []
        want += list(range(first, schedule.steps))
        if steps != want:
            problems.append(f"group {replica} rank {rank} committed steps {steps}, not {want}")
        for r in committed:
            alone = replica == live and schedule.kill_step <= r["step"] < rejoin
            healing = r["step"] == rejoin and quorum == "async"  # the healed group adds zeros
            expected = 1 if alone or healing else 2
            if r["participants"] != expected:
                problems.append(
                    f"group {replica} rank {rank} step {r['step']}: {r['participants']} "
                    f"groups took part, not {expected}"
                )
            if r["hook_calls"] == 0:
                problems.append(f"group {replica} rank {rank} step {r['step']}: no hook ran")
        failed = [r["step"] for r in records if not r["committed"]]
        if replica == live and schedule.kill_step not in failed:
            problems.append(f"group {live} rank {rank}: the step of the kill was committed")
    digests = {key: final["digest"] for key, final in result.finals.items()}
    for rank in (0, 1):
        if digests.get((0, rank)) is None or digests.get((0, rank)) != digests.get((1, rank)):
            problems.append(f"rank {rank}'s shards differ between the groups at the end")
    if not any(heal.get("received") for heal in result.heals.values()):
        problems.append("no group received a checkpoint from a peer")
    return problems


def heal_summary(result: RunResult) -> dict[str, float]:
    """What healing cost: the bytes the healing group's ranks received (all of them), and the
    slowest rank's seconds to fetch them, to deserialize them and to load them."""
    received = [r for heal in result.heals.values() for r in heal.get("received", [])]
    return {
        "bytes": float(sum(r["bytes"] for r in received)),
        "ranks": float(len(received)),
        "fetch_s": max((r["fetch_s"] for r in received), default=0.0),
        "deserialize_s": max((r["deserialize_s"] for r in received), default=0.0),
        "load_s": max((heal.get("load_s", 0.0) for heal in result.heals.values()), default=0.0),
    }


def _report(impl: str, result: RunResult, problems: list[str]) -> None:
    heal = heal_summary(result)
    per_rank = heal["bytes"] / max(heal["ranks"], 1.0)
    print(
        f"{impl}: {len(result.committed())} committed losses (group, rank, step) in "
        f"{result.wall_s:.1f} s; healing: {heal['ranks']:.0f} ranks received "
        f"{per_rank:,.0f} B each, fetched in {heal['fetch_s'] * 1000:.0f} ms, deserialized in "
        f"{heal['deserialize_s'] * 1000:.0f} ms, loaded in {heal['load_s'] * 1000:.0f} ms "
        "(slowest rank)"
    )
    for problem in problems:
        print(f"  {impl}: {problem}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--impl", choices=("both", "shardkit", "torch"), default="both")
    parser.add_argument("--hook", choices=("public", "private"), default="public")
    parser.add_argument(
        "--quorum",
        choices=("async", "sync"),
        default="async",
        help="async: torchtitan's (torch's fully_shard dies of pytorch/torchtitan#4753 there)",
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--model", choices=("tiny", "demo"), default="tiny")
    args = parser.parse_args()
    schedule = Schedule(steps=args.steps, model=args.model)
    impls = ("shardkit", "torch") if args.impl == "both" else (args.impl,)
    results: dict[str, RunResult] = {}
    ok = True
    with tempfile.TemporaryDirectory(prefix="torchft-") as tmp:
        for impl in impls:
            try:
                result = run(
                    Path(tmp) / impl, impl=impl, hook=args.hook, quorum=args.quorum,
                    schedule=schedule,
                )  # fmt: skip
            except RunFailed as failure:
                if impl == "torch" and failure.state_dict_race:  # torch's known defect
                    print(f"torch: died of pytorch/torchtitan#4753: {failure.first_error}")
                else:
                    print(f"{impl}: the run failed: {failure}")
                    ok = False
                continue
            results[impl] = result
            problems = check(result, schedule, args.quorum)
            _report(impl, result, problems)
            ok = ok and not problems
    if len(results) == 2:
        ours, theirs = results["shardkit"].committed(), results["torch"].committed()
        same = ours == theirs
        digests = results["shardkit"].finals == results["torch"].finals
        print(f"committed losses equal bit for bit: {same}; final shards equal: {digests}")
        ok = ok and same and digests
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
