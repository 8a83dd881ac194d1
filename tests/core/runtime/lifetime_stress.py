"""The buffer-lifetime stress: many short steps with everything that issues or frees buffers.

Each configuration trains the tiny GPT with shardkit's ``fully_shard`` for a number of short
steps, with the lifetime checks on (``SHARDKIT_DEBUG_LIFETIMES``): all-gathers and reductions
in flight across modules (implicit and explicit prefetch, explicit async unshards),
``reshard_after_forward`` True, False and an int, HSDP, and between steps what else gathers
or frees buffers: asynchronous checkpoints (``CheckpointManager``), full state dicts
(``iter_full_state_dict``, checked against each parameter's ``full_tensor()``), and the
optimizer state's full tensors (the FSDP1 layer's path). Last, the FSDP1 layer itself with
``full_optim_state_dict`` every other step.

The oracle: torch's ``fully_shard`` (or FSDP1) trained on the same data without the extras:
the same losses and final parameters (the extras change nothing), no collective left in
flight, and no lifetime error raised. Run on the pool's workers
(``test_lifetime_stress.py``'s short variant), or under ``torchrun`` with glibc's heap checks
(``MALLOC_CHECK_=3``, ``MALLOC_PERTURB_``) for the slow one::

    torchrun --standalone --nproc-per-node 4 -m tests.core.runtime.lifetime_stress \
        --steps 12 --root /tmp/ckpt --out /tmp/results
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.core import models
from tests.core.checkpoint.checkpoint_app import TrainingApp, state_of
from tests.core.parity import (
    Run,
    apply,
    full_params,
    global_loss,
    make_mesh,
    rank_batch,
    train,
)

__all__ = ["CONFIGS", "StressConfig", "check", "stress_body"]


@dataclass(frozen=True, slots=True)
class StressConfig:
    """One way of sharding and stepping the model."""

    name: str
    reshard: bool | int  # reshard_after_forward; an int: the subgroup's size (W // this)
    hsdp: bool = False  # a (2, W/2) mesh of replicas and shards
    prefetch: bool = False  # explicit forward and backward prefetch of the next block
    explicit_unshard: bool = False  # every block's unshard(async_op=True) before forward
    bf16: bool = False  # bfloat16 parameters: the all-gather input is a staging copy (pooled)
    int8_wire: bool = False  # set_reduce_precision(int8, error feedback, checks): shardkit's
    # own compressed reduction, its encoded rows pooled; torch's losses are its oracle
    # within the compression's error only

    def run(self, world_size: int, steps: int) -> Run:
        """parity's Run of this configuration (what torch's fully_shard trains alike)."""
        reshard: bool | int = self.reshard
        if not isinstance(reshard, bool):
            reshard = world_size // reshard
        shard_kwargs: dict[str, Any] = {"reshard_after_forward": reshard}
        if self.bf16:
            from shardkit.core import MixedPrecisionPolicy

            shard_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        return Run(
            model="gpt",
            steps=steps,
            shard_kwargs=shard_kwargs,
            hsdp=(2, world_size // 2) if self.hsdp else None,
            loop="explicit_unshard" if self.explicit_unshard else "plain",
        )


CONFIGS = (
    StressConfig("reshard", True, prefetch=True),
    StressConfig("keep", False, explicit_unshard=True),
    StressConfig("reshard-to-half", 2, prefetch=True),
    StressConfig("hsdp-reshard", True, hsdp=True, explicit_unshard=True),
    StressConfig("hsdp-keep", False, hsdp=True, prefetch=True),
    StressConfig("bf16", True, prefetch=True, bf16=True),
    StressConfig("hsdp-int8-wire", True, hsdp=True, int8_wire=True),
)
"""Every configuration (at W=4; at W=2 those that need 4 ranks are left out)."""

LEGACY = "legacy-full-optim"
"""The name of the FSDP1 layer's part in the results."""


def _fits(config: StressConfig, world_size: int) -> bool:
    if config.hsdp:
        return world_size >= 4 and world_size % 2 == 0
    if not isinstance(config.reshard, bool):
        return world_size // config.reshard > 1
    return True


def _set_prefetch(model: Any) -> None:
    for before, after in itertools.pairwise(model.blocks):
        before.set_modules_to_forward_prefetch([after])
        after.set_modules_to_backward_prefetch([before])


def _full_values_agree(model: Any, optimizer: torch.optim.Optimizer) -> list[str]:
    """Full state dict against each parameter's full_tensor(); optimizer state gathered too."""
    from shardkit.core import iter_full_state_dict

    wrong: list[str] = []
    params = dict(model.named_parameters())
    # Every rank gets every entry (rank0_only=False), so the full_tensor() gathers that
    # interleave with the generator's own run in the same order on every rank.
    for name, value in iter_full_state_dict(model, rank0_only=False):
        param = params.get(name)
        if isinstance(param, DTensor) and not torch.equal(value, param.full_tensor()):
            wrong.append(name)
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, DTensor):
                value.full_tensor().cpu()  # as FSDP1's full optimizer state gathers it
    return wrong


def _train_shardkit(
    config: StressConfig, rank: int, world_size: int, steps: int, root: Path
) -> dict[str, Any]:
    from shardkit.core import CheckpointManager
    from tests.core.runtime.flights import baseline, since

    before = baseline()
    run = config.run(world_size, steps)
    model = models.build(run.model)
    apply("shardkit", model, make_mesh(run, world_size), run)
    if config.prefetch:
        _set_prefetch(model)
    if config.int8_wire:
        from shardkit.core import ReducePrecision

        policy = ReducePrecision(
            wire_dtype=torch.int8, error_feedback=True, check_every=2, check_tolerance=0.05
        )
        for module in [*model.blocks, model]:
            module.set_reduce_precision(policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=run.lr, momentum=0.9)
    app = TrainingApp(model, optimizer)
    manager = CheckpointManager(root / config.name, keep=2)
    losses: list[float] = []
    wrong: list[str] = []
    saved: dict[str, torch.Tensor] = {}
    for step in range(steps):
        x, y = rank_batch(run.model, step, rank, world_size, "shardkit", run.per_rank_batch)
        if config.explicit_unshard:
            for block in model.blocks:
                block.unshard(async_op=True)
        loss = models.loss_of(run.model, model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(global_loss(loss, "shardkit", world_size))
        app.step = step + 1
        if step % 3 == 1:
            manager.save(app.step, {"app": app}, async_save=True)
            saved = state_of(app)  # what that save holds (training goes on meanwhile)
        elif step % 3 == 2:
            wrong += _full_values_agree(model, optimizer)
    manager.wait()
    restored = TrainingApp(*_fresh(run, world_size))
    manager.load({"app": restored})
    after_load = state_of(restored)
    return {
        "losses": losses,
        "params": {k: v.tolist() for k, v in full_params(model).items()},
        "wrong_full_values": wrong,
        "left_in_flight": [f.describe() for f in since(before)],
        "checkpoint_differs": sorted(k for k in saved if not torch.equal(saved[k], after_load[k])),
    }


def _fresh(run: Run, world_size: int) -> tuple[Any, torch.optim.Optimizer]:
    model = models.build(run.model)
    apply("shardkit", model, make_mesh(run, world_size), run)
    return model, torch.optim.SGD(model.parameters(), lr=run.lr, momentum=0.9)


def _legacy(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    """FSDP1's full optimizer state gathered every other step, against torch's FSDP1."""
    from tests.core.runtime.flights import baseline, since
    from tests.legacy.legacy_parity import train_steps, wrap_model
    from tests.legacy.optim_support import RUN, adamw, call, comparable

    before = baseline()
    out: dict[str, Any] = {}
    for impl in ("shardkit", "torch"):
        model = wrap_model(impl, RUN)
        optimizer = adamw(model)
        losses: list[float] = []
        for step in range(steps):
            losses += train_steps(model, optimizer, RUN, range(step, step + 1))
            if impl == "shardkit" and step % 2 == 1:
                call(impl, "full_optim_state_dict", model, optimizer, rank0_only=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            full = call(impl, "full_optim_state_dict", model, optimizer, rank0_only=False)
        out[impl] = {"losses": losses, "optim": comparable(full)}
    out["left_in_flight"] = [f.describe() for f in since(before)]
    return out


def stress_body(
    rank: int, world_size: int, steps: int, root: str, names: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Every configuration (or those ``names``), then the FSDP1 part (if named or none are)."""
    from shardkit.core.runtime.watch.progress import SETTINGS

    assert SETTINGS.lifetime_checks, "the stress runs with SHARDKIT_DEBUG_LIFETIMES=1"
    results: dict[str, Any] = {}
    for config in CONFIGS:
        if _fits(config, world_size) and (not names or config.name in names):
            ours = _train_shardkit(config, rank, world_size, steps, Path(root))
            theirs = train("torch", config.run(world_size, steps), rank, world_size)
            ours["torch_losses"] = theirs["losses"]
            ours["torch_params"] = {k: v.tolist() for k, v in theirs["params"].items()}
            ours["tolerance"] = 5e-2 if config.int8_wire else 0.0
            results[config.name] = ours
    if not names or LEGACY in names:
        results[LEGACY] = _legacy(rank, world_size, steps)
    return results


def check(results: dict[str, Any]) -> None:
    """Raise AssertionError where one rank's results break a rule (see the module docstring)."""
    for name, result in results.items():
        assert not result["left_in_flight"], f"{name}: {result['left_in_flight']}"
        if name == LEGACY:
            ours, theirs = result["shardkit"], result["torch"]
            torch.testing.assert_close(ours["losses"], theirs["losses"], rtol=1e-5, atol=1e-6)
            _same_optim(ours["optim"], theirs["optim"], name)
            continue
        assert not result["wrong_full_values"], f"{name}: {result['wrong_full_values']}"
        assert not result["checkpoint_differs"], f"{name}: {result['checkpoint_differs']}"
        # Bit for bit where the reduction is torch's; within its error where it is int8.
        tol = result["tolerance"]
        torch.testing.assert_close(
            result["losses"], result["torch_losses"], rtol=tol, atol=tol, msg=name
        )
        for key, value in result["params"].items():
            theirs = torch.tensor(result["torch_params"][key])
            torch.testing.assert_close(
                torch.tensor(value), theirs, rtol=tol, atol=tol, msg=f"{name}: {key}"
            )


def _same_optim(ours: Any, theirs: Any, where: str) -> None:
    from tests.legacy.optim_support import assert_same

    assert_same(ours, theirs, where)


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--root", required=True, help="the checkpoints' folder")
    parser.add_argument("--out", required=True, help="where each rank writes its results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = stress_body(rank, world_size, args.steps, args.root)
    check(results)
    Path(args.out, f"rank-{rank}.json").write_text(json.dumps(_summary(results)))
    dist.barrier()
    dist.destroy_process_group()


def _summary(results: dict[str, Any]) -> dict[str, Any]:
    """What the slow test reads: each part's losses and what was left in flight."""
    summary: dict[str, Any] = {}
    for name, result in results.items():
        part = result["shardkit"] if name == LEGACY else result
        summary[name] = {"losses": part["losses"], "left_in_flight": result["left_in_flight"]}
    summary["pid"] = os.getpid()
    return summary


if __name__ == "__main__":
    _main()
