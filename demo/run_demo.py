"""`make demo`: train a small GPT on 2 CPU ranks, stop, resume from the checkpoint in a new job,
and show that training went on exactly where it stopped.

Three torchrun jobs of demo/train_gpt.py (gloo, one thread per rank):

1. train steps 1..30, saving a DCP checkpoint every 10 steps;
2. a new job resumes from the latest checkpoint and trains steps 31..45;
3. a reference job trains steps 1..45 without stopping.

Then it checks that job 2 started at step 31 with the loss where job 1 left it, and that jobs 1+2
computed the same loss as the reference at every step, bit for bit. Exits 1 if a check fails.

With ``--tp 2`` every job runs on 4 ranks as dp 2 x tp 2 (tensor parallelism inside each
layer, shardkit-tp finding the TP parameters), and a fourth job resumes job 1's checkpoint
at dp 4 x tp 1, on plain FSDP: DCP reshards it, and the loss goes on as in the 2D run.

With ``--nodes 2`` every job runs as two torchrun "nodes" of 2 ranks on this machine (two
launches joined by a c10d rendezvous on localhost), training with HSDP: sharded within a
node, replicated across nodes. A last job trains on one node of 4 ranks with plain FSDP and
the same global batch, and its losses must match the two-node run's.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEMO_DIR = Path(__file__).resolve().parent
REPO = DEMO_DIR.parent
TRAIN_SCRIPT = DEMO_DIR / "train_gpt.py"


@dataclass(kw_only=True, slots=True)
class DemoConfig:
    """What run_demo.py runs; the defaults are what `make demo` shows."""

    impl: str = "shardkit"
    """Whose fully_shard trains: shardkit's engine or torch's."""
    stop_at: int = 30
    """The first job stops (and checkpoints) here."""
    total_steps: int = 45
    """The resumed job and the reference train up to here."""
    ckpt_every: int = 10
    """The first job also checkpoints every this many steps; the resume uses the latest."""
    tp: int = 1
    """Tensor-parallel degree: with tp > 1 each job runs dp 2 x tp ranks, and a last job
    resumes the same checkpoint at dp (2 * tp) x tp 1, on plain FSDP."""
    batch_size: int = 8
    """Sequences per data-parallel rank."""
    nproc: int = 0
    """Ranks per job (per node with nodes > 1); 0 means 2 * tp."""
    nodes: int = 1
    """torchrun launches ("nodes") per job, joined by a c10d rendezvous on localhost; with
    more than one the jobs train with HSDP, one replica per node."""
    reference: bool = True
    """Also train without stopping and compare every step's loss."""
    runs: Path = DEMO_DIR / "runs"
    """Checkpoints and metrics go to runs/<impl>/ (demo/runs/ is git-ignored)."""
    profile: bool = False
    """Profile job 1 with shardkit.tools; its report goes to runs/<impl>/profile/. The job
    runs through the test rig (tests/demo/rig.py), which drives train_gpt.py's own training
    with a profiler on every rank."""

    @property
    def out(self) -> Path:
        return self.runs / self.impl

    @property
    def profile_dir(self) -> Path:
        return self.out / "profile"

    def __post_init__(self) -> None:
        if self.impl not in ("shardkit", "torch"):
            raise ValueError(f"impl must be 'shardkit' or 'torch', got {self.impl!r}")
        if not 0 < self.stop_at < self.total_steps:
            raise ValueError(
                f"need 0 < stop_at < total_steps, got {self.stop_at}, {self.total_steps}"
            )
        if self.nproc == 0:
            self.nproc = 2 * self.tp
        if self.nodes < 1 or (self.nodes > 1 and self.tp > 1):
            raise ValueError(f"--nodes {self.nodes}: need 1, or more with --tp 1")
        if self.tp < 1 or self.nproc % self.tp != 0 or self.batch_size % self.tp != 0:
            raise ValueError(
                f"--tp {self.tp} must divide --nproc ({self.nproc}) and --batch-size "
                f"({self.batch_size}), so that the 1D job sees the same global batch"
            )


@dataclass(slots=True)
class RunLog:
    """What one job's rank 0 wrote to its metrics file."""

    losses: dict[int, float] = field(default_factory=dict)  # step -> global loss
    events: list[dict[str, Any]] = field(default_factory=list)  # resumed / saved

    @classmethod
    def read(cls, path: Path) -> RunLog:
        log = cls()
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "event" in record:
                log.events.append(record)
            else:
                log.losses[int(record["step"])] = float(record["loss"])
        return log


def require_impl(impl: str) -> None:
    """Fail early and readably, before torchrun prints one traceback per rank."""
    if impl != "shardkit":
        return
    try:
        from shardkit.core import fully_shard  # noqa: F401  (probing the name only)
    except ImportError as err:
        sys.exit(
            f"run_demo: --impl shardkit needs `from shardkit.core import fully_shard`, which is "
            f"not importable yet ({type(err).__name__}: {err}).\n"
            f"Run the demo on torch's engine meanwhile: {sys.executable} demo/run_demo.py "
            "--impl torch"
        )


def free_port() -> int:
    """A port nothing listens on now, for the rendezvous (a race with other programs is
    possible but harmless here: the launch then fails and says so)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port: int = s.getsockname()[1]
        return port


def launch_lines(nodes: int, nproc: int) -> list[list[str]]:
    """torchrun's arguments for each node of one job: one --standalone launch, or `nodes`
    launches with fixed node ranks and the master on localhost, as a cluster's nodes meet at
    node 0's address.

    Fixed ranks rather than a c10d rendezvous: there the store lives in the agent of one
    launch, which other agents poll while their workers run; when that launch finished first,
    the other's agent lost its store and failed a finished job (seen once in CI here).
    """
    run = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nodes == 1:
        return [[*run, "--standalone"]]
    master = ["--master-addr=localhost", f"--master-port={free_port()}"]
    return [[*run, f"--nnodes={nodes}", f"--node-rank={rank}", *master] for rank in range(nodes)]


def torchrun(
    cfg: DemoConfig,
    title: str,
    name: str,
    args: list[str],
    *,
    nodes: int | None = None,
    profile: bool = False,
) -> RunLog:
    """Run train_gpt.py as a fresh torchrun job (on cfg.nodes nodes unless `nodes` says),
    profiled through the test rig if `profile`; return what its rank 0 recorded."""
    metrics = cfg.out / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    rig = ["-m", "tests.demo.rig", f"--profile={cfg.profile_dir}"]  # run from the repo root
    script = [
        *(rig if profile else [str(TRAIN_SCRIPT)]),
        # args come last so that they may override --log-every (argparse keeps the last).
        *(f"--impl={cfg.impl}", f"--metrics-file={metrics}", "--log-every=5"),
        *(f"--tp={cfg.tp}", f"--batch-size={cfg.batch_size}", *args),
    ]
    # One thread per rank: the ranks already take the cores, and torchrun would warn otherwise.
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    print(f"\n=== {title}", flush=True)
    start = time.perf_counter()
    nodes = cfg.nodes if nodes is None else nodes
    launches = [
        subprocess.Popen([*line, *script], env=env, cwd=REPO)
        for line in launch_lines(nodes, cfg.nproc * cfg.nodes // nodes)
    ]
    returncode = max(abs(launch.wait()) for launch in launches)
    seconds = time.perf_counter() - start
    if returncode != 0:
        sys.exit(f"run_demo: the job '{title}' failed with exit status {returncode}")
    print(f"--- {seconds:.1f} s, torchrun start-up included", flush=True)
    return RunLog.read(metrics)


class Checks:
    """Collects pass/fail lines so that every check is printed before the verdict."""

    def __init__(self) -> None:
        self.failed = 0

    def check(self, ok: bool, message: str) -> None:
        self.failed += not ok
        print(f"  [{'ok' if ok else 'FAIL'}] {message}")


def check_resume(cfg: DemoConfig, first: RunLog, resumed: RunLog, checks: Checks) -> None:
    resumes = [e for e in resumed.events if e["event"] == "resumed"]
    checks.check(
        len(resumes) == 1 and resumes[0]["step"] == cfg.stop_at,
        f"job 2 resumed from {resumes[0]['path'] if resumes else 'nothing'} "
        f"at step {resumes[0]['step'] if resumes else '?'}",
    )
    expected = list(range(cfg.stop_at + 1, cfg.total_steps + 1))
    checks.check(
        list(resumed.losses) == expected,
        f"job 2's step counter went on from {cfg.stop_at + 1} to {cfg.total_steps}",
    )
    fresh, last = first.losses[1], first.losses[cfg.stop_at]
    at_resume = resumed.losses.get(cfg.stop_at + 1, float("nan"))
    checks.check(
        abs(at_resume - last) < abs(at_resume - fresh),
        f"the loss went on from {last:.4f} (step {cfg.stop_at}) to {at_resume:.4f} "
        f"(step {cfg.stop_at + 1}), not back to a fresh model's {fresh:.4f}",
    )


def check_reference(cfg: DemoConfig, stitched: dict[int, float], reference: RunLog) -> bool:
    """Print the losses around the restart next to the reference's; True if all steps agree."""
    lo, hi = max(1, cfg.stop_at - 2), min(cfg.total_steps, cfg.stop_at + 3)
    shown = [*range(lo, hi + 1), *([cfg.total_steps] if hi < cfg.total_steps else [])]
    print(f"\n  {'step':>5}  {'stopped+resumed':>18}  {'uninterrupted':>18}  equal")
    nan = float("nan")  # a missing step compares unequal to everything
    for step in shown:
        if step == cfg.total_steps and hi + 1 < cfg.total_steps:
            print(f"  {'...':>5}")
        ours, ref = stitched.get(step, nan), reference.losses.get(step, nan)
        marker = "   <- restart" if step == cfg.stop_at + 1 else ""
        print(f"  {step:>5}  {ours:>18.10f}  {ref:>18.10f}  {ours == ref!s:5}{marker}")
    steps = range(1, cfg.total_steps + 1)
    missing = [s for s in steps if s not in stitched or s not in reference.losses]
    diffs = [abs(stitched[s] - reference.losses[s]) for s in steps if s not in missing]
    print(f"  max |loss difference| over steps 1..{cfg.total_steps}: {max(diffs, default=nan):g}")
    if missing:
        print(f"  steps missing from a run: {missing}")
    print()
    return not missing and all(d == 0.0 for d in diffs)


def check_other_layout(cfg: DemoConfig, at_stop: Path, reference: RunLog, checks: Checks) -> None:
    """Resume job 1's checkpoint on plain FSDP over every rank (dp nproc x tp 1).

    DCP reshards the 2D checkpoint on load. The global batch is the same (batch_size / tp
    sequences per rank), so the loss goes on as in the 2D run, up to summation order.
    """
    dp = cfg.nproc
    other = torchrun(
        cfg,
        f"job 4: resume the step-{cfg.stop_at} checkpoint at dp {dp} x tp 1 (plain FSDP)",
        "job4",
        [
            f"--steps={cfg.total_steps}",
            f"--ckpt-dir={at_stop}",
            "--resume",
            "--tp=1",
            f"--batch-size={cfg.batch_size // cfg.tp}",
        ],
    )
    steps = range(cfg.stop_at + 1, cfg.total_steps + 1)
    print(f"\n  {'step':>5}  {'dp x tp 1':>14}  {'2D run':>14}")
    for step in steps:
        print(f"  {step:>5}  {other.losses.get(step, float('nan')):>14.6f}  "
              f"{reference.losses.get(step, float('nan')):>14.6f}")  # fmt: skip
    known = [s for s in steps if s in other.losses and s in reference.losses]
    worst = max((abs(other.losses[s] - reference.losses[s]) for s in known), default=1.0)
    checks.check(
        len(known) == len(steps) and worst < 1e-3,
        f"at dp {dp} x tp 1 the loss went on as in the 2D run (max |difference| {worst:.1e})",
    )


def check_one_node(cfg: DemoConfig, multi: dict[int, float], checks: Checks) -> None:
    """Train on one node, every rank in one shard group (plain FSDP), with the same global
    batch, and compare with the multi-node HSDP run's losses.

    HSDP sums the gradients in another order (within a node, then across nodes), and the
    gradient norm for clipping is reduced per mesh axis, so the two may differ in the last
    bits after some steps; 1e-5 relative is far below a step's change of the loss.
    """
    world = cfg.nproc * cfg.nodes
    single = torchrun(
        cfg,
        f"one node: {world} ranks, plain FSDP, the same global batch",
        "one_node",
        [f"--steps={cfg.total_steps}", "--replicas=1", "--log-every=15"],
        nodes=1,
    )
    steps = range(1, cfg.total_steps + 1)
    known = [s for s in steps if s in single.losses and s in multi]
    diffs = [abs(single.losses[s] - multi[s]) / abs(single.losses[s]) for s in known]
    equal = sum(d == 0.0 for d in diffs)
    worst = max(diffs, default=1.0)
    checks.check(
        len(known) == len(steps) and worst <= 1e-5,
        f"{cfg.nodes} nodes (HSDP) and one node (FSDP): the same loss at {equal} of "
        f"{len(steps)} steps bit for bit, max relative difference {worst:.1e} (allowed 1e-5)",
    )


def run(cfg: DemoConfig) -> int:
    require_impl(cfg.impl)
    cfg.out.mkdir(parents=True, exist_ok=True)
    ckpt = str(cfg.out / "ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)  # a demo starts from scratch
    shutil.rmtree(cfg.out / "reference_ckpt", ignore_errors=True)
    started = time.perf_counter()
    # Profiling job 1 also shows that the profiler leaves the numbers alone: its losses must
    # still match the unprofiled reference bit for bit.
    first = torchrun(
        cfg,
        f"job 1: train steps 1..{cfg.stop_at}, checkpoint every {cfg.ckpt_every}"
        + (", profiled" if cfg.profile else ""),
        "job1",
        [
            f"--steps={cfg.stop_at}",
            f"--ckpt-dir={ckpt}",
            f"--ckpt-every={cfg.ckpt_every}",
        ],
        profile=cfg.profile,
    )
    at_stop = cfg.out / "ckpt_at_stop"
    if cfg.tp > 1:  # kept for the last job: job 2 adds newer checkpoints to ckpt/
        shutil.rmtree(at_stop, ignore_errors=True)
        shutil.copytree(ckpt, at_stop)
    resumed = torchrun(
        cfg,
        f"job 2 (a new torchrun): resume from the latest checkpoint, train to {cfg.total_steps}",
        "job2",
        [f"--steps={cfg.total_steps}", f"--ckpt-dir={ckpt}", "--resume"],
    )
    print("\n=== checks")
    checks = Checks()
    check_resume(cfg, first, resumed, checks)
    if cfg.reference:
        reference = torchrun(
            cfg,
            f"reference: train steps 1..{cfg.total_steps} without stopping",
            "reference",
            [
                f"--steps={cfg.total_steps}",
                "--log-every=15",
                f"--ckpt-dir={cfg.out / 'reference_ckpt'}",
                "--ckpt-every=0",
            ],
        )
        print("\n=== checks, against the uninterrupted reference")
        equal = check_reference(cfg, first.losses | resumed.losses, reference)
        checks.check(equal, "jobs 1+2 computed the reference's loss at every step, bit for bit")
        if cfg.impl == "shardkit":
            ours, theirs = (
                Path(ckpt) / "model.safetensors",
                cfg.out / "reference_ckpt" / "model.safetensors",
            )
            same = ours.is_file() and theirs.is_file() and filecmp.cmp(ours, theirs, shallow=False)
            checks.check(
                same, "the exported full models (model.safetensors) are identical, byte for byte"
            )
    if cfg.tp > 1:
        check_other_layout(cfg, at_stop, reference if cfg.reference else first, checks)
    if cfg.nodes > 1:
        check_one_node(cfg, first.losses | resumed.losses, checks)
    total = time.perf_counter() - started
    print(f"\nimpl={cfg.impl}: {total:.0f} s in all; checkpoints and metrics in {cfg.out}")
    if cfg.profile:
        print(f"job 1's profile (summary.txt, trace.json, memory.png, ...): {cfg.profile_dir}")
    if checks.failed:
        print(f"FAILED: {checks.failed} check(s) did not hold")
        return 1
    print("PASSED: training continued exactly where it stopped")
    return 0


def parse_args() -> DemoConfig:
    defaults = DemoConfig()
    p = argparse.ArgumentParser(description="Train, stop, resume, and check the resume is exact.")
    p.add_argument("--impl", choices=["shardkit", "torch"], default=defaults.impl)
    p.add_argument("--stop-at", type=int, default=defaults.stop_at)
    p.add_argument("--total-steps", type=int, default=defaults.total_steps)
    p.add_argument("--ckpt-every", type=int, default=defaults.ckpt_every)
    p.add_argument(
        "--nproc", type=int, default=0, help="ranks per job or per node (default: 2 * tp)"
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=defaults.nodes,
        help="torchrun launches per job joined by a c10d rendezvous on localhost (HSDP)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=defaults.tp,
        help="tensor-parallel degree: dp 2 x tp ranks, then a resume at dp (2 * tp) x tp 1",
    )
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--no-reference", dest="reference", action="store_false")
    p.add_argument("--runs", type=Path, default=defaults.runs)
    p.add_argument(
        "--profile", action="store_true", help="profile job 1 into <runs>/<impl>/profile/"
    )
    a = p.parse_args()
    return DemoConfig(
        impl=a.impl,
        stop_at=a.stop_at,
        total_steps=a.total_steps,
        ckpt_every=a.ckpt_every,
        nproc=a.nproc,
        nodes=a.nodes,
        tp=a.tp,
        batch_size=a.batch_size,
        reference=a.reference,
        runs=a.runs,
        profile=a.profile,
    )


if __name__ == "__main__":
    sys.exit(run(parse_args()))
