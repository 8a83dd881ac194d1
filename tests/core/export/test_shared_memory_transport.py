"""Exports through shared memory into another process: full then delta, bit-identical; the
receiver's errors come back as WeightLoadError; a dead or silent receiver is a bounded
WeightExportError, never a hang."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardkit.core.errors import WeightExportError, WeightLoadError
from shardkit.core.export.messages import ExportedTensor, ExportManifest
from shardkit.core.export.shared_memory import SharedMemorySender
from tests.core.export.receiver_process import (
    AUTHKEY_ENV,
    export_of,
    receiving_process,
    send_export,
    tiny_qwen,
)

ROOT = Path(__file__).resolve().parents[3]
AUTHKEY = os.urandom(16)


@dataclass
class Receiver:
    """The receiving process (one per file: a torch process takes seconds to start here)."""

    out: Path
    address: str
    process: subprocess.Popen[bytes]


@pytest.fixture(scope="module")
def receiver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Receiver]:
    out = tmp_path_factory.mktemp("shm_receiver")
    address = str(out / "receiver.sock")
    args = ["shm", address, str(out)]
    with receiving_process(out, args, {AUTHKEY_ENV: AUTHKEY.hex()}) as process:
        yield Receiver(out, address, process)


send = send_export


def assert_received(out: Path, export_id: int, state: dict[str, torch.Tensor]) -> None:
    held = load_file(str(out / f"export_{export_id}.safetensors"))
    assert held.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(held[name].view(torch.int16), tensor.view(torch.int16)), name


def trained(state: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """A few elements of each tensor changed (one tensor densely, one not at all)."""
    new = {name: t.clone() for name, t in state.items()}
    for i, (name, tensor) in enumerate(new.items()):
        flat = tensor.view(-1)
        if name.endswith("layers.0.mlp.up_proj.weight"):
            flat[::3] += 1  # dense: goes as a bitmask
        elif not name.endswith("layers.1.input_layernorm.bias"):
            flat[(torch.arange(3) * 37 + step + i) % flat.numel()] += 0.5
    return new


def test_full_then_delta_exports_arrive_bit_identical(receiver: Receiver) -> None:
    out, address = receiver.out, receiver.address
    state = {n: t.detach().clone() for n, t in tiny_qwen(seed=1).state_dict().items()}
    with SharedMemorySender(address, AUTHKEY, bound_s=30) as sender:
        manifest, buckets = export_of(state, 0)
        assert len(buckets) == 5  # more than two: the segments are reused in turn
        send(sender, manifest, buckets)
        assert_received(out, 0, state)
        for export_id in (1, 2):
            new = trained(state, export_id)
            send(sender, *export_of(new, export_id, previous=state))
            assert_received(out, export_id, new)
            state = new


def test_a_receiver_error_comes_back_and_the_next_export_works(receiver: Receiver) -> None:
    out, address = receiver.out, receiver.address
    state = {n: t.detach().clone() for n, t in tiny_qwen(seed=2).state_dict().items()}
    manifest, buckets = export_of(state, 10)
    ghost = ExportedTensor("model.ghost.weight", (2,), torch.bfloat16, 0)
    wrong = ExportManifest(10, "full", (*manifest.tensors, ghost), manifest.bucket_count)
    with SharedMemorySender(address, AUTHKEY, bound_s=30) as sender:
        with pytest.raises(WeightLoadError, match=r"model\.ghost\.weight: not a tensor of"):
            send(sender, wrong, buckets)
        send(sender, manifest, buckets)
        assert_received(out, 10, state)


def test_a_silent_or_dead_receiver_fails_the_export_within_the_bound(receiver: Receiver) -> None:
    # Last in the file: it ends the module's receiving process.
    process, address = receiver.process, receiver.address
    state = {n: t.detach().clone() for n, t in tiny_qwen(seed=3).state_dict().items()}
    manifest, buckets = export_of(state, 0)
    try:
        with SharedMemorySender(address, AUTHKEY, bound_s=1.5) as sender:
            sender.begin(manifest)
            sender.receive(buckets[0])
            process.send_signal(signal.SIGSTOP)
            start = time.monotonic()
            with pytest.raises(WeightExportError, match=r"bucket [23] \(model\.(layers\.1|norm)"):
                for bucket in buckets[1:]:
                    sender.receive(bucket)
            assert time.monotonic() - start < 5
            sender.abort(RuntimeError("gave up"))
            process.send_signal(signal.SIGCONT)
            # The serving loop takes the next sender; this one dies mid-export.
            sender.begin(manifest)
            sender.receive(buckets[0])
            process.kill()
            start = time.monotonic()
            with pytest.raises(WeightExportError, match="died or stopped answering"):
                for bucket in buckets[1:]:
                    sender.receive(bucket)
                sender.finish()
            assert time.monotonic() - start < 5
    finally:
        process.send_signal(signal.SIGCONT)
