"""A TP-sliced export into ``vllm serve --tensor-parallel-size 2`` (vLLM's OpenAI server, CPU
build, its two workers in processes of their own), from a trainer at W=2 (torchrun,
tp_sliced_server_run.py): the driver reaches the workers through ``/collective_rpc`` and
pauses the server's scheduling around each export; each trainer rank's windows reach its
worker through shared memory.

The oracle is a fresh TP=2 server started on the trainer's weights: after the first sync (from
other weights) and the third (back from moved weights), greedy completions over HTTP (text,
tokens' top-5 log-probabilities) and every parameter of each engine rank, read back on its
worker, equal it bit for bit; each worker loaded exactly its windows' bytes; the server was
paused and resumed around each export.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm import servers
from tests.vllm.tp_sliced_server_run import observe

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("tp_sliced_server_run.py")
START_S = 600.0


def _trainer(out: Path, url: str, served: Path) -> list[dict[str, Any]]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(SCRIPT), "--out", str(out)]
    command += ["--url", url, "--served", str(served)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    ranks: list[dict[str, Any]] = json.loads((out / "result.json").read_text())
    return ranks


def _fresh(folder: Path, log: Path) -> dict[str, Any]:
    process, url = servers.start_ready(
        folder, log, extension=True, within_s=START_S, tensor_parallel_size=2
    )
    try:
        return observe(url, folder)
    finally:
        servers.stop(process)


@pytest.fixture(autouse=True)
def _no_orphaned_segments() -> Iterator[None]:
    """The killed servers' tensor-parallel segments, removed after the test."""
    before = servers.tp_segments()
    yield
    servers.remove_orphaned_tp_segments(before)


def test_a_tp2_server_takes_its_slices_bit_for_bit(tmp_path: Path) -> None:
    served = tmp_path / "served"
    servers.save_model(served, seed=0)
    log = tmp_path / "server.log"
    process, url = servers.start_ready(
        served, log, extension=True, within_s=START_S, tensor_parallel_size=2
    )
    try:
        ranks = _trainer(tmp_path, url, served)
    finally:
        servers.stop(process)
    servers.save_tokenizer(tmp_path / "trained")
    fresh = _fresh(tmp_path / "trained", tmp_path / "fresh.log")

    driver = ranks[0]
    assert len(fresh["digests"]) == 2 and any("qkv_proj" in n for n in fresh["digests"][0])
    assert driver["before"]["outputs"] != fresh["outputs"]  # started from other weights
    for sync in ("first", "again"):
        assert driver[sync]["outputs"] == fresh["outputs"], sync
        assert driver[sync]["digests"] == fresh["digests"], sync
    assert driver["moved"]["digests"] != fresh["digests"]
    for rank, entry in enumerate(ranks):
        for report, answers in zip(entry["reports"], driver["served"], strict=True):
            assert answers[rank]["received_bytes"] == report["window_bytes"] > 0
            assert answers[rank]["finished"] == 1 and answers[rank]["error"] is None
    seen = servers.requests_seen(log)
    assert seen.count("/pause") == seen.count("/resume") == 3
    assert seen.count("/reset_prefix_cache") == 3
