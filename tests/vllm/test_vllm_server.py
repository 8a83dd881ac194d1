"""``vllm serve`` (vLLM's OpenAI server, CPU build) taking exports from a trainer at W=2.

The server runs in a process of its own (its engine core in another), started with shardkit's
worker extension and ``VLLM_SERVER_DEV_MODE=1``; the trainer's ranks (harness pool, gloo)
reach it by HTTP and shared memory only (tests/vllm/server_ranks.py). After a full export
and then a delta, greedy completions requested over HTTP (tokens, text and top-5
log-probabilities) equal those of a fresh server started on the trainer's weights, bit for bit,
and every tensor the server computes with, read back on its worker by digest, equals the
trainer's ``full_tensor()``.

A completion requested while each export runs, of a prompt whose first KV block the server
cached under the old weights, equals the fresh server's too: it was not computed on the old
weights' cached prefix (before, the prefix cache was emptied by a call after the export, and
a request waiting in the server was scheduled first). The server's access log shows the order:
pause, the export, the reset of the prefix cache, resume, and no completion answered between.

Then the server's engine core is killed during an export, and after that the whole server:
each time every rank raises a ``WeightExportError`` within the bound.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from harness.pool import run_on_ranks
from shardkit.core.errors import WeightExportError
from shardkit.core.export import ExportedTensor, ExportManifest
from shardkit.core.export.vllm_server import VLLMServerReceiver
from tests.vllm import server_ranks, servers

BOUND_S = 20.0
START_S = 600.0


def _probe_pid(url: str) -> int:
    """The pid of the server's worker: its engine core process (one worker, in it)."""
    _chosen, _dtype, _reason, pid = VLLMServerReceiver(url, bound_s=BOUND_S)._rpc(
        "shardkit_probe", ["auto"], "the probe"
    )
    return int(pid)


def _fresh_completions(folder: Path, log: Path) -> list[dict[str, Any]]:
    """Completions of a plain server (no extension, no dev mode) started on ``folder``: those
    of engines.PROMPTS, then the long prompt's."""
    process, url = servers.start_ready(folder, log, extension=False, within_s=START_S)
    try:
        found = servers.completions(url, folder)
        found += servers.completions(url, folder, [servers.LONG_PROMPT])
        manifest = ExportManifest(
            export_id=0,
            kind="full",
            tensors=(ExportedTensor("lm_head.weight", (512, 128), torch.bfloat16, 0),),
            bucket_count=1,
        )
        with pytest.raises(WeightExportError, match="VLLM_SERVER_DEV_MODE=1"):
            VLLMServerReceiver(url, bound_s=BOUND_S).begin(manifest)
        return found
    finally:
        servers.stop(process)


def test_a_vllm_server_takes_exports_over_http_and_never_hangs_the_export(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "model"
    servers.save_model(folder, seed=0)
    log = tmp_path / "server.log"
    process, url = servers.start_ready(folder, log, extension=True, within_s=START_S)
    try:
        before = servers.completions(url, folder)
        rounds = run_on_ranks(
            2,
            server_ranks.train_and_sync,
            folder=str(folder),
            url=url,
            out=str(tmp_path),
            bound_s=BOUND_S,
            timeout_s=600,
        )
        seen = servers.requests_seen(log)
        engine_core = _probe_pid(url)
        mid_export = run_on_ranks(
            2,
            server_ranks.export_into_a_dying_server,
            folder=str(folder),
            url=url,
            kill_pid=engine_core,
            bound_s=BOUND_S,
            timeout_s=300,
        )
    finally:
        servers.stop(process)
    dead_server = run_on_ranks(
        2,
        server_ranks.export_into_a_dying_server,
        folder=str(folder),
        url=url,
        kill_pid=0,
        bound_s=BOUND_S,
        timeout_s=300,
    )

    synced = rounds[0]
    assert [r["kind"] for r in synced] == ["full", "delta"]
    assert synced[1]["plain_buckets"] == 0  # the delta sent changes, not whole buckets
    _assert_paused_around_each_export(seen, exports=len(synced))
    previous = before
    for step, found in enumerate(synced):
        assert found["read_back"]["differ"] == [], f"step {step}: {found['read_back']}"
        assert found["read_back"]["tensors"] == 2 * 12 + 3  # 2 layers of 12, embed, norm, head
        *fresh, fresh_long = _fresh_completions(Path(found["saved"]), tmp_path / f"f{step}.log")
        assert found["completions"] == fresh, f"step {step}: the synced server differs"
        assert found["completions"] != previous, f"step {step}: the sync changed nothing"
        assert found["during"] == fresh_long, f"step {step}: computed on the old prefix"
        previous = found["completions"]

    for what, results in (("engine core killed", mid_export), ("server killed", dead_server)):
        for rank, result in enumerate(results):
            assert result["error"] is not None, f"{what}: rank {rank} did not raise: {results}"
            assert result["seconds"] < BOUND_S + 15, f"{what}: rank {rank}: {result}"
        assert len({r["error"] for r in results}) == 1, f"{what}: the ranks' errors differ"


def _assert_paused_around_each_export(seen: list[str], *, exports: int) -> None:
    """Each export: the server paused, served it (``/collective_rpc``), emptied its prefix
    cache and only then resumed; no completion was answered in between."""
    pauses = [i for i, path in enumerate(seen) if path == "/pause"]
    assert len(pauses) == exports, seen
    for start in pauses:
        end = seen.index("/resume", start)
        between = seen[start + 1 : end]
        assert "/collective_rpc" in between and between[-1] == "/reset_prefix_cache", seen
        assert "/v1/completions" not in between, seen
