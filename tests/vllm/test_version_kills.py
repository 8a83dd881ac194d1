"""Twenty kills: vLLM's engine serves export k or k+1 complete, never a mix.

vLLM's CPU build runs in a process of its own (tests/vllm/engine_versions.py) and takes exports
through shared memory from a W=2 trainer: a transformers Qwen2 of the engine's shapes, sharded
by ``fully_shard`` per layer, AdamW, a full export and then deltas. In each of 20 trials one
trainer rank, drawn at random (rank 0 holds the sender: the receiving side's process), is
killed at a random time in a random sync's export (a timer drawn up to 1.5 times the last
export's time, so some kills land after the export, in the next step). Twice: the receiver's
copies in memory (the default), and in files (``mirror_dir``: each export loaded from files at
the commit, the last one's files put back if that raises). Then the engine serves
the version in flight (committed before the kill) or the one before it, and every tensor it
serves, read back through its kernels, equals that version's ``full_tensor()`` bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.pool import RankTaskError, run_on_ranks
from tests.vllm.engines import save_tiny_qwen2

ROOT = Path(__file__).resolve().parents[2]
AUTHKEY = os.urandom(16)
TRIALS = 20
SYNCS = 3


@pytest.fixture(scope="module", params=["in-memory", "in-files"])
def engine(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[Path, str]]:
    out = tmp_path_factory.mktemp("engine_versions")
    save_tiny_qwen2(out / "model", seed=0)
    address = str(out / "engine.sock")
    command = [sys.executable, "-m", "tests.vllm.engine_versions", str(out / "model"), address]
    command += [str(out), *(["files"] if request.param == "in-files" else [])]
    env = {**os.environ, "SHARDKIT_TEST_AUTHKEY": AUTHKEY.hex(), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 300
        while not (out / "ready").exists():
            assert process.poll() is None, "the engine's process exited"
            assert time.monotonic() < deadline, "the engine's process did not start"
            time.sleep(0.2)
        yield out, address
    finally:
        process.kill()
        process.wait()


def _trial(
    rank: int,
    world_size: int,
    address: str,
    authkey: str,
    out: str,
    first_version: int,
    victim: int,
    kill_sync: int,
    fraction: float,
) -> str | None:
    import transformers
    from demo.grpo_vllm import tiny_qwen2_config

    from shardkit.core.export import ExportOptions, SharedMemorySender, WeightExporter
    from tests.core.export.export_models import full_state, fully_shard_of

    torch.manual_seed(0)  # the engine's first weights (save_tiny_qwen2, seed 0), in fp32
    model = transformers.Qwen2ForCausalLM(tiny_qwen2_config(layers=2))
    for layer in model.model.layers:
        fully_shard_of("shardkit")(layer)
    fully_shard_of("shardkit")(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    options = ExportOptions(
        dtype=torch.bfloat16, bucket_bytes=64 * 1024, first_version=first_version, bound_s=10
    )
    exporter = WeightExporter(model, options)
    sender = SharedMemorySender(address, bytes.fromhex(authkey), bound_s=20) if rank == 0 else None
    failure = None
    last_export_s = 0.5
    try:
        for sync in range(SYNCS):
            tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(sync))
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            expected = full_state(model, torch.bfloat16)  # every rank: full_tensor() gathers
            if rank == 0:
                path = Path(out) / f"expected_{first_version + sync}.safetensors"
                save_file({n: t.contiguous() for n, t in expected.items()}, str(path))
            if rank == victim and sync == kill_sync:
                delay = fraction * 1.5 * last_export_s
                threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
            start = time.perf_counter()
            exporter.export(sender, delta=sync > 0)
            last_export_s = time.perf_counter() - start
    except Exception as error:  # the other rank's death, as this rank met it
        failure = f"{type(error).__name__}: {error}"
    if sender is not None:
        sender.close()
    if rank == victim:
        time.sleep(60)  # the timer's kill comes
    return failure


def _served_after(out: Path, seen: int) -> tuple[list[dict[str, Any]], int]:
    """The engine's events since ``seen``, once none came for two seconds."""
    log = out / "events.jsonl"
    count, still = -1, 0
    while still < 10:
        lines = log.read_text().splitlines() if log.exists() else []
        still = still + 1 if len(lines) == count else 0
        count = len(lines)
        time.sleep(0.2)
    return [json.loads(line) for line in lines[seen:]], count


def test_twenty_kills_leave_version_k_or_k_plus_one_complete(engine: tuple[Path, str]) -> None:
    out, address = engine
    draw = random.Random(86)
    seen = 0
    outcomes = []
    for trial in range(TRIALS):
        first = 100 * (trial + 1)
        victim, kill_sync, fraction = draw.randrange(2), draw.randrange(1, SYNCS), draw.random()
        with pytest.raises(RankTaskError):
            run_on_ranks(
                2,
                _trial,
                timeout_s=180,
                address=address,
                authkey=AUTHKEY.hex(),
                out=str(out),
                first_version=first,
                victim=victim,
                kill_sync=kill_sync,
                fraction=fraction,
            )
        events, seen = _served_after(out, seen)
        assert events, f"trial {trial}: the engine recorded nothing"
        last = events[-1]
        expected = sorted(int(p.stem.split("_")[1]) for p in out.glob("expected_*.safetensors"))
        newest = max(v for v in expected if first <= v < first + SYNCS)
        served = load_file(str(out / f"served_{last['n']}.safetensors"))
        version = last["version"]
        assert version in (newest - 1, newest), (trial, victim, kill_sync, fraction, events)
        want = load_file(str(out / f"expected_{version}.safetensors"))
        differ = [n for n, t in want.items() if n not in served or not torch.equal(served[n], t)]
        assert differ == [], (trial, version, differ)
        aborted = any(e["outcome"].startswith("aborted") for e in events)
        outcomes.append((victim, version - newest, aborted))
    print("victim, served - newest, an export aborted:", outcomes)
    # Both ranks were killed, both outcomes happened, and some kills came mid-export.
    assert {v for v, _, _ in outcomes} == {0, 1}, outcomes
    assert {d for _, d, _ in outcomes} == {-1, 0}, outcomes
    assert any(a for _, _, a in outcomes), outcomes
