"""Small vLLM engines for the receiver's tests: a tiny Qwen2 model, its weights, greedy outputs.

The model is built from a transformers config with random weights and saved to a folder (no
download); engines start from a folder with ``skip_tokenizer_init`` and are given prompt token
ids. Exports are built here by hand, as the exporter would send them: whole layers per bucket.
"""

from __future__ import annotations

import importlib
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from demo.grpo_vllm import start_engine as start_grpo_engine
from demo.grpo_vllm import tiny_qwen2_config
from safetensors.torch import load_file, save_file

from shardkit.core.export import ChangedElements, ExportedTensor, ExportManifest, WeightBucket

DTYPE = torch.bfloat16
PROMPTS = ([3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26])
MAX_TOKENS = 12
TOP_LOGPROBS = 5
_LAYER = re.compile(r"^(model\.layers\.\d+)\.")


def save_tiny_qwen2(folder: Path, *, seed: int) -> dict[str, torch.Tensor]:
    """A 2-layer Qwen2 (hidden 128, head dim 64, vocab 512) with random bf16 weights in
    ``folder``; returns its state dict (checkpoint names).

    The head dim is 64 because vLLM's CPU attention has no kernel for 16.
    """
    transformers = importlib.import_module("transformers")
    config = tiny_qwen2_config(layers=2)
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config).to(DTYPE)
    model.save_pretrained(folder)
    return load_file(folder / "model.safetensors")


def perturbed(state: dict[str, torch.Tensor], *, seed: int) -> dict[str, torch.Tensor]:
    """Another set of weights of the same names, shapes and dtypes."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: (torch.randn(t.shape, generator=generator) * 0.05).to(t.dtype)
        for name, t in state.items()
    }


def save_weights_beside(source: Path, folder: Path, state: dict[str, torch.Tensor]) -> Path:
    """``folder``: ``source``'s config with ``state`` as its weights."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, folder / path.name)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def start_engine(folder: Path) -> Any:
    """A ``vllm.LLM`` on ``folder``'s model in this process, on a process group of its own."""
    return start_grpo_engine(folder, seed=0, shares_the_group=False, max_num_seqs=4)


@dataclass(frozen=True, slots=True)
class Greedy:
    """One prompt's greedy continuation: its tokens and each step's top log-probabilities."""

    tokens: tuple[int, ...]
    logprobs: tuple[tuple[tuple[int, float], ...], ...]


def greedy(llm: Any) -> list[Greedy]:
    """``llm``'s greedy outputs for :data:`PROMPTS` (temperature 0, top-k log-probabilities)."""
    vllm = importlib.import_module("vllm")
    params = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS)
    requests = [{"prompt_token_ids": list(prompt)} for prompt in PROMPTS]
    outputs = llm.generate(requests, params, use_tqdm=False)
    found = []
    for output in outputs:
        completion = output.outputs[0]
        steps = tuple(
            tuple(sorted((token, entry.logprob) for token, entry in step.items()))
            for step in completion.logprobs
        )
        found.append(Greedy(tokens=tuple(completion.token_ids), logprobs=steps))
    return found


def layer_of(name: str) -> str:
    """The bucket key: ``model.layers.3`` for a decoder layer's tensors, else the name."""
    match = _LAYER.match(name)
    return match.group(1) if match else name


def _grouped(names: list[str]) -> list[list[str]]:
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(layer_of(name), []).append(name)
    return list(groups.values())


def full_export(
    state: dict[str, torch.Tensor], *, export_id: int = 0
) -> tuple[ExportManifest, list[WeightBucket]]:
    """A full export of ``state``: one bucket per decoder layer, the rest one tensor each."""
    groups = _grouped(sorted(state))
    entries = tuple(
        ExportedTensor(name=n, shape=tuple(state[n].shape), dtype=state[n].dtype, bucket=b)
        for b, names in enumerate(groups)
        for n in names
    )
    buckets = [
        WeightBucket(index=b, full=tuple((n, state[n].clone()) for n in names))
        for b, names in enumerate(groups)
    ]
    manifest = ExportManifest(
        export_id=export_id, kind="full", tensors=entries, bucket_count=len(groups)
    )
    return manifest, buckets


def delta_export(
    before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], *, export_id: int
) -> tuple[ExportManifest, list[WeightBucket]]:
    """A delta export from ``before`` to ``after`` (same names): changed elements only."""
    manifest, _ = full_export(after, export_id=export_id)
    buckets = []
    for b in range(manifest.bucket_count):
        changed = []
        for i, name in enumerate(manifest.names_in(b)):
            flat_before, flat_after = before[name].reshape(-1), after[name].reshape(-1)
            indices = (flat_before != flat_after).nonzero().reshape(-1)
            changed.append((name, _changes(flat_before, flat_after, indices, as_steps=i % 2 == 1)))
        buckets.append(WeightBucket(index=b, changed=tuple(changed)))
    delta = ExportManifest(
        export_id=export_id, kind="delta", tensors=manifest.tensors, bucket_count=len(buckets)
    )
    return delta, buckets


def _changes(
    before: torch.Tensor, after: torch.Tensor, indices: torch.Tensor, *, as_steps: bool
) -> ChangedElements:
    """The changes at ``indices``: as new values, or as steps of the bits (bf16: int16)."""
    if not as_steps:
        return ChangedElements(indices=indices, values=after[indices])
    steps = after.view(torch.int16)[indices].long() - before.view(torch.int16)[indices].long()
    none = torch.zeros(0, dtype=torch.int64)
    return ChangedElements(indices=none, values=after[none], stepped=indices, steps=steps)


def export_into(receiver: Any, manifest: ExportManifest, buckets: list[WeightBucket]) -> None:
    """What the exporter does on the receiving side: begin, every bucket, then finish (or abort
    with the error)."""
    receiver.begin(manifest)
    try:
        for bucket in buckets:
            receiver.receive(bucket)
    except Exception as error:
        receiver.abort(error)
        raise
    receiver.finish()


def with_changes(state: dict[str, torch.Tensor], *, seed: int) -> dict[str, torch.Tensor]:
    """``state`` with a few elements of a few tensors changed (what a small step moves)."""
    generator = torch.Generator().manual_seed(seed)
    changed = {name: t.clone() for name, t in state.items()}
    for name in sorted(changed)[::3]:
        flat = changed[name].view(-1)
        where = torch.randint(0, flat.numel(), (4,), generator=generator)
        flat[where] = flat[where] + torch.tensor(0.25, dtype=flat.dtype)
    return changed


def with_a_bad_tensor(
    state: dict[str, torch.Tensor], bad_name: str, *, export_id: int = 0
) -> tuple[ExportManifest, list[WeightBucket]]:
    """A full export of ``state`` whose ``bad_name`` is sent in a shape the engine refuses."""
    manifest, buckets = full_export(state, export_id=export_id)
    failing = next(b for b in buckets if bad_name in b.names)
    bad = torch.zeros(7, 3, dtype=torch.bfloat16)
    buckets[failing.index] = WeightBucket(
        index=failing.index,
        full=tuple((n, bad if n == bad_name else t) for n, t in failing.full),
    )
    return manifest, buckets
