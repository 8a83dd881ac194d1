"""Exports broadcast to two receiver processes over a gloo group of their own: full then delta,
bit-identical in both; a receiver's error comes back as WeightLoadError and the next export
works; a receiver killed mid-export is a bounded WeightExportError, never a hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardkit.core.errors import WeightExportError, WeightLoadError
from shardkit.core.export.group_transport import GroupSender, ReceiverGroupSpec
from shardkit.core.export.messages import ExportedTensor, ExportManifest
from tests.core.export.receiver_process import export_of, send_export, tiny_qwen

ROOT = Path(__file__).resolve().parents[3]
RECEIVERS = 2
BOUND_S = 3.0


class Receivers:
    """The sender and its two receiver processes (rank r saves under ``out/rank<r>``)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        spec = ReceiverGroupSpec(host="127.0.0.1", port=0, receivers=RECEIVERS, bound_s=BOUND_S)
        self.sender = GroupSender(spec)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.processes = []
        for rank in range(1, RECEIVERS + 1):
            (out / f"rank{rank}").mkdir()
            command = [sys.executable, "-m", "tests.core.export.receiver_process", "group"]
            command += ["127.0.0.1", str(self.sender.port), str(rank), str(RECEIVERS)]
            command += [str(BOUND_S), str(out / f"rank{rank}")]
            self.processes.append(subprocess.Popen(command, cwd=ROOT, env=env))

    def held(self, rank: int, export_id: int) -> dict[str, torch.Tensor]:
        return load_file(str(self.out / f"rank{rank}" / f"export_{export_id}.safetensors"))


@pytest.fixture(scope="module")
def receivers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Receivers]:
    made = Receivers(tmp_path_factory.mktemp("group_receivers"))
    try:
        yield made
    finally:
        made.sender.close(stop_serving=True)
        for process in made.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


send = send_export


def assert_received(receivers: Receivers, export_id: int, state: dict[str, torch.Tensor]) -> None:
    for rank in range(1, RECEIVERS + 1):
        held = receivers.held(rank, export_id)
        assert held.keys() == state.keys()
        for name, tensor in state.items():
            assert torch.equal(held[name].view(torch.int16), tensor.view(torch.int16)), name


def trained(state: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    new = {name: t.clone() for name, t in state.items()}
    for i, tensor in enumerate(new.values()):
        flat = tensor.view(-1)
        flat[(torch.arange(4) * 29 + step * 7 + i) % flat.numel()] -= 0.25
    return new


def test_full_then_delta_exports_reach_every_receiver(receivers: Receivers) -> None:
    state = {n: t.detach().clone() for n, t in tiny_qwen(seed=1).state_dict().items()}
    send(receivers.sender, *export_of(state, 0))
    assert_received(receivers, 0, state)
    for export_id in (1, 2):
        new = trained(state, export_id)
        send(receivers.sender, *export_of(new, export_id, previous=state))
        assert_received(receivers, export_id, new)
        state = new


def test_a_receiver_error_comes_back_and_the_next_export_works(receivers: Receivers) -> None:
    state = {n: t.detach().clone() for n, t in tiny_qwen(seed=2).state_dict().items()}
    manifest, buckets = export_of(state, 10)
    ghost = ExportedTensor("model.ghost.weight", (2,), torch.bfloat16, 0)
    wrong = ExportManifest(10, "full", (*manifest.tensors, ghost), manifest.bucket_count)
    with pytest.raises(WeightLoadError, match=r"receiver rank \d: .*model\.ghost\.weight: not a"):
        send(receivers.sender, wrong, buckets)
    send(receivers.sender, manifest, buckets)
    assert_received(receivers, 10, state)


def test_a_stalled_or_killed_receiver_fails_the_export_within_the_bound(
    receivers: Receivers,
) -> None:
    # Last in the file: it ends one of the module's receivers.
    state = {n: t.detach().clone() for n, t in tiny_qwen(seed=3).state_dict().items()}
    manifest, buckets = export_of(state, 20)
    sender, stalled = receivers.sender, receivers.processes[1]
    # The group formed first, as in a run of the whole file: a receiver stopped before it
    # joins is waited for up to join_s (300 s: an engine can take minutes to start), not
    # bound_s, so run alone the stall below would be a late join instead.
    send(sender, *export_of(state, 19))
    assert_received(receivers, 19, state)
    stalled.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(WeightExportError, match=r"export 20: the receiver group failed at"):
            send(sender, manifest, buckets)
        assert time.monotonic() - start < 2 * BOUND_S + 5
    finally:
        stalled.send_signal(signal.SIGCONT)
    # The next export forms a new group with both receivers, and goes through.
    send(sender, *export_of(state, 21))
    assert_received(receivers, 21, state)
    sender.begin(manifest)
    sender.receive(buckets[0])
    stalled.kill()
    stalled.wait()
    start = time.monotonic()
    with pytest.raises(WeightExportError, match=r"export 20: the receiver group failed at"):
        for bucket in buckets[1:]:
            sender.receive(bucket)
        sender.finish()
    assert time.monotonic() - start < BOUND_S + 5
    sender.abort(RuntimeError("gave up"))
