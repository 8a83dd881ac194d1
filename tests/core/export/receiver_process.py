"""A receiving process for the transport tests, and the exports its tests send it.

Run as ``python -m tests.core.export.receiver_process shm ADDRESS OUT`` (or ``group HOST PORT
RANK SIZE BOUND_S OUT``): it builds a small Qwen2-shaped model in bf16 (a plain torch module
with Hugging Face's names: transformers takes seconds to import here), serves exports into it
through a ``ModuleReceiver``, and after each finished export saves the model's tensors to
``OUT/export_<id>.safetensors`` for the test to compare. The authkey comes in the environment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from shardkit.core.export.messages import (
    ChangedElements,
    ExportedTensor,
    ExportManifest,
    WeightBucket,
)
from shardkit.core.export.receivers import ModuleReceiver, WeightReceiver

AUTHKEY_ENV = "SHARDKIT_TEST_AUTHKEY"


def tiny_qwen(seed: int, layers: int = 2, dim: int = 64, hidden: int = 128) -> nn.Module:
    """A Qwen2-shaped model (names as transformers' Qwen2ForCausalLM), bf16, seed-built."""
    torch.manual_seed(seed)
    model = nn.Module()
    model.model = nn.Module()
    model.model.embed_tokens = nn.Embedding(256, dim)
    model.model.layers = nn.ModuleList()
    for _ in range(layers):
        layer = nn.Module()
        layer.self_attn = nn.Module()
        for name, out, bias in [
            ("q", dim, True),
            ("k", 32, True),
            ("v", 32, True),
            ("o", dim, False),
        ]:
            setattr(layer.self_attn, f"{name}_proj", nn.Linear(dim, out, bias=bias))
        layer.mlp = nn.Module()
        layer.mlp.gate_proj = nn.Linear(dim, hidden, bias=False)
        layer.mlp.up_proj = nn.Linear(dim, hidden, bias=False)
        layer.mlp.down_proj = nn.Linear(hidden, dim, bias=False)
        layer.input_layernorm = nn.LayerNorm(dim)
        model.model.layers.append(layer)
    model.model.norm = nn.LayerNorm(dim)
    model.lm_head = nn.Linear(dim, 256, bias=False)
    return model.to(torch.bfloat16)


def layer_of(name: str) -> str:
    """The bucket key: ``model.layers.N`` for a layer's tensors, else the module's name."""
    parts = name.split(".")
    return ".".join(parts[:3]) if parts[:2] == ["model", "layers"] else ".".join(parts[:-1])


def export_of(
    state: dict[str, torch.Tensor], export_id: int, previous: dict[str, torch.Tensor] | None = None
) -> tuple[ExportManifest, list[WeightBucket]]:
    """A full export of ``state`` (or a delta one against ``previous``), a layer a bucket."""
    keys = list(dict.fromkeys(layer_of(name) for name in state))
    entries = tuple(
        ExportedTensor(name, tuple(t.shape), t.dtype, keys.index(layer_of(name)))
        for name, t in state.items()
    )
    manifest = ExportManifest(
        export_id, "full" if previous is None else "delta", entries, len(keys)
    )
    buckets = []
    for index in range(len(keys)):
        names = manifest.names_in(index)
        if previous is None:
            buckets.append(WeightBucket(index, full=tuple((n, state[n]) for n in names)))
        else:
            changes = tuple((n, changes_of(previous[n], state[n])) for n in names)
            buckets.append(WeightBucket(index, changed=changes))
    return manifest, buckets


def changes_of(old: torch.Tensor, new: torch.Tensor) -> ChangedElements:
    """The elements of ``new`` whose bits differ from ``old``'s."""
    differ = old.reshape(-1).view(torch.int16) != new.reshape(-1).view(torch.int16)
    indices = differ.nonzero().reshape(-1)
    return ChangedElements(indices, new.reshape(-1)[indices])


class SavingReceiver(ModuleReceiver):
    """A ``ModuleReceiver`` that saves the module's tensors after each finished export."""

    def __init__(self, module: nn.Module, out: Path) -> None:
        super().__init__(module)
        self.out = out

    def finish(self) -> None:
        manifest = self._manifest
        super().finish()
        if manifest is not None:
            state = {n: t.contiguous() for n, t in self.module.state_dict().items()}
            save_file(state, str(self.out / f"export_{manifest.export_id}.safetensors"))


def send_export(
    sender: WeightReceiver, manifest: ExportManifest, buckets: list[WeightBucket]
) -> None:
    """Hand one export to a transport's sender as the exporter does (abort on a failure)."""
    sender.begin(manifest)
    try:
        for bucket in buckets:
            sender.receive(bucket)
        sender.finish()
    except BaseException as error:
        sender.abort(error)
        raise


@contextlib.contextmanager
def receiving_process(
    out: Path, args: list[str], env: dict[str, str]
) -> Iterator[subprocess.Popen[bytes]]:
    """This module run with ``args`` in a process of its own, once it is ready (``out/ready``);
    killed at the end."""
    root = Path(__file__).resolve().parents[3]
    command = [sys.executable, "-m", "tests.core.export.receiver_process", *args]
    process = subprocess.Popen(command, cwd=root, env={**os.environ, **env, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while not (out / "ready").exists():
            assert process.poll() is None, "the receiving process exited"
            assert time.monotonic() < deadline, "the receiving process did not start"
            time.sleep(0.05)
        yield process
    finally:
        process.kill()
        process.wait()


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="receiver: %(message)s")
    torch.set_num_threads(1)
    authkey = bytes.fromhex(os.environ.get(AUTHKEY_ENV, ""))
    out = Path(argv[-1])
    receiver = SavingReceiver(tiny_qwen(seed=0), out)

    def ready() -> None:
        (out / "ready").touch()

    if argv[0] == "shm":
        from shardkit.core.export.shared_memory import serve_shared_memory

        serve_shared_memory(argv[1], authkey, receiver, ready=ready)
    elif argv[0] == "group":
        from shardkit.core.export.group_transport import ReceiverGroupSpec, serve_receiver_group

        host, port, rank, size, bound_s = argv[1], int(argv[2]), int(argv[3]), int(argv[4]), argv[5]
        spec = ReceiverGroupSpec(host=host, port=port, receivers=size, bound_s=float(bound_s))
        serve_receiver_group(spec, rank, receiver, ready=ready)
    else:
        raise SystemExit(f"unknown transport {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
