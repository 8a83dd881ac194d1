"""A TP-sliced export at W=2 (or 4: two engines) into a colocated vLLM engine of TP degree 2.

Run with torchrun.

Each rank holds one shard of the trainer (a tiny Qwen2, ``fully_shard`` per decoder layer and
at the root) and one rank of the engine (vLLM's ``external_launcher``, ``tensor_parallel_size
=2``). The oracle is vLLM itself: a fresh TP=2 engine started from the trainer's weights (saved
by ``full_tensor()``). First that engine's greedy tokens, log-probabilities and every
parameter of each of its ranks are recorded; then an engine started from other weights takes
the trainer's through ``SlicedExporter`` + ``VLLMSliceReceiver``, twice (the second time after
the trainer's weights moved again, checked against the trainer's windows), and its outputs and
parameters are compared with the fresh engine's. A third export fails at rank 1's commit after
rank 0's went through: both engine ranks must serve the second export, complete. Rank 0
writes ``summary.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from demo.grpo_vllm import start_engine as start_demo_engine
from demo.grpo_vllm import tiny_qwen2_config

from shardkit.core import fully_shard
from shardkit.core.errors import WeightExportError
from shardkit.core.export.tp_export import SlicedExporter
from shardkit.core.export.tp_slices import EngineTP, engine_window
from shardkit.core.export.vllm_read_back import partition_tensors
from shardkit.core.export.vllm_slices import VLLMSliceReceiver

DTYPE = torch.bfloat16
PROMPTS = ([3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26])


def start_engine(folder: Path) -> Any:
    """This rank's part of a TP=2 engine on ``folder``, in this process (W / 2 engines: vLLM's
    data parallel over the launcher's ranks, rank ``i`` engine rank ``i % 2``)."""
    engines = dist.get_world_size() // 2
    more: dict[str, Any] = {"data_parallel_size": engines} if engines > 1 else {}
    return start_demo_engine(folder, seed=0, max_num_seqs=4, tensor_parallel_size=2, **more)


def greedy(llm: Any) -> list[list[Any]]:
    """Greedy tokens and each step's top-5 (token, log-probability) pairs, per prompt."""
    vllm = importlib.import_module("vllm")
    params = vllm.SamplingParams(temperature=0.0, max_tokens=10, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in PROMPTS], params, use_tqdm=False)
    return [
        [
            list(o.outputs[0].token_ids),
            [sorted((t, e.logprob) for t, e in step.items()) for step in o.outputs[0].logprobs],
        ]
        for o in outputs
    ]


def trainer(config: Any, seed: int) -> torch.nn.Module:
    transformers = importlib.import_module("transformers")
    torch.manual_seed(seed)
    model: Any = transformers.Qwen2ForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    sharded: torch.nn.Module = model
    return sharded


def sharded_trainer(
    out: Path, rank: int
) -> tuple[EngineTP, torch.nn.Module, dict[str, torch.Tensor]]:
    """The trainer (the engine of degree 2, the model, its weights whole); rank 0 saves its
    weights to ``out/trained`` and other weights to ``out/initial`` (an engine starts there)."""
    config = tiny_qwen2_config(layers=2)
    tp = EngineTP.from_config(config, degree=2)
    model = trainer(config, seed=1)
    trained = full_weights(model)
    if rank == 0:
        save_model(config, trained, out / "trained")
        torch.manual_seed(0)
        transformers = importlib.import_module("transformers")
        initial = transformers.Qwen2ForCausalLM(config).to(DTYPE).state_dict()
        save_model(config, {n: t.contiguous() for n, t in initial.items()}, out / "initial")
    return tp, model, trained


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainer's tensors whole, in the engine's dtype (a collective: every rank)."""
    return {
        name: (t.full_tensor() if hasattr(t, "full_tensor") else t).to(DTYPE).contiguous()
        for name, t in model.state_dict().items()
    }


def save_model(config: Any, state: dict[str, torch.Tensor], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def windows_match(
    tp: EngineTP, state: dict[str, torch.Tensor], found: dict[str, torch.Tensor], rank: int
) -> list[str]:
    """Names whose engine partition differs from the trainer's window (fused by the windows'
    offsets; the vocabulary partitions' padding rows must be zeros)."""
    wrong = []
    for name, tensor in state.items():
        window = engine_window(tp, name, tuple(tensor.shape), rank)
        module, _, kind = name.rpartition(".")
        target = f"{module.rpartition('.')[0]}.{window.fused}.{kind}" if window.fused else name
        held = found[target]
        part = tensor[tuple(slice(a, b) for a, b in window.box)]
        rows = part.shape[0]
        got = held.narrow(0, window.fused_offset, rows)
        padding_ok = window.fused is not None or bool((held[rows:] == 0).all())
        if not torch.equal(got, part) or not padding_ok:
            wrong.append(name)
    return wrong


class _RefusingCommit(VLLMSliceReceiver):
    """Rank 1's receiver for the third export: its commit raises before it loads."""

    def commit(self) -> None:
        raise RuntimeError("rank 1's commit refused (injected)")


def run_fresh(out: Path, rank: int) -> None:
    """The oracle: a fresh TP=2 engine on the trainer's weights, its outputs and parameters."""
    llm = start_engine(out / "trained")
    record(out, "fresh", rank, greedy(llm), llm.collective_rpc(partition_tensors)[0])


def record(
    out: Path, phase: str, rank: int, outputs: list[list[Any]], params: dict[str, torch.Tensor]
) -> None:
    """One engine rank's outputs (JSON) and parameters (safetensors), for the test to compare."""
    (out / f"{phase}_outputs_{rank}.json").write_text(json.dumps(outputs))
    save_file(params, str(out / f"{phase}_params_{rank}.safetensors"))


def run_sync(out: Path, rank: int) -> dict[str, Any]:
    """Two TP-sliced exports into an engine started from other weights."""
    tp, model, trained = sharded_trainer(out, rank)
    dist.barrier()
    llm = start_engine(out / "initial")
    before = greedy(llm)
    exporter = SlicedExporter(model, tp, dtype=DTYPE, bucket_bytes=2**20)
    receiver = VLLMSliceReceiver(llm)
    report = exporter.export(receiver)
    after = greedy(llm)
    synced = llm.collective_rpc(partition_tensors)[0]
    record(out, "synced", rank, after, synced)
    # A second sync after the trainer's weights moved: the engine now holds the new windows.
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.full_like(param, 0.01))
    moved = full_weights(model)
    second = exporter.export(receiver)
    served_second = greedy(llm)
    # A third export fails at rank 1's commit, after rank 0's went through: all or nothing,
    # rank 0's engine rank is put back, and both serve the second export, complete.
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.full_like(param, 0.01))
    refusing = _RefusingCommit(llm) if rank == 1 else receiver
    try:
        exporter.export(refusing)
        third_error = "no error"
    except WeightExportError as error:
        third_error = str(error)
    kept = llm.collective_rpc(partition_tensors)[0]
    served_after_failure = greedy(llm)
    counts = torch.tensor(
        [report.window_bytes, report.received_bytes, report.copied_bytes, report.sent_bytes],
        dtype=torch.int64,
    )
    every = [torch.zeros_like(counts) for _ in range(dist.get_world_size())]
    dist.all_gather(every, counts)
    return {
        "rank": rank,
        "outputs_changed": after != before,
        "windows_wrong_first": windows_match(tp, trained, synced, rank % 2),
        "windows_wrong_second": windows_match(
            tp, moved, llm.collective_rpc(partition_tensors)[0], rank % 2
        ),
        "second_window_bytes": second.window_bytes,
        "third_error": third_error,
        "windows_wrong_after_failure": windows_match(tp, moved, kept, rank % 2),
        "served_as_second_after_failure": served_after_failure == served_second,
        "versions": [receiver.version, refusing.version],
        "seconds": [report.seconds, second.seconds],
        "load_seconds": [report.handoff_seconds, second.handoff_seconds],
        "counts": [c.tolist() for c in every],
        "model_bytes": sum(t.numel() * t.element_size() for t in trained.values()),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--phase", choices=("sync", "fresh"), required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.phase == "fresh":
        run_fresh(args.out, rank)
    else:
        summary = run_sync(args.out, rank)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, summary)
        if rank == 0:
            (args.out / "summary.json").write_text(json.dumps(gathered, indent=1))
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
