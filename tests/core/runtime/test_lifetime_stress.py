"""The buffer-lifetime stress (``lifetime_stress.py``): no buffer freed under a collective.

Twice a full test run lost a rank to glibc's "double free or corruption (fasttop)" inside a
gloo collective. The stress trains through everything that gathers, reduces or frees buffers
(prefetch, async unshards, ``reshard_after_forward`` True/False/int, HSDP, async checkpoints,
full state dicts, FSDP1's full optimizer state) with the lifetime checks on, against torch's
``fully_shard`` trained alike. The short variant runs on the pool's ranks; the slow one (``make
soak``) under ``torchrun``, where glibc's heap checks must be set before the processes start
(the pool's workers are shared by every test): ``MALLOC_CHECK_=3`` with glibc's debugging
malloc preloaded (from glibc 2.34 on it lives in ``libc_malloc_debug.so``), glibc's per-thread
cache off, and ``MALLOC_PERTURB_``, which fills freed memory with a byte, so that a collective
that reads freed memory sends garbage and the comparison with torch fails (a large buffer
goes back to the system at once: touching it after that is a segmentation fault).
``SHARDKIT_STRESS_PERTURB`` sets the byte (default 165, 0xa5).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.pool import crashes_fail_at_once, run_on_ranks
from tests.core.runtime.lifetime_stress import LEGACY, check, stress_body

REPO = Path(__file__).resolve().parents[3]
MALLOC_DEBUG = Path("/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0")


def test_short_stress_on_four_ranks(tmp_path: Path) -> None:
    names = ("reshard-to-half", "hsdp-reshard", "bf16", LEGACY)
    with crashes_fail_at_once():  # the crash this test hunts must fail it
        results = run_on_ranks(4, stress_body, steps=4, root=str(tmp_path), names=names)
    for result in results:
        assert set(result) == set(names)
        check(result)


def _malloc_env(perturb: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", SHARDKIT_DEBUG_LIFETIMES="1")
    env |= {"MALLOC_CHECK_": "3", "MALLOC_PERTURB_": str(perturb)}
    # Without the per-thread cache, every small free goes through the checked paths (the
    # fastbins of the "fasttop" error among them) and is filled with the perturb byte.
    env["GLIBC_TUNABLES"] = "glibc.malloc.tcache_count=0"
    if MALLOC_DEBUG.exists():
        env["LD_PRELOAD"] = " ".join(p for p in (str(MALLOC_DEBUG), env.get("LD_PRELOAD")) if p)
    return env


@pytest.mark.slow
def test_stress_under_glibc_heap_checks(tmp_path: Path) -> None:
    perturb = int(os.environ.get("SHARDKIT_STRESS_PERTURB", "165"))  # 0xa5
    out = tmp_path / "results"
    out.mkdir()
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"),
        *("-m", "tests.core.runtime.lifetime_stress", "--steps", "12"),
        *("--root", str(tmp_path / "ckpt"), "--out", str(out)),
    ]
    job = subprocess.run(
        command,
        cwd=REPO,
        env=_malloc_env(perturb),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-8000:]
    summaries = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(4)]
    for summary in summaries:
        assert all(not part["left_in_flight"] for k, part in summary.items() if k != "pid")
    assert summaries[0][LEGACY]["losses"] == summaries[3][LEGACY]["losses"]
