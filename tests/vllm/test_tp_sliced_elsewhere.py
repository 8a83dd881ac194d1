"""A TP-sliced export into vLLM's CPU build whose TP=2 workers run in processes of their own
(the multiprocessing executor), each taking its windows from one trainer rank through shared
memory and shardkit's worker extension (tp_sliced_elsewhere_run.py, torchrun at W=2).

The oracle is a fresh TP=2 engine of the same kind started from the trainer's weights: after
the first sync (from other weights) and after a third (back from moved weights), the engine's
greedy tokens, top-5 log-probabilities and every parameter of each engine rank, read back on
its worker, equal it bit for bit. Each worker loaded exactly its windows' bytes, from one
trainer rank. An export the engine cannot take fails on both ranks with one error, within the
bound, and leaves the engine serving what it served; an export after one worker was killed
ends on both ranks with one error, within the bound. At W=4 (``one_engine``), ranks 0 and 1
take the engine ranks' windows and ranks 2 and 3 only send: the same bits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.vllm import servers

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("tp_sliced_elsewhere_run.py")
BOUND_S = 20.0  # the failing export's (tp_sliced_elsewhere_run.failing_export)
KILL_BOUND_S = 20.0  # the export's after a worker is killed (export_after_a_kill)


def _run(tmp_path: Path, ranks: int, *options: str) -> list[dict[str, Any]]:
    """The script under torchrun at ``ranks``; every rank's findings."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(ranks), str(SCRIPT), "--out", str(tmp_path), *options]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    before = servers.tp_segments()
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False
        )
    finally:
        servers.remove_orphaned_tp_segments(before)  # the killed engine's, the ended ones'
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    found: list[dict[str, Any]] = json.loads((tmp_path / "result.json").read_text())
    return found


def test_tp2_workers_of_their_own_take_their_slices_bit_for_bit(tmp_path: Path) -> None:
    ranks = _run(tmp_path, 2)
    driver = ranks[0]
    fresh = driver["fresh"]
    assert len(fresh["digests"]) == 2  # one table per engine rank
    assert any("qkv_proj" in name for name in fresh["digests"][0])
    assert driver["before"]["outputs"] != fresh["outputs"]  # started from other weights
    for sync in ("first", "again"):
        assert driver[sync]["outputs"] == fresh["outputs"], sync  # tokens, top-5 log-probs
        assert driver[sync]["digests"] == fresh["digests"], sync  # each rank, every tensor
    assert driver["moved"]["digests"] != fresh["digests"]  # the second sync changed them
    for rank, entry in enumerate(ranks):
        for report, served in zip(entry["reports"], driver["served"], strict=True):
            window = report["window_bytes"]
            assert window == report["received_bytes"] + report["copied_bytes"]
            # The worker of this engine rank loaded exactly this trainer rank's windows.
            assert served[rank] == {
                "rank": rank, "degree": 2, "finished": 1, "received_bytes": window, "error": None
            }  # fmt: skip
            assert entry["model_bytes"] / 2 < window < entry["model_bytes"]
        failure = entry["failure"]
        assert failure["error"] == driver["failure"]["error"]  # one error on every rank
        assert "sent as torch.float32" in failure["error"]
        assert "nothing was written" in failure["error"]
        assert failure["seconds"] < BOUND_S + 10
    assert driver["after_failure"] == driver["again"]  # still serving the last export
    # Refused by rank 1 after every worker loaded the moved weights: one error on both ranks,
    # and every worker's load undone: the engine serves T1, complete, outputs and digests.
    refused = [entry["refused_after_load"]["error"] for entry in ranks]
    assert refused[0] == refused[1] and "(injected)" in str(refused[0]), refused
    assert driver["after_refusal"] == driver["again"]
    # Engine rank 1's worker killed: the next export ends on both ranks, one error, bounded.
    killed = [entry["killed"] for entry in ranks]
    assert killed[0]["error"] is not None and killed[0]["error"] == killed[1]["error"]
    assert all(k["seconds"] < KILL_BOUND_S + 10 for k in killed), killed


def test_four_trainer_ranks_feed_a_tp2_engine_bit_for_bit(tmp_path: Path) -> None:
    ranks = _run(tmp_path, 4, "--one-engine")
    driver = ranks[0]
    fresh = driver["fresh"]
    assert driver["before"]["outputs"] != fresh["outputs"]  # started from other weights
    for sync in ("first", "again"):
        assert driver[sync]["outputs"] == fresh["outputs"], sync  # tokens, top-5 log-probs
        assert driver[sync]["digests"] == fresh["digests"], sync  # each rank, every tensor
    assert driver["moved"]["digests"] != fresh["digests"]
    assert [entry["receives"] for entry in ranks] == [True, True, False, False]
    for rank, entry in enumerate(ranks):
        for report, served in zip(entry["reports"], driver["served"], strict=True):
            if rank < 2:  # an engine rank's windows, all of them, loaded by its worker
                window = report["window_bytes"]
                assert window == report["received_bytes"] + report["copied_bytes"] > 0
                assert served[rank]["received_bytes"] == window
                assert served[rank]["error"] is None and served[rank]["finished"] == 1
            else:  # only sends: its shards' overlaps with the first two ranks' windows
                assert report["window_bytes"] == report["received_bytes"] == 0
                assert report["sent_bytes"] > 0
