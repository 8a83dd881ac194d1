"""vLLM's engine core in a process of its own, ``VLLM_ALLOW_INSECURE_SERIALIZATION`` unset.

Before issue 86 the export hung there: vLLM's input thread died decoding the pickled loading
function and ``collective_rpc`` waited for ever. Now (tests/vllm/engine_elsewhere.py, in a
fresh interpreter): without shardkit's worker extension the receiver refuses the engine in
``begin``, naming the settings, at once; with it a full and a delta export go through by
method name and the engine's greedy tokens and log-probabilities equal a fresh engine's on
the weights sent; a commit whose load raises in the engine's process leaves the version the
worker served, and its outputs (also with the mirror in files, the engine's process loading
each export from the files and putting the last one back from its own); and once its engine
core is killed, the next export raises within the bound.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_an_engine_in_its_own_process_takes_exports_or_ends_them_within_the_bound(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ALLOW_INSECURE_SERIALIZATION"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.vllm.engine_elsewhere", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads(lines[-1])
    refused = found["no_route"]
    assert "worker_extension_cls" in refused["error"] and refused["seconds"] < 5
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION=1" in refused["error"]
    assert found["full"]["error"] is None and found["delta"]["error"] is None
    assert found["equal"]
    assert found["serving"] == 1 == found["serving_after_bad"]
    failed = found["bad_commit"]["error"]
    assert "export 2" in failed and "put back" in failed and "serves export 1" in failed, failed
    assert found["same_after_bad"]
    assert found["files_full"]["error"] is None and found["files_delta"]["error"] is None
    assert found["files_same"] and found["files_same_after_bad"]
    failed = found["files_bad_commit"]["error"]
    assert "export 5" in failed and "loaded again from their files" in failed, failed
    assert "serves export 4" in failed and found["files_serving_after_bad"] == 4
    after = found["after_kill"]
    assert found["killed"] >= 1 and after["error"] is not None
    assert "did not answer" in after["error"] or "EngineDead" in after["error"]
    assert after["seconds"] < 20 + 10  # the receiver's bound, and a margin
