"""A GRPO-style loop at W=2 on CPU: vLLM generates, ``fully_shard`` trains, the export syncs.

Why: an RL post-training loop sends the trainer's weights to its inference engine after every
optimizer step. This example is that loop, written by hand and small enough for a CPU: every
rank holds a colocated in-process vLLM engine (vLLM's ``external_launcher`` backend, which
joins torchrun's process group) and one shard of the trainer, a tiny Qwen2 in fp32 sharded by
``shardkit.core.fully_shard`` per decoder layer and at the root. Each step:

1. every rank's engine samples ``--group`` completions for each of its prompts (random token
   ids, temperature 1, seeded by rank and step);
2. a toy reward (the fraction of even token ids in a completion) and group-normalized
   advantages, ``(r - mean) / (std + eps)`` within each prompt's group (GRPO);
3. the policy-gradient loss on the trainer (each completion's summed token log-probabilities
   times its advantage, averaged), backward, an AdamW step;
4. ``WeightExporter(..., to="all").export(receiver, delta=True)``: every rank's engine gets
   the new weights in bf16 (a full export first, then the changed elements only);
5. the check of that sync: every weight the engine computes with, read back from it, equals
   the trainer's (``full_tensor()`` cast to bf16), on every rank.

After the last step, the check the export promises end to end: the trainer's weights are saved
to a folder and a fresh vLLM engine is started from it; the synced engine's greedy tokens and
log-probabilities must equal that engine's, bit for bit (and differ from the untrained
engine's, so the comparison is not of two unchanged models). The script exits 1 when any check
fails. A JSON summary goes to ``--out``/summary.json.

Run (vLLM's CPU build: ``make check-vllm`` builds .venv-vllm)::

    .venv-vllm/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        demo/grpo_vllm.py --steps 3 --out /tmp/grpo

See docs/guide/export.md ("A GRPO loop with vLLM").
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from shardkit.core import fully_shard
from shardkit.core.export import ExportOptions, ExportReport, WeightExporter
from shardkit.core.export.vllm import VLLMReceiver, vllm_receiver
from shardkit.core.export.vllm_read_back import served_tensors

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# vLLM's CPU build warns at every engine start about what this example does on purpose (no
# tokenizer, its own thread count): a few hundred lines around the script's own five.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

ENGINE_DTYPE = torch.bfloat16
PROMPT_LEN = 8
CHECK_PROMPTS = ([3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26])
CHECK_TOKENS = 12
TOP_LOGPROBS = 5

Greedy = list[tuple[list[int], list[list[tuple[int, float]]]]]
"""Per check prompt: the greedy tokens, and each step's top (token, log-probability) pairs."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True, help="folder for summary.json")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per rank and step")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt (G)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def allow_amx() -> None:
    """Requests the AMX tile state that vLLM's bf16 CPU kernels use but do not request.

    Without it their first forward dies of SIGILL on a CPU with AMX; elsewhere the request
    fails harmlessly (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``).
    """
    arch_prctl, req_xcomp_perm, xtiledata = 158, 0x1023, 18
    ctypes.CDLL(None).syscall(arch_prctl, req_xcomp_perm, xtiledata)


def tiny_qwen2_config(layers: int) -> Any:
    """A Qwen2 of hidden 128, 2 heads of 64 (vLLM's CPU attention needs >= 32), vocab 512."""
    transformers = importlib.import_module("transformers")
    return transformers.Qwen2Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def save_initial_model(folder: Path, *, layers: int, seed: int) -> None:
    """The starting weights, seeded, in bf16 (what vLLM loads), saved before any group exists."""
    transformers = importlib.import_module("transformers")
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(tiny_qwen2_config(layers)).to(ENGINE_DTYPE)
    model.save_pretrained(folder)


def start_engine(
    folder: Path,
    *,
    seed: int,
    shares_the_group: bool = True,
    max_num_seqs: int = 16,
    **engine_args: Any,
) -> Any:
    """A ``vllm.LLM`` on ``folder`` in this process: eager, bf16, a small cache.

    ``shares_the_group``: the engine joins torchrun's process group (vLLM's
    ``external_launcher``), as each training rank's engine does here; else it makes its own.
    ``engine_args`` go to ``vllm.LLM`` as well (``worker_extension_cls``,
    ``tensor_parallel_size``).
    """
    allow_amx()
    vllm = importlib.import_module("vllm")
    launcher = {"distributed_executor_backend": "external_launcher"} if shares_the_group else {}
    return vllm.LLM(
        model=str(folder),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=128,
        max_num_seqs=max_num_seqs,
        enforce_eager=True,
        seed=seed,
        **launcher,
        **engine_args,
    )


def sample(
    llm: Any, prompts: list[list[int]], *, group: int, max_tokens: int, seed: int
) -> list[list[list[int]]]:
    """``group`` sampled completions (token ids, exactly ``max_tokens`` each) per prompt."""
    vllm = importlib.import_module("vllm")
    requests = [{"prompt_token_ids": p} for p in prompts]
    params = [
        vllm.SamplingParams(
            n=group,
            temperature=1.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            seed=seed + i,
        )
        for i in range(len(prompts))
    ]
    outputs = llm.generate(requests, params, use_tqdm=False)
    return [[list(c.token_ids) for c in out.outputs] for out in outputs]


def reward(completion: list[int]) -> float:
    """The toy reward: the fraction of the completion's tokens whose id is even."""
    return sum(1 for t in completion if t % 2 == 0) / max(len(completion), 1)


def advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's: each reward against its group's, ``rewards`` shaped (prompts, group)."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)
    return (rewards - mean) / (std + eps)


def policy_loss(
    model: torch.nn.Module, prompts: list[list[int]], completions: list[list[list[int]]]
) -> tuple[torch.Tensor, float]:
    """The policy-gradient loss of the completions, and their mean reward."""
    rows: list[list[int]] = []
    rewards: list[list[float]] = []
    for prompt, group in zip(prompts, completions, strict=True):
        rows.extend(prompt + c for c in group)
        rewards.append([reward(c) for c in group])
    scores = torch.tensor(rewards, dtype=torch.float32)
    weights = advantages(scores).reshape(-1)
    ids = torch.tensor(rows, dtype=torch.long)
    logits = model(input_ids=ids).logits.float()
    # The logit at position t predicts token t + 1: the completion starts at len(prompt).
    start = len(prompts[0])
    logprobs = torch.log_softmax(logits[:, start - 1 : -1], dim=-1)
    taken = logprobs.gather(-1, ids[:, start:].unsqueeze(-1)).squeeze(-1)
    loss = -(taken.sum(dim=1) * weights).mean()
    return loss, float(scores.mean())


def greedy(llm: Any) -> Greedy:
    """Greedy tokens and each step's top log-probabilities for :data:`CHECK_PROMPTS`."""
    vllm = importlib.import_module("vllm")
    params = vllm.SamplingParams(temperature=0.0, max_tokens=CHECK_TOKENS, logprobs=TOP_LOGPROBS)
    outputs = llm.generate(
        [{"prompt_token_ids": list(p)} for p in CHECK_PROMPTS], params, use_tqdm=False
    )
    found: Greedy = []
    for out in outputs:
        c = out.outputs[0]
        steps = [sorted((t, e.logprob) for t, e in step.items()) for step in c.logprobs]
        found.append((list(c.token_ids), steps))
    return found


def trainer_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the trainer, whole, in the engine's dtype (a collective: every rank)."""
    state = model.state_dict()
    return {
        name: (t.full_tensor() if hasattr(t, "full_tensor") else t).to(ENGINE_DTYPE)
        for name, t in state.items()
    }


def engine_weights(worker: Any) -> dict[str, torch.Tensor]:
    """On vLLM's worker: every weight the engine computes with, under the checkpoint's names.

    Run through ``llm.collective_rpc``: the package's read-back (its linear layers' weights
    read through the kernels, the fused layers split back; see
    ``shardkit.core.export.vllm_read_back``).
    """
    return served_tensors(worker)


def check_sync(
    llm: Any, model: torch.nn.Module, before: dict[str, torch.Tensor]
) -> tuple[list[str], int, dict[str, torch.Tensor]]:
    """After an export: the names whose engine weight differs from the trainer's (none when
    the sync is right), how many elements changed since ``before``, and the engine's weights.

    A collective (the trainer's ``full_tensor()``): every rank calls it, each on its engine.
    The engine keeps some tensors in another dtype than it was sent (the CPU build's biases are
    fp32): the trainer's bf16 value is cast to that, exactly, rather than the engine's value
    rounded to bf16, which could hide a difference.
    """
    engine = llm.collective_rpc(engine_weights)[0]
    trainer = trainer_weights(model)
    wrong = sorted(set(engine) ^ set(trainer))
    wrong += [
        n
        for n in sorted(set(engine) & set(trainer))
        if not torch.equal(engine[n], trainer[n].to(engine[n].dtype))
    ]
    changed = sum(int((engine[n] != before[n]).sum()) for n in engine if n in before)
    return wrong, changed, engine


def check_bit_identity(
    llm: Any,
    receiver: VLLMReceiver,
    model: torch.nn.Module,
    untrained: Greedy,
    source: Path,
    folder: Path,
) -> dict[str, Any]:
    """The synced engine against a fresh one started from the trainer's weights, saved now.

    Also the receiver's copy of the last export (what the next delta is computed against)
    against the trainer's weights, and the synced engine's greedy outputs against its own
    before training (``untrained``): they must have moved, or the comparison proves nothing.
    """
    rank = dist.get_rank()
    full = trainer_weights(model)
    mirror_equal = sorted(receiver.mirror) == sorted(full) and all(
        torch.equal(receiver.mirror[n], t) for n, t in full.items()
    )
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        for path in source.iterdir():
            if path.suffix != ".safetensors" and path.is_file():
                shutil.copy(path, folder / path.name)
        save_file(
            {n: t.contiguous() for n, t in full.items()},
            folder / "model.safetensors",
            metadata={"format": "pt"},
        )
    dist.barrier()
    synced = greedy(llm)
    fresh_engine = start_engine(folder, seed=rank)
    fresh = greedy(fresh_engine)
    flags = torch.tensor([synced == fresh, mirror_equal, synced != untrained], dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    # This is the last collective of the run: when ``fresh_engine`` is dropped, vLLM's engine
    # shutdown (``cleanup_dist_env_and_memory``) destroys the default process group, the one
    # it joined through ``external_launcher``, which is also the trainer's.
    del fresh_engine
    return {
        "greedy_equal": bool(flags[0]),
        "mirror_equal": bool(flags[1]),
        "greedy_moved": bool(flags[2]),
        "greedy_tokens": [tokens for tokens, _ in synced],
        "passed": bool(flags.all()),
    }


def step_figures(
    step: int, report: ExportReport, mean_reward: float, loss: float
) -> dict[str, Any]:
    return {
        "step": step,
        "mean_reward": mean_reward,
        "loss": loss,
        "kind": report.kind,
        "buckets": report.buckets,
        "sent_bytes": report.counts.sent_bytes,
        "export_s": report.seconds,
        "receiver_s": report.handoff_seconds,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    args.out.mkdir(parents=True, exist_ok=True)
    initial = args.out / "initial"
    if rank == 0:
        save_initial_model(initial, layers=args.layers, seed=args.seed)
    begun = time.perf_counter()
    dist.init_process_group("gloo")  # after the save: save_pretrained writes on rank 0 only
    dist.barrier()  # the folder is complete before any engine reads it

    llm = start_engine(initial, seed=rank)  # the same order on every rank: it joins the group
    receiver = vllm_receiver(llm)

    transformers = importlib.import_module("transformers")
    model = transformers.Qwen2ForCausalLM.from_pretrained(initial, torch_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    exporter = WeightExporter(model, ExportOptions(dtype=ENGINE_DTYPE, to="all"))
    vocab = model.config.vocab_size
    # The engine before any sync: its weights, to count what each sync changes, and its
    # greedy outputs, which training must move.
    engine_before = llm.collective_rpc(engine_weights)[0]
    untrained = greedy(llm)
    if rank == 0:
        print(f"engines and trainer ready in {time.perf_counter() - begun:.1f} s", flush=True)

    steps: list[dict[str, Any]] = []
    for step in range(args.steps):
        generator = torch.Generator().manual_seed(args.seed * 100_003 + step * world + rank)
        prompts = torch.randint(0, vocab, (args.prompts, PROMPT_LEN), generator=generator)
        prompt_ids = prompts.tolist()
        completions = sample(
            llm,
            prompt_ids,
            group=args.group,
            max_tokens=args.max_tokens,
            seed=(step * world + rank) * 1_000,
        )
        loss, mean_reward = policy_loss(model, prompt_ids, completions)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        report = exporter.export(receiver, delta=True)
        wrong, changed, engine_before = check_sync(llm, model, engine_before)
        if wrong:
            print(f"rank {rank}, step {step + 1}: the engine's {wrong} differ", flush=True)

        # Every rank's figures, reduced: the mean reward and loss and the bytes all ranks sent
        # (summed), the slowest rank's seconds, and whether every rank's engine matched (min).
        sums = torch.tensor(
            [mean_reward, float(loss.detach()), report.counts.sent_bytes], dtype=torch.float64
        )
        dist.all_reduce(sums)
        slow = torch.tensor([report.seconds, report.handoff_seconds], dtype=torch.float64)
        dist.all_reduce(slow, op=dist.ReduceOp.MAX)
        matched = torch.tensor([not wrong], dtype=torch.int32)
        dist.all_reduce(matched, op=dist.ReduceOp.MIN)
        figures = step_figures(step, report, float(sums[0]) / world, float(sums[1]) / world)
        figures["sent_bytes_all_ranks"] = int(sums[2])
        figures["export_s_slowest"], figures["receiver_s_slowest"] = slow.tolist()
        figures["engine_equals_trainer"] = bool(matched)
        figures["elements_changed"] = changed
        steps.append(figures)
        if rank == 0:
            print(
                f"step {step + 1}/{args.steps}: reward {figures['mean_reward']:.3f} "
                f"loss {figures['loss']:+.4f} | export {report.kind}: "
                f"{figures['sent_bytes_all_ranks'] / 1024:.1f} KiB sent (all ranks), "
                f"{changed} elements changed, {report.seconds:.3f} s, of which the receiver "
                f"{report.handoff_seconds:.3f} s (rank 0) | engine == trainer: {bool(matched)}",
                flush=True,
            )

    check = check_bit_identity(
        llm, receiver, model, untrained, initial, args.out / f"trainer_step{args.steps}"
    )
    passed = check["passed"] and all(s["engine_equals_trainer"] for s in steps)
    summary = {
        "world_size": world,
        "steps": steps,
        "bit_identity": check,
        "passed": passed,
        "seconds": time.perf_counter() - begun,
    }
    if rank == 0:
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
        verdict = "bit-identical" if check["passed"] else "DIFFERENT"
        print(
            f"after step {args.steps}: the synced engine and one started from the trainer's "
            f"weights are {verdict} (greedy tokens and log-probabilities: "
            f"{check['greedy_equal']}, moved by training: {check['greedy_moved']}, "
            f"the receiver's copy: {check['mirror_equal']}); every sync matched: "
            f"{all(s['engine_equals_trainer'] for s in steps)}",
            flush=True,
        )
    # The fresh engine's shutdown already destroyed the process group (check_bit_identity);
    # a vLLM that left it standing would need it ended here.
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
