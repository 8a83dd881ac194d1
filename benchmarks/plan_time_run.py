"""The step-time model against measured steps: configurations of the demo GPT at W=2 on gloo.

Each configuration differs in what a step costs: batch and sequence length, float32 or
bfloat16 gathered parameters, one unit per block or one for the whole model, parameters kept
after forward, blocks recomputed in backward. :func:`measure` trains one on real ranks
(shardkit's engine, ``harness.pool.run_on_ranks``) and returns its fastest step;
:func:`predict` plans it and times the plan on a calibrated profile of this machine. The
benchmark (bench_plan_time.py) checks that the model orders them as measured (Spearman).

Run alone (``python -m benchmarks.plan_time_run``) it prints the table.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from benchmarks.ranking import spearman
from shardkit.tools.plan import Hardware, PlanOptions, StepTime, estimate_step_time, plan
from shardkit.tools.plan.gpt import GPT, GPTConfig

_STEPS, _WARMUP = 6, 2


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """One training setup of the demo GPT (per rank: ``batch`` sequences of ``seq``)."""

    name: str
    batch: int = 8
    seq: int = 128
    bf16: bool = False
    per_block: bool = True
    keep: bool = False  # reshard_after_forward=False everywhere
    recompute: bool = False  # every block checkpointed (full)


CONFIGS = (
    Config(name="base"),
    Config(name="batch 2 x 64", batch=2, seq=64),
    Config(name="batch 4", batch=4),
    Config(name="batch 16", batch=16),
    Config(name="bf16", bf16=True),
    Config(name="one unit", per_block=False),
    Config(name="one unit, batch 2 x 64", per_block=False, batch=2, seq=64),
    Config(name="kept after forward", keep=True),
    Config(name="kept, batch 2 x 64", keep=True, batch=2, seq=64),
    Config(name="recompute", recompute=True),
    Config(name="recompute, bf16", recompute=True, bf16=True),
    Config(name="recompute, batch 4", recompute=True, batch=4),
)
"""Twelve configurations: checkpointing and unit boundaries among them."""


def _gpt_config() -> GPTConfig:
    # The demo size of benchmarks/gpt.py.
    return GPTConfig(vocab_size=256, dim=128, n_layers=6, n_heads=4, max_seq_len=128)


class _Recomputing(GPT):
    """The GPT with every block under (non-reentrant) activation checkpointing; same FQNs."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        h = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False)
        logits: torch.Tensor = self.head(self.ln_f(h))
        return logits


def measure(rank: int, world_size: int, config: dict[str, Any]) -> float:
    """The fastest training step of ``config`` on this rank (a pool task).

    The fastest, not the median: on a machine shared with other work, load only ever adds
    time, so the fastest step is the best estimate of the step on the cores alone.
    """
    from torch.distributed.device_mesh import init_device_mesh

    import shardkit.core as shardkit_core

    c = Config(**config)
    torch.manual_seed(0)
    model = (_Recomputing if c.recompute else GPT)(_gpt_config())
    mesh = init_device_mesh("cpu", (world_size,))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if c.bf16:
        kwargs["mp_policy"] = shardkit_core.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if c.keep:
        kwargs["reshard_after_forward"] = False
    if c.per_block:
        for block in model.blocks:
            shardkit_core.fully_shard(block, **kwargs)
    shardkit_core.fully_shard(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    data = torch.randint(0, 256, (c.batch, c.seq + 1), generator=gen)
    times = []
    for step in range(_WARMUP + _STEPS):
        start = time.perf_counter()
        opt.zero_grad()
        out = model(data[:, :-1])
        loss = F.cross_entropy(out.float().reshape(-1, out.size(-1)), data[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        loss.item()
        if step >= _WARMUP:
            times.append(time.perf_counter() - start)
    return min(times)


def predict(config: Config, hardware: Hardware, world_size: int = 2) -> StepTime:
    """The model's step time of ``config`` on ``hardware``."""
    b, t = config.batch, config.seq

    def inputs() -> torch.Tensor:
        return torch.zeros(b, t, dtype=torch.long, device="meta")

    def loss(out: torch.Tensor) -> torch.Tensor:
        targets = torch.zeros(b * t, dtype=torch.long, device="meta")
        return F.cross_entropy(out.float().reshape(-1, out.size(-1)), targets)

    layers = _gpt_config().n_layers
    options = PlanOptions(
        inputs=inputs,
        loss=loss,
        backend="gloo",
        param_dtype=torch.bfloat16 if config.bf16 else None,
        reshard_after_forward=False if config.keep else None,
        wrap=None if config.per_block else (lambda fqn, module: False),
        checkpoint=tuple((f"blocks.{i}", "full") for i in range(layers))
        if config.recompute
        else (),
    )
    planned = plan(lambda: GPT(_gpt_config()), world_size=world_size, options=options)
    return estimate_step_time(planned, hardware)


def run(rounds: int = 3) -> dict[str, Any]:
    """Measure every configuration (the fastest step of ``rounds``) and predict it."""
    from harness.pool import run_on_ranks
    from shardkit.tools.plan import calibrate

    gpt = _gpt_config()
    hardware = calibrate(  # at the model's sizes: its MLP's matrix multiply, its attention
        2,
        threads=1,
        refresh=True,
        matmul=(8 * gpt.max_seq_len, gpt.dim, 4 * gpt.dim),
        attention=(8, gpt.n_heads, gpt.max_seq_len, gpt.dim // gpt.n_heads),
    )
    measured = {c.name: float("inf") for c in CONFIGS}
    for _ in range(rounds):  # rounds interleaved: a burst of load elsewhere hits all alike
        for c in CONFIGS:
            seconds = max(run_on_ranks(2, measure, config=asdict(c), timeout_s=600))
            measured[c.name] = min(measured[c.name], seconds)
    predicted = {c.name: predict(c, hardware).total_s for c in CONFIGS}
    names = [c.name for c in CONFIGS]
    rho = spearman([measured[n] for n in names], [predicted[n] for n in names])
    assert rho is not None, "Spearman needs two configurations of different times"
    return {"measured": measured, "predicted": predicted, "spearman": rho, "hardware": hardware}


if __name__ == "__main__":
    # The pool's workers import the task by its module's name, which __main__ is not.
    from benchmarks import plan_time_run

    result = plan_time_run.run()
    for name in result["measured"]:
        m, p = result["measured"][name], result["predicted"][name]
        sys.stdout.write(f"{name:<26} measured {m * 1e3:8.1f} ms  predicted {p * 1e3:8.1f} ms\n")
    sys.stdout.write(f"Spearman {result['spearman']:.3f} on {result['hardware'].name}\n")
    sys.stdout.write(json.dumps({"measured": result["measured"], **result["hardware"].to_dict()}))
    sys.stdout.write("\n")
