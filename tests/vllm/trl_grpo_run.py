"""trl 1.16's GRPOTrainer, colocated vLLM, FSDP2 through accelerate, synced through the export.

Run by tests/vllm/test_trl_grpo.py under torchrun at W=2 (gloo, CPU)::

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m tests.vllm.trl_grpo_run OUT STEPS

Rank 0 saves the tiny Qwen2 (tests/vllm/servers.py: with a word-level tokenizer) to OUT/model;
each rank builds trl's ``GRPOTrainer`` on it (``use_vllm=True``, ``vllm_mode="colocate"``, an
``external_launcher`` engine per rank; ``fsdp="full_shard"`` with ``fsdp_version: 2``, so
accelerate shards the model with torch's ``fully_shard`` per decoder layer), then
``sync_through_export(trainer)`` replaces trl's per-parameter sync (accelerate 1.15 keeps
FSDP only on GPU-like devices: :func:`cpu_fsdp2` gives it back on this CPU). After every sync,
every rank reads each tensor back from its engine (``demo.grpo_vllm.engine_weights``) and
compares it with the trainer's ``full_tensor()`` in the engine's dtype. Each rank writes
``OUT/rank<r>.json``: every sync's report and check, and the trainer's losses.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch
import torch.distributed as dist
from demo.grpo_vllm import allow_amx, engine_weights

from shardkit.core.export.trl_sync import TrlExportSync, sync_through_export
from tests.vllm import servers

PROMPTS = 8
GENERATIONS = 4


def even_tokens(completions: list[str], **_: Any) -> list[float]:
    """The toy reward: the fraction of even token ids (words ``t<i>``) in a completion."""
    found = []
    for text in completions:
        ids = [int(word[1:]) for word in text.replace("t", " t").split() if word[1:].isdigit()]
        found.append(sum(1 for i in ids if i % 2 == 0) / max(len(ids), 1))
    return found


def check_sync(sync: TrlExportSync, model: torch.nn.Module) -> dict[str, Any]:
    """Every tensor the engine computes with against the trainer's ``full_tensor()``."""
    llm = sync.generation.llm
    dtype = llm.llm_engine.model_config.dtype
    trainer = {
        name: (t.full_tensor() if hasattr(t, "full_tensor") else t).to(dtype)
        for name, t in model.state_dict().items()
    }
    engine = llm.collective_rpc(engine_weights)[0]
    missing = sorted(set(trainer) - set(engine))
    differ = [
        n for n in sorted(set(trainer) & set(engine)) if not torch.equal(trainer[n], engine[n])
    ]
    report = sync.reports[-1]
    return {
        "kind": report.kind,
        "sent_bytes": report.counts.sent_bytes,
        "plain_buckets": report.counts.plain_buckets,
        "seconds": report.seconds,
        "tensors": len(trainer),
        "missing": missing,
        "differ": differ,
    }


def cpu_fsdp2(grpo_trainer: type) -> type:
    """trl's ``GRPOTrainer`` whose accelerate state keeps FSDP2 on a CPU.

    accelerate 1.15 turns an FSDP plugin into ``DistributedType.FSDP`` only for GPU-like
    devices (``AcceleratorState.__init__``, ``accelerate/state.py``: the branch for
    ``MULTI_GPU``, ``MULTI_XPU``, ...); on a CPU the state stays ``MULTI_CPU``, the plugin is
    dropped, and the model is wrapped in DDP, unsharded. This puts the plugin that transformers
    built from ``fsdp_config`` back, so accelerate's own FSDP2 preparation
    (``fsdp2_prepare_model``: torch's ``fully_shard`` per decoder layer) shards the model.
    """
    accelerate = importlib.import_module("accelerate")
    distributed_type = importlib.import_module("accelerate.utils").DistributedType

    class CpuFsdp2Trainer(grpo_trainer):  # type: ignore[misc]
        plugin: Any = None

        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            self._keep_fsdp2()

        def _prepare_for_training(self, *args: Any, **kwargs: Any) -> Any:
            self._keep_fsdp2()  # the state is shared, and vLLM's start resets it to MULTI_CPU
            return super()._prepare_for_training(*args, **kwargs)

        def _keep_fsdp2(self) -> None:
            state = self.accelerator.state
            if state.distributed_type == distributed_type.MULTI_CPU and self.args.fsdp_plugin_args:
                if self.plugin is None:
                    self.plugin = accelerate.FullyShardedDataParallelPlugin(
                        **self.args.fsdp_plugin_args
                    )
                state.distributed_type = distributed_type.FSDP
                state.fsdp_plugin = self.plugin
                self.is_fsdp_enabled = True

    return CpuFsdp2Trainer


def main(out: Path, steps: int) -> int:
    allow_amx()
    trl = importlib.import_module("trl")
    datasets = importlib.import_module("datasets")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    folder = out / "model"
    if rank == 0:
        servers.save_model(folder, seed=0)
    dist.barrier()
    generator = torch.Generator().manual_seed(0)
    prompts = [
        " ".join(f"t{int(i)}" for i in torch.randint(1, servers.VOCAB, (6,), generator=generator))
        for _ in range(PROMPTS)
    ]
    config = trl.GRPOConfig(
        output_dir=str(out / "trainer"),
        use_cpu=True,
        max_steps=steps,
        learning_rate=1e-6,  # a few percent of the bf16 elements change: deltas, not plain
        per_device_train_batch_size=GENERATIONS,
        num_generations=GENERATIONS,
        max_completion_length=8,
        beta=0.0,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=128,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        fsdp="full_shard",
        fsdp_config={
            "fsdp_version": 2,
            "reshard_after_forward": True,
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"],
        },
    )
    transformers = importlib.import_module("transformers")
    # Loaded as saved: AutoTokenizer would make a Qwen2 tokenizer of it (the config's model).
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    tokenizer.pad_token = tokenizer.unk_token
    trainer = cpu_fsdp2(trl.GRPOTrainer)(
        model=str(folder),
        processing_class=tokenizer,
        reward_funcs=even_tokens,
        args=config,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
    )
    sync = sync_through_export(trainer)
    checks: list[dict[str, Any]] = []

    def sync_and_check() -> None:
        sync()
        checks.append(check_sync(sync, sync.generation.model))

    trainer.vllm_generation.sync_weights = sync_and_check
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    model = sync.generation.model
    fsdp = [type(m).__name__ for m in model.modules() if "FSDP" in type(m).__name__]
    found = {"rank": rank, "checks": checks, "losses": losses, "fsdp_modules": fsdp}
    (out / f"rank{rank}.json").write_text(json.dumps(found))
    dist.barrier()
    return 0 if checks and all(not c["differ"] and not c["missing"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2])))
