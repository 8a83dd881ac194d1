"""The exporter end to end into another process: a W=2 model sharded by ``fully_shard``
exports through shared memory to a receiving process holding a bf16 model of the same names;
after each of 10 syncs, full and delta, every tensor it holds equals ``full_tensor()``'s."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from harness.pool import run_on_ranks
from tests.core.export.export_models import fully_shard_of
from tests.core.export.receiver_process import AUTHKEY_ENV, receiving_process, tiny_qwen

ROOT = Path(__file__).resolve().parents[3]
AUTHKEY = os.urandom(16)


@pytest.fixture(scope="module")
def receiving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    out = tmp_path_factory.mktemp("export_receiver")
    address = str(out / "receiver.sock")
    with receiving_process(out, ["shm", address, str(out)], {AUTHKEY_ENV: AUTHKEY.hex()}):
        yield out, address


def _syncs(rank: int, world_size: int, impl: str, address: str, authkey: str, out: str) -> Any:
    from safetensors.torch import load_file

    from shardkit.core.export import ExportOptions, SharedMemorySender, WeightExporter
    from tests.core.export.export_models import bf16_oracle, perturb

    fully_shard = fully_shard_of(impl)
    model: Any = tiny_qwen(seed=1).float()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    exporter = WeightExporter(model, ExportOptions(dtype=torch.bfloat16))
    sender = SharedMemorySender(address, bytes.fromhex(authkey)) if rank == 0 else None
    mismatches: list[str] = []
    kinds = []
    for sync in range(10):
        perturb(model, sync)
        # A full export (sync 5) between deltas: the next delta is full again, then deltas.
        report = exporter.export(sender, delta=sync != 5)
        kinds.append(report.kind)
        oracle = bf16_oracle(model, keep_tp=False)  # every rank: full_tensor() gathers
        if rank == 0:
            held = load_file(f"{out}/export_{report.export_id}.safetensors")
            mismatches += [f"{sync}: {k}" for k, v in oracle.items() if not torch.equal(held[k], v)]
    if sender is not None:
        sender.close()
    return kinds, mismatches


@pytest.mark.parametrize("impl", ["shardkit", "torch"])
def test_every_sync_reaches_the_other_process_bit_identically(
    receiving: tuple[Path, str], impl: str
) -> None:
    out, address = receiving
    results = run_on_ranks(
        2, _syncs, impl=impl, address=address, authkey=AUTHKEY.hex(), out=str(out)
    )
    kinds, mismatches = results[0]
    assert kinds == ["full"] + ["delta"] * 4 + ["full", "full"] + ["delta"] * 3
    assert mismatches == []
    assert load_file(str(out / "export_0.safetensors"))  # the receiver wrote what it held
